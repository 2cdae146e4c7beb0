#!/usr/bin/env bash
# The README's GPU path on an H200: config.gpu.toml as shipped, with a Qwen3-8B shape (random weights:
# the machine reaches no hub) and this vLLM build's attention backend; a short run instead of the night.
# Runs from the repository root with the GPU bundle in .gpu_bundle/ and soakd's wheels in .gpu_wheels/.
#   bash benchmarks/h200_quickstart/run.sh OUT [DURATION]
set -uo pipefail
OUT=${1:?results folder}
DURATION=${2:-3m}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh || exit 1
t0=$(date +%s)
[[ -d /tmp/qwen3-8b ]] || python3 -m soakd model shape qwen3-8b /tmp/qwen3-8b > "$OUT/shape.log" 2>&1 || exit 1
python3 -m soakd check --config config.gpu.toml --model /tmp/qwen3-8b > "$OUT/check.txt" 2>&1
echo "check rc $?" >> "$OUT/check.txt"
# stdout: the summary and verdict a person reads; stderr: soakd's log lines only (the engine's output
# goes to the run's engine.log).
python3 -m soakd run --config config.gpu.toml --model /tmp/qwen3-8b --duration "$DURATION" --no-progress \
  --set engine.load_format=dummy --set 'engine.extra_args={attention_backend="TRITON_ATTN"}' \
  --set run.output_dir=/tmp/runs > "$OUT/stdout.txt" 2> "$OUT/stderr.log"
echo "run rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/stdout.txt"
run=$(ls -d /tmp/runs/*/ | tail -1)
cp "$run"/{meta.json,verdict.json,summary.json,report.json,report.html,engine.log} "$OUT/" 2>/dev/null
cat "$run"/spool/seg-*.lp | gzip > "$OUT/spool.lp.gz"
