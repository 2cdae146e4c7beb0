#!/usr/bin/env bash
# Set up and run a short soak on the embedded defaults: the bundled trace, the tiny local model, no
# InfluxDB (samples stay in the run's spool). The run writes its verdict and its sign-off report
# (runs/<run id>/report.html). Extra arguments go to `soakd run` (e.g. --duration 10m).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [[ ! -f models/tiny/config.json ]]; then
  .venv/bin/soakd model tiny models/tiny
fi
exec .venv/bin/soakd run --config config.toml "$@"
