"""Replay timing as the server sees it: arrival times at the server, soakd beside `vllm bench serve`.

Run by hand:  .venv/bin/python benchmarks/bench_arrival.py [--rates 10 100] [--requests 300] [--reps 3]
                  [--model models/tiny] [--json] [--keep DIR]

One vLLM CPU api_server on the tiny model is started once. In front of it runs a byte-level TCP
pass-through (this script's `proxy` mode, its own process) that stamps `time.time_ns()` when the first
byte of each HTTP request reaches it, and forwards every byte unchanged in both directions. For each
rate, one Mooncake-format trace of `--requests` requests (Poisson arrivals, millisecond timestamps) is
replayed through the pass-through by each client in turn, `--reps` times, alternating which goes first:

- `vllm bench serve --dataset-name timed_trace --timed-trace-sec-multiplier 0.001`;
- `soakd run` in attach mode (`engine.kind = "openai"`, no warm-up, no loop), the whole daemon: spool,
  collectors, scheduler, verdict.

Deviation: for the last N POST /v1/completions of a client's run (N = the trace's requests; what comes
before is the client's own probing: vLLM's test prompt, soakd's vocabulary probe), arrival_i - t_i,
minus the median of those; reported as the absolute value's p50 / p99 / max. CPU seconds and peak RSS
are the client process tree's (getrusage of the waited child; RSS polled). Figures are the median over
the reps with their min-max spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# The folder of benchmark scripts: bench_fidelity's server, client and trace helpers are reused.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fidelity import (
    free_port,
    run_child,
    run_vllm_bench,
    start_server,
    stop_server,
    warm_up,
)

Json = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent


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


def write_trace(path: Path, requests: int, rate: float, seed: int) -> list[int]:
    """Mooncake rows: Poisson arrivals at `rate` (ms timestamps), short prompts and answers, so the CPU
    server's backlog stays small; returns the timestamps in ms."""
    rng = np.random.default_rng(seed)
    t = 0.0
    rows, times = [], []
    for i in range(requests):
        inp = int(rng.integers(64, 513))
        ms = round(t * 1000)
        rows.append(
            {
                "timestamp": ms,
                "input_length": inp,
                "output_length": int(rng.integers(4, 17)),
                "hash_ids": list(range(i * 2 + 10, i * 2 + 10 + (inp + 511) // 512)),
            }
        )
        times.append(ms)
        t += float(rng.exponential(1 / rate))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return times


# --------------------------------------------------------------------------------------- the clients


def run_soakd(url: str, trace: Path, requests: int, workdir: Path, span_s: float) -> Json:
    cfg = workdir / "soakd.toml"
    cfg.write_text(
        f"""
[run]
name = "arrival"
duration = "{span_s + 5:.0f}s"
output_dir = "{workdir / "runs"}"
report = false
[trace]
path = "{trace}"
format = "mooncake"
block_size = 512
[engine]
kind = "openai"
url = "{url}"
[replay]
warmup_requests = 0
loop = false
drain_timeout = "120s"
max_concurrency = 100000
[criteria]
ttft_p99_ms = false
tpot_p99_ms = false
max_error_rate = 1.0
min_completed_ratio = 0.0
""",
        encoding="utf-8",
    )
    argv = [sys.executable, "-m", "soakd", "run", "--config", str(cfg), "--no-progress", "--json"]
    argv += ["--log-level", "warning"]
    usage = run_child(argv, workdir / "soakd.log")
    return {"usage": usage}


def arrivals(path: Path, n: int, since_ns: int) -> list[int]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    posts = [r["t_ns"] for r in rows if r["method"] == "POST" and r["path"] == "/v1/completions"]
    posts = [t for t in posts if t >= since_ns]
    if len(posts) < n:
        raise RuntimeError(f"{len(posts)} POSTs reached the server, the trace has {n}")
    return posts[-n:]


def deviation(arrived_ns: list[int], trace_ms: list[int]) -> Json:
    d = np.array(arrived_ns, dtype=np.float64) / 1e6 - np.array(sorted(trace_ms), dtype=np.float64)
    d = np.abs(d - np.median(d))
    return {
        "p50_ms": float(np.percentile(d, 50)),
        "p99_ms": float(np.percentile(d, 99)),
        "max_ms": float(d.max()),
    }


def summary(values: list[float]) -> Json:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "proxy":
        asyncio.run(_proxy(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[10.0, 100.0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", type=Path)
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-arrival-"))
    work.mkdir(parents=True, exist_ok=True)
    server, url, _ = start_server(args.model, work)
    report: Json = {"requests": args.requests, "reps": args.reps, "rates": {}}
    try:
        asyncio.run(warm_up(url))
        for rate in args.rates:
            trace = work / f"trace-{rate:g}.jsonl"
            times = write_trace(trace, args.requests, rate, args.seed)
            runs: dict[str, list[Json]] = {"soakd": [], "vllm bench": []}
            for rep in range(args.reps):
                order = ["soakd", "vllm bench"] if rep % 2 == 0 else ["vllm bench", "soakd"]
                for client in order:
                    rundir = work / f"{rate:g}-{rep}-{client.replace(' ', '-')}"
                    rundir.mkdir()
                    out = rundir / "arrivals.jsonl"
                    proxy, purl = start_proxy(url, out)
                    since = time.time_ns()
                    try:
                        if client == "soakd":
                            usage = run_soakd(purl, trace, args.requests, rundir, times[-1] / 1000)["usage"]
                        else:
                            res = run_vllm_bench(purl, args.model, trace, args.requests, rundir, args.seed)
                            usage = res["usage"]
                    finally:
                        stop_proxy(proxy)
                    dev = deviation(arrivals(out, args.requests, since), times)
                    runs[client].append({**dev, "cpu_s": usage["cpu_s"], "rss_mb": usage["peak_rss_mb"]})
                    print(
                        f"rate {rate:g} rep {rep} {client}: {runs[client][-1]}", file=sys.stderr, flush=True
                    )
            report["rates"][f"{rate:g}"] = {
                client: {k: summary([r[k] for r in rows]) for k in rows[0]} | {"runs": rows}
                for client, rows in runs.items()
            }
    finally:
        stop_server(server)
    if args.json:
        print(json.dumps(report, indent=2))
    print(table(report))


def table(report: Json) -> str:
    out = [
        "| rate | client | p50 ms | p99 ms | max ms | CPU s | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for rate, clients in report["rates"].items():
        for client, fig in clients.items():
            cells = [
                f"{fig[k]['median']:.2f} ({fig[k]['min']:.2f}-{fig[k]['max']:.2f})"
                for k in ("p50_ms", "p99_ms", "max_ms", "cpu_s", "rss_mb")
            ]
            out.append(f"| {rate} req/s | {client} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
