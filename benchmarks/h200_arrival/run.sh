#!/usr/bin/env bash
# Replay timing as the server sees it, on the H200 machine: benchmarks/bench_arrival.py --gpu against the
# slim vLLM 0.26.0 api_server (Triton attention, eager) on the bundle's tiny random model; soakd with each
# engine.sender ("process", "loop", "process-cold") beside `vllm bench serve`, the clients' order rotated
# per rep; optionally the other rates scaled from one by replay.rate_scale (SCALE_FROM) and soakd with its
# own vLLM in process and as a server it launches (ENGINES).
# Runs from the repository root with the GPU bundle in .gpu_bundle/, soakd's wheels in .gpu_wheels/ and
# the API server's and bench client's wheels in .gpu_wheels_server/ (each installed only where the image
# cannot import it already):
#   bash benchmarks/h200_arrival/run.sh OUT
# OUT gets at most six small files: run.log (this script's output: stages and their times),
# image-probe.txt (what the image has, what was installed), arrival.json (the report), arrival.log (the
# benchmark's progress and table), server-tail.log (the vLLM server's log, last lines) and clients.txt
# (the last lines of one log of each client). The whole script is meant to end within ~560 s; the
# benchmark gets what is left of BUDGET_S (default 545) after the install and the model.
set -euo pipefail
OUT=${1:?results folder}
BUDGET_S=${BUDGET_S:-545}
read -r -a RATES <<< "${RATES:-10 100}"
REQUESTS=${REQUESTS:-200}
REPS=${REPS:-3}
read -r -a SENDERS <<< "${SENDERS:-process loop}"
# SCALE_FROM=10: the other rates from that rate's trace by replay.rate_scale (its first SCALE_WINDOW_S s).
SCALE_FROM=${SCALE_FROM:-}
SCALE_WINDOW_S=${SCALE_WINDOW_S:-6}
# ENGINES="vllm-local vllm-server": soakd with its own vLLM too, in the first ENGINE_REPS reps.
read -r -a ENGINES <<< "${ENGINES:-}"
ENGINE_REPS=${ENGINE_REPS:-1}
NO_BENCH=${NO_BENCH:-}  # 1: soakd's clients alone (no vllm bench serve)
ENGINES_ONLY=${ENGINES_ONLY:-}  # 1: the ENGINES alone (no api_server of the benchmark's own)
mkdir -p "$OUT"
exec 3>&1 4>&2
exec > >(tee "$OUT/run.log") 2>&1
TEE=$!
# run.log complete before the script ends: the copy of its output is closed and waited for.
trap 'rc=$?; exec 1>&3 2>&4; wait "$TEE" 2>/dev/null || true; exit "$rc"' EXIT
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
stage() { echo "[$(elapsed) s] $*"; }
PROBE="$OUT/image-probe.txt"

stage "machine: $(nproc) cores; $(python3 --version 2>&1); $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
{
  echo "# the image's own packages (python3 -m pip list, PYTHONPATH unset)"
  env -u PYTHONPATH python3 -m pip list --format=freeze 2>&1 || true
  echo
  echo "# the GPU bundle's install (benchmarks/gpu_env.sh)"
} > "$PROBE"

t=$(date +%s)
source benchmarks/gpu_env.sh >> "$PROBE" 2>&1 || { stage "the bundle's install FAILED:"; tail -n 20 "$PROBE"; exit 1; }
stage "bundle and soakd's wheels in /tmp/site: $(($(date +%s) - t)) s; $(grep -E '^IMPORT' "$PROBE" || echo 'installed before')"

# The server's and the bench client's wheels: a wheel is installed only when one of its top-level modules
# does not import here (the image's copy, or the bundle's in /tmp/site, is kept where it imports).
t=$(date +%s)
mapfile -t MISSING < <(
  python3 - .gpu_wheels_server/*.whl 2>> "$PROBE" <<'EOF'
import importlib, importlib.metadata as md, sys, zipfile, warnings
warnings.filterwarnings("ignore")
lines = ["", "# .gpu_wheels_server: present (imports here) or installed"]
for wheel in sys.argv[1:]:
    names = set()
    for entry in zipfile.ZipFile(wheel).namelist():
        top, _, rest = entry.partition("/")
        if top.endswith((".dist-info", ".data")):
            continue
        if rest == "__init__.py":
            names.add(top)
        elif not rest and top.endswith(".py"):
            names.add(top[:-3])
    dist = wheel.rsplit("/", 1)[-1].split("-")[0]
    found, missing = [], []
    for name in sorted(names):
        try:
            mod = importlib.import_module(name)
            where = "/tmp/site" if (getattr(mod, "__file__", "") or "").startswith("/tmp/site") else "image"
            found.append(f"{name} ({where})")
        except Exception as err:  # noqa: BLE001
            missing.append(f"{name} ({type(err).__name__}: {err})"[:160])
    try:
        have = md.version(dist)
    except md.PackageNotFoundError:
        have = "-"
    state = "INSTALL" if missing or not names else "present"
    lines.append(f"{state:8s} {wheel.rsplit('/', 1)[-1]}  [installed version: {have}]  "
                 f"ok: {', '.join(found) or '-'}  missing: {', '.join(missing) or '-'}")
    if state == "INSTALL":
        print(wheel)
print("\n".join(lines), file=sys.stderr)
EOF
)
if ((${#MISSING[@]})); then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${MISSING[@]}" >> "$PROBE" 2>&1
fi
WHEELS=(.gpu_wheels_server/*.whl)
stage "server wheels: ${#MISSING[@]} installed of ${#WHEELS[@]}: $(($(date +%s) - t)) s"
{
  echo
  echo "# versions seen with PYTHONPATH=$PYTHONPATH"
  python3 - <<'EOF' 2>&1 || true
import importlib, importlib.metadata as md, warnings
warnings.filterwarnings("ignore")
for mod, dist in [("torch", "torch"), ("transformers", "transformers"), ("tokenizers", "tokenizers"),
                  ("huggingface_hub", "huggingface_hub"), ("numpy", "numpy"), ("typing_extensions", "typing_extensions"),
                  ("pydantic", "pydantic"), ("fastapi", "fastapi"), ("starlette", "starlette"), ("uvicorn", "uvicorn"),
                  ("uvloop", "uvloop"), ("aiohttp", "aiohttp"), ("anyio", "anyio"), ("httpx", "httpx"),
                  ("openai", "openai"), ("PIL", "pillow"), ("yaml", "pyyaml"), ("requests", "requests"),
                  ("setuptools", "setuptools"), ("jinja2", "jinja2"), ("matplotlib", "matplotlib"),
                  ("sentencepiece", "sentencepiece"), ("tiktoken", "tiktoken"), ("mistral_common", "mistral_common"),
                  ("pynvml", "nvidia-ml-py"), ("psutil", "psutil"), ("structlog", "structlog")]:
    try:
        m = importlib.import_module(mod)
        where = "/tmp/site" if (getattr(m, "__file__", "") or "").startswith("/tmp/site") else "image"
        try:
            v = md.version(dist)
        except md.PackageNotFoundError:
            v = getattr(m, "__version__", "?")
        print(f"{mod:18s} {v:14s} {where}")
    except Exception as err:
        print(f"{mod:18s} MISSING ({type(err).__name__}: {str(err)[:100]})")
EOF
} >> "$PROBE"

t=$(date +%s)
[[ -f /tmp/tiny_model/config.json ]] || python3 /tmp/bundle/make_model.py /tmp/tiny_model > /dev/null
stage "tiny model (/tmp/tiny_model): $(($(date +%s) - t)) s"

# The estimate: the server's start (import + eager engine) and each client run (the trace's span plus a
# client's own cost: soakd ~8 s, vllm bench ~15 s for importing torch and vLLM).
left=$((BUDGET_S - $(elapsed)))
est=$(python3 - "$REQUESTS" "$REPS" "${RATES[@]}" <<'EOF'
import sys
requests, reps, rates = int(sys.argv[1]), int(sys.argv[2]), [float(r) for r in sys.argv[3:]]
clients = {"soakd (process)": 8.0, "soakd (loop)": 8.0, "vllm bench": 15.0}
total = 75.0 + 5.0 + sum(reps * (requests / r + cost) for r in rates for cost in clients.values())
print(round(total))
EOF
)
stage "benchmark: rates ${RATES[*]}, $REQUESTS requests, $REPS reps, 3 clients; estimated ${est} s, budget ${left} s"
rm -rf /tmp/arrival
t=$(date +%s)
rc=0
EXTRA=()
[[ -n "$SCALE_FROM" ]] && EXTRA+=(--scale-from "$SCALE_FROM" --scale-window-s "$SCALE_WINDOW_S")
((${#ENGINES[@]})) && EXTRA+=(--soakd-engines "${ENGINES[@]}" --engine-reps "$ENGINE_REPS")
[[ -n "$NO_BENCH" ]] && EXTRA+=(--no-vllm-bench)
[[ -n "$ENGINES_ONLY" ]] && EXTRA+=(--engines-only)
python3 benchmarks/bench_arrival.py --gpu --model /tmp/tiny_model --rates "${RATES[@]}" --requests "$REQUESTS" \
  --reps "$REPS" --soakd-senders "${SENDERS[@]}" "${EXTRA[@]}" --json --keep /tmp/arrival --budget-s "$left" \
  > "$OUT/arrival.json" 2> "$OUT/arrival.log" || rc=$?
stage "benchmark rc $rc: $(($(date +%s) - t)) s"
tail -n 12 "$OUT/arrival.log"

tail -n 150 /tmp/arrival/vllm-server.log > "$OUT/server-tail.log" 2>/dev/null || true
{
  for client in soakd-process soakd-loop soakd-process-cold soakd-vllm-local soakd-vllm-server vllm-bench; do
    dirs=(/tmp/arrival/*-"$client")
    [[ -d "${dirs[0]}" ]] || continue
    for log in "${dirs[0]}"/soakd.log "${dirs[0]}"/vllm-bench.log; do
      [[ -f "$log" ]] || continue
      echo "== $log (last 25 lines)"
      tail -n 25 "$log"
    done
  done
} > "$OUT/clients.txt" 2>&1
stage "done; OUT: $(cd "$OUT" && echo *)"
exit "$rc"
