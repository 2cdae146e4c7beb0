#!/usr/bin/env bash
# MiMo-7B-RL shape with vLLM's `mtp` speculation on an H200, ~3 min. Setup as benchmarks/h200_control/run.sh.
#   bash benchmarks/h200_mtp/run.sh /tmp/mtp
set -uo pipefail
OUT=${1:?results folder}
mkdir -p "$OUT"
if [[ ! -d /tmp/site/vllm ]]; then
  mkdir -p /tmp/bundle && cp .gpu_bundle/* /tmp/bundle/ && (cd /tmp/bundle && bash install.sh) >"$OUT/install.log" 2>&1 || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_wheels/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/daemon VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -m soakd model shape mimo-7b-rl /tmp/mimo-7b > "$OUT/shape.txt" 2>&1 || exit 1
python3 -m soakd run --config benchmarks/h200_mtp/config.toml --json --no-progress > "$OUT/summary.json" 2> "$OUT/stderr.log"
echo "rc $?"
run=$(ls -d /tmp/runs/*/ | tail -1)
cp "$run"/{meta.json,verdict.json} "$OUT/" 2>/dev/null
cat "$run"/spool/seg-*.lp | grep -E '^(spec_decode|engine|requests|events|run)[, ]' | gzip > "$OUT/spool.lp.gz"
