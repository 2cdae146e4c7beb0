#!/usr/bin/env bash
# The whole suite N times in a row from a fresh clone of this checkout's HEAD with a CPU hog on every core
# beside it (the busy-machine check in benchmarks/RESULTS.md). Logs and wall times under $OUT.
#   bash scripts/suite_beside_hogs.sh OUT [runs, default 2]
set -u
OUT=${1:?a folder for the logs}
RUNS=${2:-2}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
clone=$(mktemp -d)/soakd
git clone -q "$(git rev-parse --show-toplevel)" "$clone" && cd "$clone" || exit 1
hogs=()
for _ in $(seq "$(nproc)"); do python3 -c "while True: pass" & hogs+=($!); done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
for i in $(seq "$RUNS"); do
  s=$(date +%s)
  .ci/run > "$OUT/run$i.log" 2>&1; rc=$?
  echo "run$i rc $rc wall $(( $(date +%s) - s )) s $(tail -1 "$OUT/run$i.log")" | tee -a "$OUT/times"
done
