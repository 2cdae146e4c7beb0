#!/usr/bin/env bash
# Set up and run everything CI checks: ruff, mypy (strict), and the whole pytest suite, including the
# integration tests against a real InfluxDB, victoria-metrics and a real vLLM CPU engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --servers
.venv/bin/ruff check daemon tests scripts benchmarks
.venv/bin/ruff format --check daemon tests scripts benchmarks
.venv/bin/mypy
# In CI a missing server or systemd-analyze is a failure, never a skip.
export SOAKD_REQUIRE_SERVERS=1 SOAKD_REQUIRE_SYSTEMD=1
set +e
.venv/bin/python -m pytest --durations=25 "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
