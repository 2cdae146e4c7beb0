#!/usr/bin/env bash
# The admission ceiling binding, then a Ctrl-C, on an H200 (see README.md beside this file): config.gpu.toml
# with a Qwen3-8B shape (random weights), the trace at 1.5x its rate and replay.max_concurrency = 32, so
# more requests come due than the ceiling lets in. Once the replay is under way, SIGINT goes to soakd's
# whole process group (soakd, the vLLM engine core and every other child), as a terminal's Ctrl-C does;
# the script measures how long the stop takes, what survives it, and what the run folder holds after it.
# Runs from the repository root with the GPU bundle in .gpu_bundle/ and soakd's wheels in .gpu_wheels/:
#   bash benchmarks/h200_ceiling/run.sh OUT
# Knobs (environment): REPLAY_S (default 45) seconds of replay, counted from the first `requests` line in
# the spool, before the SIGINT; SIGINT_BY_S (default 260) the SIGINT at the latest, counted from this
# script's start, replay seen or not; WAIT_S (default 240) how long the stop may take before the group is
# killed (SIGKILL); END_S (default 510) the group is killed by then in any case, so that the whole script
# ends within ~9 minutes.
# OUT gets: run.log (this script's stages), stdout.txt / stderr.log (soakd's), stop.txt (the stop),
# meta.json, verdict.json, summary.json, report.json, checkpoint.json, engine.log, files.txt (the run
# folder's listing), spool.lp.gz, engine_death.txt, figures.txt, gpu_after.txt.
# shellcheck disable=SC2012  # run folders are named <UTC time>-<name>-<4 hex>: ls is safe
set -uo pipefail
OUT=${1:?results folder}
REPLAY_S=${REPLAY_S:-45}
SIGINT_BY_S=${SIGINT_BY_S:-260}
WAIT_S=${WAIT_S:-240}
END_S=${END_S:-510}
RUNS=/tmp/runs
mkdir -p "$OUT" "$RUNS"
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
dt() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a - b }'; }
log() { echo "[$(elapsed) s] $*" | tee -a "$OUT/run.log"; }
note() { echo "$*" >> "$OUT/stop.txt"; }

# The install, bounded (gpu_env.sh installs only once per machine, then only sets the environment).
log "install"
timeout 180 bash -c 'source benchmarks/gpu_env.sh' > "$OUT/install.log" 2>&1 || { log "install FAILED"; tail -n 20 "$OUT/install.log"; exit 1; }
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh || { log "gpu_env.sh FAILED"; exit 1; }
if [[ ! -d /tmp/qwen3-8b ]]; then
  log "model shape qwen3-8b"
  timeout 120 python3 -m soakd model shape qwen3-8b /tmp/qwen3-8b > "$OUT/shape.log" 2>&1 \
    || { log "model shape FAILED"; tail -n 20 "$OUT/shape.log"; exit 1; }
fi

# The run. A background command of a script starts with SIGINT (and SIGQUIT) ignored; a command typed at
# a terminal does not. The small exec wrapper puts them back to their defaults before soakd starts, so the
# engine's processes inherit what they would from a terminal. setsid: soakd leads its own session and
# process group (a background command of a script is no group leader, so setsid execs without a fork:
# the pid is soakd's).
before=$(ls -d "$RUNS"/*/ 2>/dev/null | sort)
log "soakd run (rate_scale 1.5, max_concurrency 32)"
setsid python3 -c '
import os, signal, sys
for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE, signal.SIGXFSZ):
    signal.signal(s, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])
' python3 -m soakd run --config config.gpu.toml --model /tmp/qwen3-8b --duration 4m --no-progress \
  --set engine.load_format=dummy --set 'engine.extra_args={attention_backend="TRITON_ATTN"}' \
  --set run.output_dir="$RUNS" --set replay.rate_scale=1.5 --set replay.max_concurrency=32 \
  < /dev/null > "$OUT/stdout.txt" 2> "$OUT/stderr.log" &
PID=$!
T_START=$(date +%s.%N)
sleep 1
PGID=$(ps -o pgid= -p "$PID" | tr -d ' ')
if [[ -n $PGID && $PGID != "$PID" ]]; then
  # setsid forked after all: the group is its child's.
  child=$(pgrep -P "$PID" | head -n 1)
  [[ -n $child ]] && PGID=$(ps -o pgid= -p "$child" | tr -d ' ')
fi
PGID=${PGID:-$PID}
log "soakd pid $PID, pgid $PGID, sid $(ps -o sid= -p "$PID" | tr -d ' ')"
echo "pid $PID pgid $PGID" > "$OUT/stop.txt"

# Alive: not exited, or exited and not yet reaped (a zombie answers kill -0, so its state is read).
alive() { local st; st=$(ps -o stat= -p "$PID" 2>/dev/null); [[ -n $st && $st != Z* ]]; }
# The group's live processes (soakd's session too: a child that made a group of its own is still in it;
# zombies are gone but for their exit status, not counted).
group_left() {
  ps -eo pid=,pgid=,sid=,stat= | awk -v g="$PGID" -v me="$PID" '($2 == g || $3 == g) && $1 != me && $4 !~ /^Z/ { print $1 }'
}
group_ps() { ps -eo pid,ppid,pgid,sid,stat,etime,args | awk -v g="$PGID" 'NR == 1 || $3 == g || $4 == g'; }
# The run folder this run made (none before soakd made it); new_run_dir || newest at the end.
new_run_dir() { comm -13 <(echo "$before") <(ls -d "$RUNS"/*/ 2>/dev/null | sort) | tail -n 1; }
count_requests() { cat "$1"spool/seg-*.lp 2>/dev/null | grep -c '^requests,'; }

# Wait for the replay: `requests` lines in the new run's spool, growing, for REPLAY_S seconds.
RUN=""
first=""
prev=0
n=0
reason="SIGINT_BY_S (${SIGINT_BY_S} s after the script's start) reached"
while alive; do
  if (($(elapsed) >= SIGINT_BY_S)); then break; fi
  [[ -z $RUN ]] && RUN=$(new_run_dir)
  if [[ -n $RUN ]]; then
    n=$(count_requests "$RUN")
    if ((n > 0)) && [[ -z $first ]]; then
      first=$(date +%s)
      log "replay under way: first requests lines in ${RUN}spool ($n)"
    fi
    if [[ -n $first ]] && (($(date +%s) - first >= REPLAY_S)) && ((n > prev)); then
      reason="replay under way: $n requests lines, growing, ${REPLAY_S} s after the first"
      break
    fi
    prev=$n
  fi
  sleep 2
done

if alive; then
  log "SIGINT to group $PGID: $reason"
  T_INT=$(date +%s.%N)
  kill -INT -- "-$PGID"
  note "sigint_at_s_after_soakd_start $(dt "$T_INT" "$T_START")"
  note "sigint_reason $reason"
  note "requests_lines_at_sigint $n"
  limit=$WAIT_S
  ((END_S - $(elapsed) < limit)) && limit=$((END_S - $(elapsed)))
  ((limit < 10)) && limit=10
  deadline=$(($(date +%s) + limit))
  while alive && (($(date +%s) < deadline)); do sleep 0.2; done
  T_EXIT=$(date +%s.%N)
  if alive; then
    note "soakd_exited no (still running after ${limit} s: group killed)"
    note "group_at_kill:"
    group_ps >> "$OUT/stop.txt" 2>&1
    kill -KILL -- "-$PGID"
    wait "$PID"
    note "exit_code $? (SIGKILL)"
  else
    wait "$PID"
    rc=$?
    note "soakd_exited yes"
    note "exit_code $rc"
    note "sigint_to_exit_s $(dt "$T_EXIT" "$T_INT")"
  fi
  log "soakd gone $(dt "$T_EXIT" "$T_INT") s after the SIGINT"
else
  wait "$PID"
  rc=$?
  note "soakd_exited before any SIGINT, exit_code $rc, $(($(date +%s) - ${T_START%.*})) s after its start"
  log "soakd ended on its own (rc $rc) before the SIGINT"
fi

# What outlived soakd in its group (the engine core, workers, the sender): at its exit, and 10 s later;
# then the GPU's view.
T_GONE=$(date +%s.%N)
left=$(group_left)
note "group_at_soakd_exit $(grep -c . <<< "$left") processes"
[[ -n $left ]] && group_ps >> "$OUT/stop.txt" 2>&1
deadline=$(($(date +%s) + 10))
while [[ -n $left ]] && (($(date +%s) < deadline)); do sleep 0.2; left=$(group_left); done
if [[ -n $left ]]; then
  note "group_survivors yes ($(grep -c . <<< "$left") processes 10 s after soakd's exit; killed)"
  group_ps >> "$OUT/stop.txt" 2>&1
  kill -KILL -- "-$PGID" 2>/dev/null
  sleep 1
  note "group_after_sigkill $(group_left | grep -c .) processes"
else
  note "group_survivors no (group empty $(dt "$(date +%s.%N)" "$T_GONE") s after soakd's exit)"
fi
timeout 20 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$OUT/gpu_after.txt" 2>&1
note "gpu_compute_apps_after $(($(grep -c . "$OUT/gpu_after.txt") - 1))"

# The run folder.
[[ -n $RUN ]] || RUN=$(new_run_dir)
[[ -n $RUN ]] || RUN=$(ls -td "$RUNS"/*/ 2>/dev/null | head -n 1)
if [[ -n $RUN && -d $RUN ]]; then
  log "collecting $RUN"
  ls -la "$RUN" "$RUN"spool > "$OUT/files.txt" 2>&1
  for f in meta.json verdict.json summary.json report.json engine.log checkpoint.json; do
    timeout 20 cp "$RUN$f" "$OUT/" 2>/dev/null || echo "missing $f" >> "$OUT/files.txt"
  done
  cat "$RUN"spool/seg-*.lp 2>/dev/null | timeout 60 gzip > "$OUT/spool.lp.gz"
  {
    echo "# engine.log: engine death signs (count, then the lines, numbered)"
    for pat in EngineDeadError died Traceback KeyboardInterrupt SIGINT; do
      echo "$pat: $(grep -c -- "$pat" "$RUN"engine.log 2>/dev/null || true)"
    done
    echo
    timeout 10 grep -n -E -- 'EngineDeadError|died|Traceback|KeyboardInterrupt|SIGINT' "$RUN"engine.log 2>/dev/null | head -n 200
  } > "$OUT/engine_death.txt"
else
  log "no run folder under $RUNS"
fi

# The figures, from verdict.json and summary.json.
timeout 20 python3 - "$OUT" > "$OUT/figures.txt" 2>&1 <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError) as err:
        print(f"{name}: not read ({type(err).__name__}: {err})")
        return {}


def fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


v = load("verdict.json")
print(f"exit_code {v.get('exit_code')}  verdict {v.get('verdict')}  interrupted {v.get('interrupted')}  "
      f"planned_s {fmt(v.get('planned_s'))}  ran_s {fmt(v.get('ran_s'))}  lost_in_flight {v.get('lost_in_flight')}")
print("criteria:")
for c in v.get("criteria") or []:
    mark = "ok  " if c.get("passed") else "FAIL"
    rule = c.get("expr") or f"{c.get('name')} {c.get('op', '')} {fmt(c.get('threshold'))}"
    print(f"  {mark} {rule}: {fmt(c.get('value'))} {c.get('detail') or ''}".rstrip())
m = v.get("metrics") or {}
print("metrics (ms):            p50        p99        max")
for d in ("ttft_offered_ms", "ttft_ms", "e2e_offered_ms", "e2e_ms", "queue_ms"):
    row = [m.get(f"{k}({d})") for k in ("p50", "p99", "max")]
    print(f"  {d:<18}" + "".join(f"{'-' if x is None else f'{x:,.1f}':>11}" for x in row))
for k in ("admission_wait_share", "requests", "completed", "errors", "shed", "completed_ratio", "error_rate",
          "tokens_per_s"):
    print(f"  {k} {fmt(m.get(k))}")
s = load("summary.json")
req = s.get("requests") or {}
print(f"summary: verdict {s.get('verdict')} error {s.get('error')} interrupted {s.get('interrupted')}")
print(f"summary requests: scheduled {req.get('scheduled')} completed {req.get('completed')} "
      f"failed {req.get('failed')} shed {req.get('shed')} waited {req.get('waited')} "
      f"lost_in_flight {req.get('lost_in_flight')}")
print("failed requests by kind:", json.dumps(req.get("errors") or {}, sort_keys=True))
EOF

log "done"
# At most 8 files come back from the machine: the three read first stay, the rest go into one archive.
PACK=$(mktemp -d)
find "$OUT" -maxdepth 1 -type f ! -name stop.txt ! -name figures.txt ! -name engine_death.txt \
  -exec mv {} "$PACK/" \;
tar czf "$OUT/run-files.tar.gz" -C "$PACK" . && rm -rf "$PACK"
echo "== stop.txt"; cat "$OUT/stop.txt"
echo "== figures.txt"; cat "$OUT/figures.txt"
echo "== engine_death.txt (counts)"; head -n 6 "$OUT/engine_death.txt" 2>/dev/null
echo "== stderr.log (last lines)"; tar xzOf "$OUT/run-files.tar.gz" ./stderr.log | tail -n 15
