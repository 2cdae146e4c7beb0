#!/usr/bin/env bash
# The SLO-bound case of the control A/B on an H200 (pays.toml): advice-only first (its TPOT under the
# outside load sets the limit), then control on, then advice-only again (run-to-run noise). The matmul
# load runs from 90 s to 240 s of each 320 s replay. Same setup as run.sh; results under $1.
#   bash benchmarks/h200_control/pays.sh /tmp/pays
set -uo pipefail
OUT=${1:?results folder}
HERE=benchmarks/h200_control
mkdir -p "$OUT"
exec >>"$OUT/run.log" 2>&1
source benchmarks/gpu_env.sh || exit 1
[[ -d /tmp/qwen3-8b ]] || python3 -m soakd model shape qwen3-8b /tmp/qwen3-8b || exit 1
nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > "$OUT/smi_before.txt"

arm() {  # name, extra --set ...
  local name=$1; shift
  echo "== $name $(date -u +%T)"
  mkdir -p "$OUT/$name"
  python3 $HERE/gpu_load.py --runs /tmp/runs/$name --after 90 --seconds 150 --out "$OUT/$name/times.json" \
    > "$OUT/$name/load.txt" 2>&1 &
  python3 -m soakd run --config $HERE/pays.toml --json --no-progress \
    --set run.name="$name" --set run.output_dir="/tmp/runs/$name" "$@" > "$OUT/$name/summary.json" 2> "$OUT/$name/stderr.log"
  echo "rc $name $?"
  wait
  local run; run=$(ls -d /tmp/runs/$name/*/ | tail -1)
  cp "$run"/{meta.json,verdict.json,control-state.json} "$OUT/$name/" 2>/dev/null
  cat "$run"/spool/seg-*.lp | gzip > "$OUT/$name/spool.lp.gz"
  ls "$run" > "$OUT/$name/files.txt"
}

arm dryrun1 --set control.dry_run=true
TPOT=$(python3 $HERE/slo.py "$OUT/dryrun1/spool.lp.gz" --times "$OUT/dryrun1/times.json" --quantile 0.25)
echo "tpot limit: $TPOT ms (p25 of the full batch's TPOT under the load)"
echo "$TPOT" > "$OUT/tpot_limit_ms"
arm control --set criteria.tpot_p99_ms="$TPOT"
arm dryrun2 --set criteria.tpot_p99_ms="$TPOT" --set control.dry_run=true
nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > "$OUT/smi_after.txt"
echo "== done $(date -u +%T)"
touch "$OUT/DONE"
