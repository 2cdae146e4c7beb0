"""The live judge: the run's request and metrics folds, the criteria and the verdict. It runs inside the
soak (and again, offline, from a run folder in soakd.report)."""
