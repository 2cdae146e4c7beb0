"""The live judge: the criteria language, the run's metrics fold, the criteria and the verdict. It runs
inside the soak (and again, offline, from a run folder in soakd.report)."""
