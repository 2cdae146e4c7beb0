"""What the native stream reader saves the sender's read path: its CPU per output token, read in Python
against read by soakd's native reader (daemon/soakd/engine/_reader.c), on the same streams, with nothing
else of the sender around them (the capacity benchmark measures the whole sender with either reader).

Run by hand (soakd installed with its native reader built):
    .venv/bin/python benchmarks/bench_native_reader.py [--streams 240] [--seconds 20] [--reps 3]
                                                        [--poll-ms 5] [--max-tokens 200]

Starts benchmarks/standin_server.py (deltas of 1-4 tokens 20-100 ms apart per stream, usage in every
chunk), then keeps `--streams` completions in flight from one process on uvloop, each on a keep-alive
connection of soakd's HTTP/1.1 pool (engine/h1.py), alternating two readers, `--reps` runs each:
- `python`: the sender process's path today: each delta read in the transport's callback and counted
  by the sender's own `_Stream` (engine/sender_child.py), progress reported as the sender reports it;
- `native`: the request sent and its response head read the same way, then the socket handed to the
  native reader (engine/native.py), which is polled every `--poll-ms` (epoll and recvmsg in C, the GIL
  released, each read stamped by the kernel) and hands back per stream its new tokens, events and
  first/last stamps; the connection goes back to the pool at the stream's end.
Counts the process's CPU (getrusage) over each run's window after a warm-up, per output token and per
delta of the requests that finished in it, and checks every request's tokens as counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import uvloop

from soakd.engine import h1, native, sender_child
from soakd.engine.base import SpecSteps, Stamps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fidelity import free_port

HERE = Path(__file__).parent


class _Child:
    """What a stream reports to: the tokens of its progress frames added up, nothing written."""

    def __init__(self) -> None:
        self.tokens: Counter[int] = Counter()

    def write(self, header: dict[str, Any]) -> None:
        self.tokens[int(header["key"])] += int(header.get("n", 0))

    def flush(self) -> None:
        pass


class Run:
    def __init__(self, mode: str, args: argparse.Namespace, url: str) -> None:
        self.mode, self.args = mode, args
        self.target = h1.Target(url)
        self.child = _Child()
        self.window: tuple[float, float] = (0.0, 0.0)
        self.tokens = self.deltas = 0
        self.miscounted = 0
        """Requests whose tokens as counted were not `max_tokens` (vLLM and the stand-in honour it)."""
        self._key = 0

    def body(self) -> bytes:
        return json.dumps(
            {
                "model": "standin",
                "prompt": list(range(1, 201)),
                "max_tokens": self.args.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
        ).encode()

    async def one(self, pool: h1.Pool, head: bytes, body: bytes) -> None:
        self._key += 1
        key = self._key
        stream = sender_child._Stream(self.child, key, Stamps(sent=time.monotonic()), None, SpecSteps())  # type: ignore[arg-type]
        conn, _ = await pool.acquire()
        stream.conn = conn
        conn.send(head, body, stream, native=self.mode == "native")
        await stream.done
        read = self.child.tokens.pop(key, 0) + stream.pending
        self.miscounted += read != self.args.max_tokens
        now = time.monotonic()
        if self.window[0] <= now < self.window[1]:
            self.tokens += self.args.max_tokens
            self.deltas += stream.stamps.deltas + 1

    async def worker(self, pool: h1.Pool, stop: float) -> None:
        body = self.body()
        head = h1.request_head(
            self.target, "POST", "/v1/completions", {"Content-Type": "application/json"}, len(body)
        )
        while time.monotonic() < stop:
            await self.one(pool, head, body)

    async def main(self) -> dict[str, Any]:
        native.POLL_S = self.args.poll_ms / 1000
        streams = (
            native.NativeStreams(after=self.child.flush, report_s=sender_child.PROGRESS_S)
            if self.mode == "native"
            else None
        )
        pool = h1.Pool(self.target, native=streams)
        warm, seconds = 3.0, float(self.args.seconds)
        start = time.monotonic()
        self.window = (start + warm, start + warm + seconds)
        stop = self.window[1]
        tasks = [asyncio.create_task(self.worker(pool, stop)) for _ in range(self.args.streams)]
        await asyncio.sleep(self.window[0] - time.monotonic())
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.sleep(self.window[1] - time.monotonic())
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.gather(*tasks)
        await pool.close()
        merged = {}
        if streams is not None:
            # Events read together with a later one: stamped with its arrival (the native path's error).
            merged = {
                "merged_events_pct": round(100 * streams.merged / max(1, streams.counted), 2),
                "unstamped_reads": streams.unstamped,
            }
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        return {
            "mode": self.mode,
            "tokens": self.tokens,
            "deltas": self.deltas,
            "cpu_s": round(cpu, 3),
            "tok_per_s": round(self.tokens / seconds),
            "us_per_token": round(cpu / max(1, self.tokens) * 1e6, 2),
            "us_per_delta": round(cpu / max(1, self.deltas) * 1e6, 2),
            "voluntary_switches": r1.ru_nvcsw - r0.ru_nvcsw,
            "miscounted_requests": self.miscounted,
            **merged,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=240)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--poll-ms", type=float, default=native.POLL_S * 1000)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--server-procs", type=int, default=1)
    args = p.parse_args()
    if not native.available():
        raise SystemExit(f"the native reader is {native.UNAVAILABLE}")
    port = free_port()
    argv = [sys.executable, str(HERE / "standin_server.py"), "--port", str(port)]
    server = subprocess.Popen(
        [*argv, "--procs", str(args.server_procs)], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the stand-in server did not start") from None
                time.sleep(0.1)
        results: dict[str, list[dict[str, Any]]] = {"python": [], "native": []}
        for _ in range(args.reps):
            for mode in ("python", "native"):
                out = uvloop.run(Run(mode, args, url).main())
                results[mode].append(out)
                print(json.dumps(out), flush=True)
        for mode, runs in results.items():
            per_token = [r["us_per_token"] for r in runs]
            print(f"{mode}: CPU us per output token median {statistics.median(per_token)} ({per_token})")
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
