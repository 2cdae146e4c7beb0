#!/usr/bin/env bash
# Set up and run a short soak on the embedded defaults: the bundled trace, the tiny local model, no
# InfluxDB (samples stay in the run's spool), then write the run's sign-off report. Extra arguments go
# to `soakd run` (e.g. --duration 10m). Exits with `soakd run`'s code (0 PASS, 1 FAIL, 2 bad input, 3
# aborted).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [[ ! -f models/tiny/config.json ]]; then
  .venv/bin/soakd model tiny models/tiny
fi
started=$(date +%s)
set +e
.venv/bin/soakd run --config config.toml "$@"
rc=$?
set -e
# The run this command started (runs/ is config.toml's run.output_dir): its report, from the spool.
run=$(find runs -mindepth 1 -maxdepth 1 -type d -newermt "@$started" 2>/dev/null | sort | tail -1)
if [[ -n "$run" && -f "$run/verdict.json" ]]; then
  .venv/bin/soakd report "$run" >/dev/null 2>&1 || true
  [[ -f "$run/report.html" ]] && echo "sign-off report: $run/report.html"
fi
exit $rc
