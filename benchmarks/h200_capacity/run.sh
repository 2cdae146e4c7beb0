#!/usr/bin/env bash
# soakd's capacity on the H200 machine's 16 cores (benchmarks/bench_capacity.py against the stand-in server;
# README in benchmarks/RESULTS.md, "Capacity"). From the repository root of a checkout with the GPU bundle
# in .gpu_bundle/ and soakd's dependency wheels in .gpu_wheels/ (the bundle brings pydantic and vLLM, which
# soakd imports; the GPU is not used). Results as JSON under $1.
#   bash benchmarks/h200_capacity/run.sh OUT [levels ...]
set -uo pipefail
OUT=${1:?results folder}
shift
LEVELS=${*:-10000 25000 50000}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh || exit 1
python3 -c 'from soakd.engine import native; from soakd.replay import prompts
print("native reader:", native.available() or native.UNAVAILABLE, "; prompt blocks in C:", prompts._prompts is not None)' \
  > "$OUT/reader.txt" 2>&1
B="python3 benchmarks/bench_capacity.py --seconds 20 --server-procs 8 --json"
# Each level with the Python reader, then the native one (each against its own baseline run).
# shellcheck disable=SC2086
timeout 480 $B --levels $LEVELS --readers python native --keep /tmp/cap1 > "$OUT/readers.json" 2> "$OUT/readers.err"
