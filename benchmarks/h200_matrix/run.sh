#!/usr/bin/env bash
# The control matrix on an H200 (matrix.toml; README in benchmarks/RESULTS.md, "The control matrix").
# Three scenarios x {control, advice-only} with a load-free arm, an A/A of soakd's scheduler class and
# repeats for noise, in priority order; an arm starts only when it can end before the deadline.
# From the repository root of a checkout with the GPU bundle in .gpu_bundle/ and soakd's dependency
# wheels in .gpu_wheels/; results under $1, packed into $1.tgz after every arm. Copy back the archive,
# not the folder: a copy of many small files can be cut short, and the spools are what the tests replay.
#   bash benchmarks/h200_matrix/run.sh /tmp/matrix [deadline, Unix s] [arm ...]
set -uo pipefail
OUT=${1:?results folder}
DEADLINE=${2:-0}
shift $(( $# >= 2 ? 2 : $# ))
HERE=benchmarks/h200_matrix
LOAD=benchmarks/h200_control/gpu_load.py
ARM_S=${ARM_S:-190}   # one arm: engine start (~45 s from the compile cache) + 95 s replay + drain, report
DURATION=${DURATION:-}  # a shorter replay for load-free arms (the A/A of the scheduler class), e.g. 60s
LOAD_SECONDS=${LOAD_SECONDS:-}  # the outside load's length instead of the scenario's (with DURATION)
RUN_TIMEOUT=${RUN_TIMEOUT:-0}  # stop soakd (SIGTERM: it drains and writes its verdict) after this many s
mkdir -p "$OUT"
exec >>"$OUT/run.log" 2>&1
source benchmarks/gpu_env.sh || exit 1
[[ -d /tmp/qwen3-8b ]] || python3 -m soakd model shape qwen3-8b /tmp/qwen3-8b || exit 1
nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > "$OUT/smi_before.txt"

# Goodput on TPOT alone with throughput harm acted on (the SLO-bound cases), and the policy's default
# times (dwell 10 s, legs of settle 10 s + eval 20 s) with a 200 s replay around a 150 s load.
TPOT_ONLY="--set criteria.ttft_p99_ms=false --set control.harm.act_on_throughput=true"
DEFAULT_TIMES="--set control.batch.dwell=10s --set control.batch.settle=10s --set control.batch.eval=20s --duration 200s"
# name scenario policy load: the scenario's settings, the policy's, and the outside load (20-65 s).
declare -A SCEN=(
  # The shared GPU: goodput with admission wait + TTFT <= 10 s and TPOT <= 25 ms; a backlog grows under
  # the load, so goodput falls whatever the level (the trend a before/after misreads).
  [shared]=""
  # The SLO-bound case (pays.toml): goodput on TPOT <= 12.79 ms only (the limit the first matrix measured
  # as the full batch's p25 under the load), throughput harm acted on.
  [pays]="$TPOT_ONLY --set criteria.tpot_p99_ms=12.79"
  # The engine's own batch at the power cap: twice the trace's rate, no second process.
  [owncap]="--set replay.rate_scale=2.0"
  # pays with room for the policy's default times (dwell 10 s, legs of settle 10 s + eval 20 s): a 150 s
  # load, a 200 s replay, so an A-B-A trial's legs are twice as long as the 45 s load allows.
  [payslong]="$TPOT_ONLY --set criteria.tpot_p99_ms=12.79 $DEFAULT_TIMES"
  # The long-context case (longctx_trace.py): ~6k-token contexts, so a decode step's time grows with the
  # batch; goodput on a TPOT limit set between the full batch's and a 48-batch's TPOT under the load
  # (measured by the cal64 and cal48 arms first, or LONGCTX_TPOT), payslong's times and load.
  [longctx]="--set trace.path=/tmp/longctx.jsonl --set replay.rate_scale=1.0 --set engine.max_model_len=8192 $TPOT_ONLY $DEFAULT_TIMES"
)
# The outside load's length (s, from 20 s into the replay) and the arm's time for the deadline, per scenario.
declare -A LOAD_S=([payslong]=150 [longctx]=150)
declare -A SCEN_ARM_S=([payslong]=300 [longctx]=330)
declare -A POLICY=(
  [control]=""
  [advice]="--set control.dry_run=true"
  [free]=""
  [noclass]="--set control.enabled=false"
  # Calibration: one fixed ceiling, no control, the load over the whole (shorter) replay.
  [cal64]="--set control.enabled=false --duration 60s"
  [cal48]="--set control.enabled=false --set replay.max_concurrency=48 --duration 60s"
)
[[ -s /tmp/longctx.jsonl ]] || python3 $HERE/longctx_trace.py /tmp/longctx.jsonl || exit 1

longctx_tpot() {  # the TPOT limit halfway between the calibration arms' medians (ms), or LONGCTX_TPOT
  [[ -n ${LONGCTX_TPOT:-} ]] && { echo "$LONGCTX_TPOT"; return; }
  python3 - "$OUT" <<'PY'
import json, sys
p50 = [json.load(open(f"{sys.argv[1]}/longctx-{c}/summary.json"))["requests"]["tpot"]["p50_ms"] for c in ("cal64", "cal48")]
print(round(sum(p50) / 2, 2))
PY
}
ARMS=("$@")
if (( ${#ARMS[@]} == 0 )); then
  ARMS=(shared:control:load shared:advice:load shared:free: shared:noclass: pays:control:load
        pays:advice:load owncap:control: owncap:advice: shared:advice2:load shared:noclass2:)
fi

arm() {  # scenario policy load
  local scen=$1 policy=$2 load=$3 name="$1-$2"
  local pol=${POLICY[${policy%2}]}
  local need=${SCEN_ARM_S[$scen]:-$ARM_S} load_s=${LOAD_SECONDS:-${LOAD_S[$scen]:-45}} after=20 extra=""
  if [[ $policy == cal* ]]; then need=170 load_s=70 after=0; fi
  if [[ $scen == longctx && $policy != cal* ]]; then
    local tpot; tpot=$(longctx_tpot) || { echo "skip $name: no TPOT limit"; return; }
    extra="--set criteria.tpot_p99_ms=$tpot"; echo "$name: TPOT limit $tpot ms"
  fi
  if (( DEADLINE > 0 && $(date +%s) + need > DEADLINE )); then echo "skip $name: past the deadline"; return; fi
  echo "== $name $(date -u +%T)"
  mkdir -p "$OUT/$name"
  printf '{"scenario": "%s", "policy": "%s", "load": %s}\n' "$scen" "${policy%2}" \
    "$([[ $load == load ]] && echo true || echo false)" > "$OUT/$name/arm.json"
  if [[ $load == load ]]; then
    python3 $LOAD --runs /tmp/runs/$name --after "$after" --seconds "$load_s" --out "$OUT/$name/times.json" \
      > "$OUT/$name/load.txt" 2>&1 &
  fi
  # Raw NVML at 10 Hz from the replay's first request, for replaying the harm judge in tests.
  ( for _ in $(seq 3000); do
      j=$(ls /tmp/runs/$name/*/replay.journal 2>/dev/null | head -1)
      [[ -n $j && -s $j ]] && break; sleep 0.1
    done
    python3 -m soakd telemetry record --duration "$(( load_s + 55 ))s" "$OUT/$name/nvml.jsonl.gz" > /dev/null 2>&1 ) &
  # shellcheck disable=SC2086
  timeout -s TERM "$RUN_TIMEOUT" python3 -m soakd run --config $HERE/matrix.toml --json --no-progress \
    --set run.name="$name" --set run.output_dir="/tmp/runs/$name" ${SCEN[$scen]} $pol $extra \
    ${DURATION:+--duration $DURATION} \
    > "$OUT/$name/summary.json" 2> "$OUT/$name/stderr.log"
  echo "rc $name $? $(date -u +%T)"
  wait
  local run; run=$(ls -d /tmp/runs/$name/*/ | tail -1)
  cp "$run"/{meta.json,verdict.json,control-state.json} "$OUT/$name/" 2>/dev/null
  # Without soakd's per-collector self-telemetry: the fixtures stay small.
  cat "$run"/spool/seg-*.lp | grep -v '^collector,' | gzip > "$OUT/$name/spool.lp.gz"
  tail -c 20000 "$OUT/$name/stderr.log" > "$OUT/$name/stderr.tail" && rm "$OUT/$name/stderr.log"
  tar czf "$OUT.tgz.part" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$OUT.tgz.part" "$OUT.tgz"
}

for spec in "${ARMS[@]}"; do
  IFS=: read -r scen policy load <<< "$spec"
  arm "$scen" "$policy" "$load"
done
nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > "$OUT/smi_after.txt"
echo "== done $(date -u +%T)"
touch "$OUT/DONE"
tar czf "$OUT.tgz.part" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$OUT.tgz.part" "$OUT.tgz"
