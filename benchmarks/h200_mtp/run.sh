#!/usr/bin/env bash
# MiMo-7B-RL shape with vLLM's `mtp` speculation on an H200, ~3 min. Setup: benchmarks/gpu_env.sh.
#   bash benchmarks/h200_mtp/run.sh /tmp/mtp
set -uo pipefail
OUT=${1:?results folder}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh >"$OUT/install.log" 2>&1 || exit 1
python3 -m soakd model shape mimo-7b-rl /tmp/mimo-7b > "$OUT/shape.txt" 2>&1 || exit 1
python3 -m soakd run --config benchmarks/h200_mtp/config.toml --json --no-progress > "$OUT/summary.json" 2> "$OUT/stderr.log"
echo "rc $?"
run=$(ls -d /tmp/runs/*/ | tail -1)
cp "$run"/{meta.json,verdict.json} "$OUT/" 2>/dev/null
cat "$run"/spool/seg-*.lp | grep -E '^(spec_decode|engine|requests|events|run)[, ]' | gzip > "$OUT/spool.lp.gz"
