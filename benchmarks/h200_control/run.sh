#!/usr/bin/env bash
# The control A/B on an H200 (see README.md beside this file). Runs from the repository root of a checkout
# with the GPU bundle in .gpu_bundle/ and soakd's dependency wheels in .gpu_wheels/; results under $1.
#   bash benchmarks/h200_control/run.sh /tmp/ab            # all three arms, in the background
set -uo pipefail
OUT=${1:?results folder}
HERE=benchmarks/h200_control
mkdir -p "$OUT"
exec >>"$OUT/run.log" 2>&1
source benchmarks/gpu_env.sh || exit 1
[[ -d /tmp/qwen3-8b ]] || python3 -m soakd model shape qwen3-8b /tmp/qwen3-8b || exit 1
nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > "$OUT/smi_before.txt"

arm() {  # name, load (yes/no), duration, extra --set ...
  local name=$1 load=$2 dur=$3; shift 3
  echo "== $name $(date -u +%T)"
  mkdir -p "$OUT/$name"
  if [[ $load == yes ]]; then
    python3 $HERE/gpu_load.py --runs /tmp/runs/$name --after 120 --seconds 150 --out "$OUT/$name/times.json" \
      > "$OUT/$name/load.txt" 2>&1 &
  fi
  python3 -m soakd run --config $HERE/config.toml --json --no-progress --duration "$dur" \
    --set run.name="$name" --set run.output_dir="/tmp/runs/$name" "$@" > "$OUT/$name/summary.json" 2> "$OUT/$name/stderr.log"
  echo "rc $name $?"
  wait
  local run; run=$(ls -d /tmp/runs/$name/*/ | tail -1)
  cp "$run"/{meta.json,verdict.json,control-state.json} "$OUT/$name/" 2>/dev/null
  cat "$run"/spool/seg-*.lp | gzip > "$OUT/$name/spool.lp.gz"
  ls "$run" > "$OUT/$name/files.txt"
}

# 1. load-free: control on, no external load. Its TPOT sets the SLO of the A/B: 1.25 x its p90.
arm free no 240s
TPOT=$(python3 $HERE/slo.py "$OUT/free/spool.lp.gz")
echo "tpot limit for the A/B: $TPOT ms"
# 2. control on and 3. advice only, the same load window (120-270 s of a 370 s replay).
arm control yes 370s --set criteria.tpot_p99_ms="$TPOT"
arm dryrun yes 370s --set criteria.tpot_p99_ms="$TPOT" --set control.dry_run=true
nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > "$OUT/smi_after.txt"
echo "== done $(date -u +%T)"
touch "$OUT/DONE"
