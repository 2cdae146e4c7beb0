#!/usr/bin/env bash
# soakd's capacity on the H200 machine's 16 cores (benchmarks/bench_capacity.py against the stand-in server;
# README in benchmarks/RESULTS.md, "Capacity"). From the repository root of a checkout with the GPU bundle
# in .gpu_bundle/ and soakd's dependency wheels in .gpu_wheels/ (the bundle brings pydantic and vLLM, which
# soakd imports; the GPU is not used). Results as JSON under $1.
#   bash benchmarks/h200_capacity/run.sh OUT [levels ...]
set -uo pipefail
OUT=${1:?results folder}
shift
LEVELS=${*:-10000 50000}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh || exit 1
B="python3 benchmarks/bench_capacity.py --seconds 20 --server-procs 8 --json"
# shellcheck disable=SC2086
timeout 140 $B --levels $LEVELS --keep /tmp/cap1 > "$OUT/senders1.json" 2> "$OUT/senders1.err"
timeout 75 $B --levels 50000 --senders 2 --keep /tmp/cap2 > "$OUT/senders2.json" 2> "$OUT/senders2.err"
