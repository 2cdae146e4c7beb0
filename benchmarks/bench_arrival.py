"""Replay timing as the server sees it: arrival times at the server, soakd beside `vllm bench serve`.

Run by hand:  .venv/bin/python benchmarks/bench_arrival.py [--rates 10 100] [--requests 300] [--reps 3]
                  [--model models/tiny] [--json] [--keep DIR] [--gpu]
                  [--soakd-senders process loop process-cold process-python]
                  [--scale-from RATE [--scale-window-s S]]
                  [--soakd-engines vllm-local vllm-server [--engine-reps N]] [--budget-s SECONDS]

One vLLM api_server on the tiny model is started once: the CPU build here, or with `--gpu` a CUDA build
(the H200 machine's slim vLLM 0.26.0: Triton attention, eager, a third of the GPU's memory; see
benchmarks/h200_arrival/run.sh). In front of it runs a byte-level TCP pass-through (this script's
`proxy` mode, its own process) that stamps `time.time_ns()` when the first byte of each HTTP request
reaches it, and forwards every byte unchanged in both directions. For each rate, one Mooncake-format
trace of `--requests` requests (Poisson arrivals, millisecond timestamps) is replayed through the
pass-through by each client in turn, `--reps` times, the clients' order rotated from rep to rep so that
none always goes first (reps are the outer loop, so a `--budget-s` cut loses whole reps, not a rate):

- `vllm bench serve --dataset-name timed_trace --timed-trace-sec-multiplier 0.001`;
- `soakd run` in attach mode (`engine.kind = "openai"`, no warm-up, no loop), the whole daemon: spool,
  collectors, scheduler, verdict. With `--soakd-senders process loop` soakd runs once per listed
  `engine.sender` ("soakd (process)", "soakd (loop)"; "soakd (process-cold)": the sender process with
  `engine.warm_connections = 0`, no connections opened before the replay; "soakd (process-python)":
  the sender process reading its streams in Python, `engine.sender_reader = "python"`); without it one client
  "soakd" with soakd's default. soakd's own lateness figures (its verdict's p50/p99/max(lateness_ms))
  and its engine summary's connection figures are kept beside.
  With `--gpu` soakd (and the warm-up) is given the model's vocabulary (`engine.vocab_size`, from its
  config.json) instead of probing the server for it.

With `--scale-from RATE` only that rate's trace is generated (replayed only if RATE is in `--rates`);
each other rate replays its first
`--scale-window-s` seconds scaled up by soakd's own `replay.rate_scale` (rate / RATE): soakd is given the
base file with `replay.end` and `replay.rate_scale`, vllm bench a file of the requests soakd's loader
makes of it (ms timestamps); each client's deviation is against the times it was given.

With `--soakd-engines vllm-local vllm-server` soakd also runs with its own vLLM, shaped like the
benchmark's server, in the first `--engine-reps` reps: no pass-through can stamp those, so their rows are
soakd's own lateness (the `generate()` call in process; the sender's write for the server soakd
launches) and costs (which then include the engine).

Deviation: for the last N POST /v1/completions of a client's run (N = the trace's requests; what comes
before is the client's own probing: vLLM's test prompt, soakd's vocabulary probe), arrival_i - t_i,
minus the median of those; reported as the absolute value's p50 / p99 / max. CPU seconds and peak RSS
are the client process tree's (getrusage of the waited child; RSS polled). Figures are the median over
the reps with their min-max spread. With `--json` stdout is the JSON report alone and the table goes to
stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The folder of benchmark scripts: bench_fidelity's server, client and trace helpers are reused.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fidelity import (
    MAX_MODEL_LEN,
    free_port,
    run_child,
    run_vllm_bench,
    start_server,
    stop_server,
    warm_up,
    write_trace,
)

Json = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent
VLLM_BENCH = "vllm bench"
# "process-cold": the sender process with no connections opened before the replay (warm_connections 0);
# "process-nice": the sender process at nice -10 (engine.sender_nice); "process-python": the sender
# process reading its streams in Python (engine.sender_reader), not with the native reader.
SENDERS = ("process", "loop", "process-cold", "process-nice", "process-python")
ENGINES = ("vllm-local", "vllm-server")
# A client run's cost beyond the trace's span before one was measured (imports, probing, the end).
FIRST_OVERHEAD_S = 20.0
# Kept free at the end of `--budget-s`: stopping the server (its process group) and the report.
STOP_MARGIN_S = 15.0


# --------------------------------------------------------------------------------------- the proxy


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stamp: Any = None) -> None:
    try:
        while data := await reader.read(65536):
            if stamp is not None:
                stamp(data)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


class _RequestStamper:
    """Finds where each HTTP/1.1 request starts in a client's byte stream (request line, headers,
    Content-Length body) and writes (time_ns, method, path) for each."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._buf = b""
        self._body_left = 0
        self._started = False
        self._t = 0

    def __call__(self, data: bytes) -> None:
        now = time.time_ns()
        while data:
            if self._body_left:
                take = min(self._body_left, len(data))
                self._body_left -= take
                data = data[take:]
                continue
            if not self._started and not self._buf:
                self._t = now  # the first byte of a request arrived in this chunk
                self._started = True
            self._buf += data
            data = b""
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, rest = self._buf[:end].decode("latin-1"), self._buf[end + 4 :]
            self._buf = b""
            self._started = False
            lines = head.split("\r\n")
            method, path, *_ = lines[0].split(" ")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            self._out.write(json.dumps({"t_ns": self._t, "method": method, "path": path}) + "\n")
            self._body_left = length
            data = rest


async def _proxy(listen_port: int, upstream_port: int, out_path: Path) -> None:
    out = out_path.open("a", buffering=1, encoding="utf-8")

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pump(client_r, up_w, _RequestStamper(out)), _pump(up_r, client_w))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=4096)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()
    out.close()


def start_proxy(upstream_url: str, out_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    upstream = int(upstream_url.rsplit(":", 1)[1])
    argv = [sys.executable, __file__, "proxy", str(port), str(upstream), str(out_path)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    import socket

    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the pass-through did not start")


def stop_proxy(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Replayed:
    """One rate's trace as each client gets it: soakd's file and [replay] keys, vllm bench's file, and
    the arrival times (ms) each is meant to keep."""

    soakd: Path
    soakd_replay: str
    soakd_ms: list[float]
    bench: Path
    bench_ms: list[float]

    @property
    def span_s(self) -> float:
        return max(self.soakd_ms[-1], self.bench_ms[-1]) / 1000


def generated(path: Path, requests: int, rate: float, seed: int) -> Replayed:
    # Short prompts and answers, so the CPU server's backlog stays small; no shared prefixes.
    rows = write_trace(
        path, math.inf, rate, seed, requests=requests, inputs=(64, 512), outputs=(4, 16), shared=0
    )
    times = [float(r["timestamp"]) for r in rows]
    return Replayed(path, "", times, path, times)


def scaled(base: Path, out: Path, scale: float, window_s: float) -> Replayed:
    """The first `window_s` of the trace at `base`, `scale` times its rate: soakd replays `base` with
    `replay.end` and `replay.rate_scale`; vllm bench replays the requests soakd's loader makes of it,
    written to `out` (copies get block ids of their own, as soakd salts their prompts apart)."""
    from soakd.config import load
    from soakd.traces.loader import open_trace

    keys = {"replay.end": window_s, "replay.rate_scale": scale}
    cfg = load(None, {"trace.path": str(base), "trace.format": "mooncake", "trace.block_size": 512, **keys})
    rows, exact, rounded = [], [], []
    for spec in open_trace(cfg.trace, Path, cfg.run.seed, cfg.replay):
        ms = spec.arrival_s * 1000
        exact.append(ms)
        rounded.append(float(round(ms)))
        ids = [h + spec.copy * 1_000_000 for h in spec.hash_ids]
        rows.append(
            {
                "timestamp": round(ms),
                "input_length": spec.input_tokens,
                "output_length": spec.output_tokens,
                "hash_ids": ids,
            }
        )
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    replay = f'end = "{window_s:g}s"\nrate_scale = {scale:g}\n'
    return Replayed(base, replay, exact, out, rounded)


# --------------------------------------------------------------------------------------- the clients


def engine_section(
    url: str, sender: str | None, vocab_size: int, engine: str | None, model: Path, gpu: bool
) -> str:
    """The [engine] table: attach mode at `url` (`sender`: engine.sender, "process-cold" the process
    with no connections opened before the replay; None: soakd's defaults), or with `engine` soakd's own
    vLLM ("vllm-local" in process, "vllm-server" a server it launches) shaped like the benchmark's
    server."""
    if engine is None:
        lines = ['kind = "openai"', f'url = "{url}"']
        if sender:
            lines.append(f'sender = "{sender.split("-")[0]}"')
        if sender and sender.endswith("-cold"):
            lines.append("warm_connections = 0")
        if sender and sender.endswith("-nice"):
            lines.append("sender_nice = -10")
        if sender and sender.endswith("-python"):
            lines.append('sender_reader = "python"')
        if vocab_size:
            lines.append(f"vocab_size = {vocab_size}")
        return "\n".join(lines) + "\n"
    lines = [
        f'kind = "{engine}"',
        f'model = "{model}"',
        f"max_model_len = {MAX_MODEL_LEN}",
        f"max_num_seqs = {256 if gpu else 64}",
        "seed = 0",
        'start_timeout = "300s"',
    ]
    if gpu:
        lines += [
            "gpu_memory_utilization = 0.3",
            "enforce_eager = true",
            'extra_args = {attention_backend = "TRITON_ATTN"}',
        ]
    else:
        lines.append("cpu_kvcache_space_gib = 2")
    return "\n".join(lines) + "\n[engine.speculative]\nenabled = false\n"


def run_soakd(
    url: str,
    trace: Path,
    workdir: Path,
    span_s: float,
    sender: str | None = None,
    vocab_size: int = 0,
    *,
    replay_extra: str = "",
    engine_extra: str = "",
    engine: str | None = None,
    model: Path = Path(),
    gpu: bool = False,
    name: str = "arrival",
    role_of: Callable[[str], str] | None = None,
) -> Json:
    """`soakd run` over `trace`: attach mode (see engine_section) unless `engine`; `vocab_size`:
    engine.vocab_size (0: soakd probes the server); `replay_extra`, `engine_extra`: more [replay] and
    [engine] keys (a window, rate_scale; senders); `role_of`: CPU by role in the usage (run_child)."""
    engine_text = engine_section(url, sender, vocab_size, engine, model, gpu) + engine_extra
    cfg = workdir / "soakd.toml"
    cfg.write_text(
        f"""
[run]
name = "{name}"
duration = "{span_s + 5:.0f}s"
output_dir = "{workdir / "runs"}"
report = false
[trace]
path = "{trace}"
format = "mooncake"
block_size = 512
[replay]
{replay_extra}warmup_requests = 0
loop = false
drain_timeout = "120s"
max_concurrency = 100000
[criteria]
ttft_p99_ms = false
tpot_p99_ms = false
max_error_rate = 1.0
min_completed_ratio = 0.0
[engine]
{engine_text}""",
        encoding="utf-8",
    )
    argv = [sys.executable, "-m", "soakd", "run", "--config", str(cfg), "--no-progress", "--json"]
    argv += ["--log-level", os.environ.get("BENCH_SOAKD_LOG_LEVEL", "warning")]
    usage = run_child(argv, workdir / "soakd.log", role_of=role_of)
    return {"usage": usage, "own": own_lateness(workdir / "runs") | sends_of(workdir / "runs")}


def find_key(doc: Any, key: str) -> Json | None:
    """The first object under `key` anywhere in a JSON document (depth first), None when there is none."""
    if isinstance(doc, dict):
        if isinstance(doc.get(key), dict):
            return dict(doc[key])
        values: list[Any] = list(doc.values())
    elif isinstance(doc, list):
        values = doc
    else:
        return None
    for value in values:
        if (hit := find_key(value, key)) is not None:
            return hit
    return None


def sends_of(runs: Path) -> Json:
    """How the run's HTTP requests left soakd (the engine summary's `sends`: connections warmed and
    opened, the slowest send to headers written); {} when the run had none."""
    found = sorted(runs.glob("*/summary.json"))
    try:
        sends = find_key(json.loads(found[-1].read_text(encoding="utf-8")), "sends") if found else None
    except (OSError, ValueError):
        sends = None
    if not sends:
        return {}
    return {
        "connections_opened": sends.get("connections_opened"),
        "connections_warmed": sends.get("connections_warmed"),
        "write_max_ms": sends.get("write_max_ms"),
    }


def own_lateness(runs: Path) -> Json:
    """soakd's own lateness figures (ms) from its run's verdict: p50, p99, max; {} if not found."""
    found = sorted(runs.glob("*/verdict.json"))
    if not found:
        return {}
    try:
        metrics = json.loads(found[-1].read_text(encoding="utf-8")).get("metrics", {})
    except (OSError, ValueError):
        return {}
    out: Json = {}
    for stat in ("p50", "p99", "max"):
        value = metrics.get(f"{stat}(lateness_ms)")
        if isinstance(value, int | float):
            out[f"own_late_{stat}_ms"] = float(value)
    # The three latest requests by soakd's own measure: (position in the trace, lateness ms).
    from soakd.sinks.spool import iter_samples

    spool = found[-1].parent / "spool"
    late = [
        (int(s.fields["index"]), 1000 * float(s.fields["lateness_s"]))
        for s in iter_samples(spool, "requests", on_damaged=lambda *_: None)
    ]
    out["own_worst"] = [[i, round(v, 3)] for i, v in sorted(late, key=lambda r: -r[1])[:3]]
    return out


def arrivals(path: Path, n: int, since_ns: int) -> list[int]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    posts = [r["t_ns"] for r in rows if r["method"] == "POST" and r["path"] == "/v1/completions"]
    posts = [t for t in posts if t >= since_ns]
    if len(posts) < n:
        raise RuntimeError(f"{len(posts)} POSTs reached the server, the trace has {n}")
    return posts[-n:]


def deviation(arrived_ns: list[int], trace_ms: list[float]) -> Json:
    d = np.array(arrived_ns, dtype=np.float64) / 1e6 - np.array(sorted(trace_ms), dtype=np.float64)
    d = np.abs(d - np.median(d))
    worst = np.argsort(d)[::-1][:3]
    return {
        "p50_ms": float(np.percentile(d, 50)),
        "p99_ms": float(np.percentile(d, 99)),
        "max_ms": float(d.max()),
        # Where the tail is: (position in the trace, deviation ms) of the three worst arrivals.
        "worst": [[int(i), round(float(d[i]), 3)] for i in worst],
    }


def summary(values: list[float]) -> Json | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def figures(rows: list[Json]) -> Json:
    """Median and range of every figure over a client's runs (a figure some runs lack: over the rest)."""
    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in ("worst", "own_worst")]
    return {k: summary([r[k] for r in rows if r.get(k) is not None]) for k in keys}


def model_vocab(model: Path) -> int:
    """The model's vocabulary size from its config.json (0 if not there)."""
    try:
        cfg = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0
    return int(vocab)


def client_names(senders: list[str] | None) -> list[str]:
    soakds = [f"soakd ({s})" for s in senders] if senders else ["soakd"]
    return [*soakds, VLLM_BENCH]


def sender_of(client: str) -> str | None:
    found = re.fullmatch(r"soakd \(([\w-]+)\)", client)
    return found.group(1) if found else None


def engine_of(client: str) -> str | None:
    """The engine kind of a client that runs soakd's own vLLM ("soakd vllm-local"), else None."""
    found = re.fullmatch(r"soakd (vllm-local|vllm-server)", client)
    return found.group(1) if found else None


def rotated(clients: list[str], rep: int) -> list[str]:
    """The clients' order in rep `rep`: each goes first in turn."""
    k = rep % len(clients) if clients else 0
    return clients[k:] + clients[:k]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "proxy":
        asyncio.run(_proxy(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
        return
    t_start = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[10.0, 100.0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="stdout: the JSON report alone (the table: stderr)")
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--gpu", action="store_true", help="start a CUDA vLLM server (the H200's slim 0.26.0)")
    ap.add_argument(
        "--soakd-senders",
        nargs="+",
        choices=SENDERS,
        help="one soakd client per listed engine.sender (default: one client, soakd's default sender)",
    )
    ap.add_argument(
        "--scale-from",
        type=float,
        help="the other rates are made from this rate's trace by soakd's replay.rate_scale (its first "
        "--scale-window-s seconds, scaled; vllm bench gets the requests soakd's loader makes of it)",
    )
    ap.add_argument("--scale-window-s", type=float, default=6.0)
    ap.add_argument(
        "--soakd-engines",
        nargs="+",
        choices=ENGINES,
        default=[],
        help="also soakd with its own vLLM (no pass-through: its own lateness figures, at the "
        "generate() call in process, at the sender's write for the server it launches)",
    )
    ap.add_argument("--no-vllm-bench", action="store_true", help="soakd's clients alone")
    ap.add_argument(
        "--engines-only", action="store_true", help="the --soakd-engines alone (no server started here)"
    )
    ap.add_argument("--engine-reps", type=int, default=1, help="reps that include the --soakd-engines")
    ap.add_argument(
        "--budget-s",
        type=float,
        help="wall seconds for the whole benchmark from its start: a client run that would not end "
        "in time (trace span plus that client's longest overhead so far) is skipped and the report "
        "says how many were",
    )
    args = ap.parse_args()
    from soakd.logs import configure

    configure("warning")  # the warm-up's soakd logs go to stderr; stdout stays for the report
    deadline = t_start + args.budget_s - STOP_MARGIN_S if args.budget_s else None
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-arrival-"))
    work.mkdir(parents=True, exist_ok=True)
    clients = client_names(args.soakd_senders)
    engine_clients = [f"soakd {e}" for e in args.soakd_engines]
    if args.no_vllm_bench:
        clients.remove(VLLM_BENCH)
    if args.engines_only:
        clients = []
    # On the GPU the model's vocabulary is given to soakd, not probed (an id past the embedding would
    # be a device-side assert in the server, not a 400).
    vocab = model_vocab(args.model) if args.gpu else 0
    t0 = time.monotonic()
    server: subprocess.Popen[bytes] | None = None
    url = ""
    if clients:
        server, url, _ = start_server(args.model, work, gpu=args.gpu)
        print(f"server up in {time.monotonic() - t0:.1f} s at {url}", file=sys.stderr, flush=True)
    server_start_s = time.monotonic() - t0
    report: Json = {
        "requests": args.requests,
        "reps": args.reps,
        "gpu": args.gpu,
        "clients": clients + engine_clients,
        "scale_from": args.scale_from,
        "scale_window_s": args.scale_window_s if args.scale_from is not None else None,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "server_start_s": server_start_s,
        "rates": {},
    }
    traces: dict[float, Replayed] = {}
    base_rate: float | None = args.scale_from
    if base_rate is not None:
        base_path = work / f"trace-{base_rate:g}.jsonl"
        traces[base_rate] = generated(base_path, args.requests, base_rate, args.seed)
    for rate in args.rates:
        if rate in traces:
            continue
        if base_rate is None:
            traces[rate] = generated(work / f"trace-{rate:g}.jsonl", args.requests, rate, args.seed)
        else:
            base = traces[base_rate].soakd
            out = work / f"trace-{rate:g}-scaled.jsonl"
            traces[rate] = scaled(base, out, rate / base_rate, args.scale_window_s)
        print(f"rate {rate:g}: {len(traces[rate].soakd_ms)} requests", file=sys.stderr, flush=True)
    everyone = clients + engine_clients
    runs: dict[float, dict[str, list[Json]]] = {rate: {c: [] for c in everyone} for rate in args.rates}
    overhead: dict[str, float] = {}  # a client's longest wall time beyond the trace's span so far
    skipped: list[str] = []
    errors: list[str] = []
    try:
        if server is not None:
            asyncio.run(warm_up(url, vocab))
        plan = [
            (rep, rate, c)
            for rep in range(args.reps)
            for rate in args.rates
            for c in rotated(clients, rep) + (engine_clients if rep < args.engine_reps else [])
        ]
        for rep, rate, client in plan:
            replayed = traces[rate]
            span_s = replayed.span_s
            name = f"rate {rate:g} rep {rep} {client}"
            need = span_s + overhead.get(client, FIRST_OVERHEAD_S)
            if deadline is not None and time.monotonic() + need > deadline:
                skipped.append(name)
                print(f"skipped (time budget): {name}", file=sys.stderr, flush=True)
                continue
            if server is not None and server.poll() is not None:
                errors.append(f"the vLLM server exited with {server.returncode} before {name}")
                print(errors[-1], file=sys.stderr, flush=True)
                break
            rundir = work / f"{rate:g}-{rep}-{re.sub(r'[^a-z0-9]+', '-', client).strip('-')}"
            rundir.mkdir()
            t_run = time.monotonic()
            row: Json | None = None
            try:
                row = one_run(client, url, args, replayed, rundir, vocab)
            except Exception as err:  # noqa: BLE001 (a failed run is reported, the others go on)
                errors.append(f"{name}: {type(err).__name__}: {err}"[:2000])
                print(f"FAILED: {errors[-1]}", file=sys.stderr, flush=True)
            overhead[client] = max(overhead.get(client, 0.0), time.monotonic() - t_run - span_s)
            if row is not None:
                runs[rate][client].append(row)
                print(f"{name}: {row}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            stop_server(server)
        for rate in args.rates:
            done = {client: rows for client, rows in runs[rate].items() if rows}
            if done:
                report["rates"][f"{rate:g}"] = {
                    client: figures(rows) | {"runs": rows} for client, rows in done.items()
                }
        report["skipped"] = skipped
        report["errors"] = errors
        report["wall_s"] = time.monotonic() - t_start
    if args.json:
        print(json.dumps(report, indent=2))
    print(table(report), file=sys.stderr if args.json else sys.stdout)


def one_run(client: str, url: str, args: argparse.Namespace, rep: Replayed, rundir: Path, vocab: int) -> Json:
    """One client's replay through a fresh pass-through: its deviation figures and costs. A client
    running soakd's own vLLM has no pass-through: its own lateness figures and costs alone."""
    if (engine := engine_of(client)) is not None:
        res = run_soakd(
            "", rep.soakd, rundir, rep.span_s, replay_extra=rep.soakd_replay, engine=engine,
            model=args.model, gpu=args.gpu,
        )  # fmt: skip
        return {**costs(res["usage"]), **res["own"]}
    out = rundir / "arrivals.jsonl"
    proxy, purl = start_proxy(url, out)
    since = time.time_ns()
    own: Json = {}
    try:
        if client == VLLM_BENCH:
            times = rep.bench_ms
            res = run_vllm_bench(purl, args.model, rep.bench, len(times), rundir, args.seed)
        else:
            times = rep.soakd_ms
            res = run_soakd(
                purl, rep.soakd, rundir, rep.span_s, sender_of(client), vocab, replay_extra=rep.soakd_replay
            )
            own = res["own"]
        usage = res["usage"]
    finally:
        stop_proxy(proxy)
    dev = deviation(arrivals(out, len(times), since), times)
    return {**dev, **costs(usage), **own}


def costs(usage: Json) -> Json:
    return {"cpu_s": usage["cpu_s"], "rss_mb": usage["peak_rss_mb"], "wall_s": usage["wall_s"]}


def table(report: Json) -> str:
    out = [
        "| rate | client | p50 ms | p99 ms | max ms | CPU s | peak RSS MB | own lateness p99 ms "
        "| own lateness max ms | connections opened in the replay |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(fig: Json | None) -> str:
        return "-" if fig is None else f"{fig['median']:.2f} ({fig['min']:.2f}-{fig['max']:.2f})"

    for rate, clients in report["rates"].items():
        for client, fig in clients.items():
            cells = [cell(fig.get(k)) for k in ("p50_ms", "p99_ms", "max_ms", "cpu_s", "rss_mb")]
            cells += [cell(fig.get(k)) for k in ("own_late_p99_ms", "own_late_max_ms", "connections_opened")]
            n = len(fig["runs"])
            runs = "" if n == report["reps"] else f" ({n} of {report['reps']} runs)"
            out.append(f"| {rate} req/s | {client}{runs} | " + " | ".join(cells) + " |")
    if report.get("skipped"):
        out.append(f"\n{len(report['skipped'])} runs skipped for the time budget")
    if report.get("errors"):
        out.append(f"\n{len(report['errors'])} runs failed: " + "; ".join(report["errors"]))
    return "\n".join(out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
