"""What a native stream reader would save the sender process: its CPU per output token, read as now
against read by the prototype in benchmarks/native_reader/reader.c, on the same streams.

Run by hand (a C compiler and Python's headers needed; the prototype is built into a temporary folder):
    .venv/bin/python benchmarks/bench_native_reader.py [--streams 240] [--seconds 20] [--reps 3]
                                                        [--poll-ms 5] [--max-tokens 200]

Starts benchmarks/standin_server.py (deltas of 1-4 tokens 20-100 ms apart per stream, usage in every
chunk), then keeps `--streams` completions in flight from one process on uvloop, each on a keep-alive
connection of soakd's HTTP/1.1 pool (engine/h1.py), alternating two readers, `--reps` runs each:
- `python`: the sender process's path today: each delta read in the transport's callback and counted
  by the sender's own `_Stream` (engine/sender_child.py), progress reported as the sender reports it;
- `native`: the request sent and its response head read the same way, then the socket handed to the
  prototype, which is polled every `--poll-ms` (epoll and recvmsg in C, the GIL released, each read
  stamped by the kernel) and hands back per stream its new tokens, events and first/last stamps; the
  connection goes back to the pool at the stream's end.
Counts the process's CPU (getrusage) over each run's window after a warm-up, per output token and per
delta of the requests that finished in it, and how far the kernel's stamps of the native path sit
before the poll that read them (what a timer-driven read would move a stamp by without them).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import uvloop

from soakd.engine import h1, sender_child
from soakd.engine.base import SpecSteps, Stamps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fidelity import free_port
from bench_sender_event import _Child

HERE = Path(__file__).parent
_NATIVE = 99  # a Connection state of the prototype's: the body is the native reader's


def build(out: Path) -> ModuleType:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = out / f"native_reader{suffix}"
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [
            "cc",
            "-O2",
            "-Wall",
            "-shared",
            "-fPIC",
            f"-I{include}",
            str(HERE / "native_reader" / "reader.c"),
            "-o",
            str(target),
        ],
        check=True,
    )
    spec = importlib.util.spec_from_file_location("native_reader", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Run:
    def __init__(self, mode: str, args: argparse.Namespace, url: str, native: ModuleType) -> None:
        self.mode, self.args = mode, args
        self.target = h1.Target(url)
        self.child = _Child()
        self.reader = native.Reader() if mode == "native" else None
        self.by_key: dict[int, tuple[h1.Connection, sender_child._Stream, list[int]]] = {}
        self.window: tuple[float, float] = (0.0, 0.0)
        self.tokens = self.deltas = 0
        self.miscounted = 0
        """Requests whose tokens as read (the native path: as the prototype counted them) were not
        `max_tokens`: the prototype's check."""
        self.stamp_lead_ms: list[float] = []
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
        events = [0, 0]  # the native path's: events with tokens, tokens
        self.by_key[key] = (conn, stream, events)
        conn.native_key = key  # type: ignore[attr-defined]
        conn.send(head, body, stream)
        try:
            await stream.done
        finally:
            self.by_key.pop(key, None)
        read = stream._seen if self.mode == "python" else events[1]
        self.miscounted += read != self.args.max_tokens
        now = time.monotonic()
        if self.window[0] <= now < self.window[1]:
            self.tokens += self.args.max_tokens
            self.deltas += stream.stamps.deltas + 1 if self.mode == "python" else events[0]

    async def worker(self, pool: h1.Pool, stop: float) -> None:
        body = self.body()
        head = h1.request_head(
            self.target, "POST", "/v1/completions", {"Content-Type": "application/json"}, len(body)
        )
        while time.monotonic() < stop:
            await self.one(pool, head, body)

    async def poller(self, stop: float) -> None:
        assert self.reader is not None
        interval = self.args.poll_ms / 1000
        while time.monotonic() < stop + 30:
            await asyncio.sleep(interval)
            polled = time.time_ns()
            for key, tokens, events, first_ns, last_ns, done, error in self.reader.poll():
                entry = self.by_key.get(key)
                if entry is None:
                    continue
                conn, stream, counted = entry
                if tokens:
                    counted[0] += events
                    counted[1] += tokens
                    self.stamp_lead_ms.append((polled - last_ns) / 1e6)
                    # As _Stream._tokens does per delta, once per poll: stamps, progress.
                    stamps = stream.stamps
                    first = stamps.first is None
                    if first:
                        stamps.first = first_ns / 1e9
                    stamps.last = last_ns / 1e9
                    stream.pending += tokens
                    now = time.monotonic()
                    if first or now - stream._reported_at >= sender_child.PROGRESS_S:
                        self.child.write({"key": key, "n": stream.pending})
                        stream.pending = 0
                        stream._reported_at = now
                if error:
                    # abort() lets go of the sink first: the stream is told here, or it would wait forever.
                    stream.on_error(h1.ProtocolError("the native reader's stream failed"))
                    conn.abort()
                elif done:
                    transport = conn.transport
                    assert transport is not None
                    transport.resume_reading()
                    conn._done()

    async def main(self) -> dict[str, Any]:
        reader = self.reader

        class NativeConnection(h1.Connection):
            native_key = 0

            def _head(self, head: str) -> None:
                super()._head(head)
                if self._state == h1._SIZE:
                    self._state = _NATIVE

            def data_received(self, data: bytes) -> None:
                super().data_received(data)
                if self._state == _NATIVE and self.transport is not None and reader is not None:
                    self._state = h1._IDLE  # the reader's now; _done() makes it the pool's again
                    sock = self.transport.get_extra_info("socket")
                    self.transport.pause_reading()
                    reader.add(sock.fileno(), self.native_key, self._buf)
                    self._buf = b""

        original = h1.Connection
        if self.mode == "native":
            h1.Connection = NativeConnection  # type: ignore[misc]
        try:
            pool = h1.Pool(self.target)
            warm, seconds = 3.0, float(self.args.seconds)
            start = time.monotonic()
            self.window = (start + warm, start + warm + seconds)
            stop = self.window[1]
            tasks = [asyncio.create_task(self.worker(pool, stop)) for _ in range(self.args.streams)]
            if self.mode == "native":
                poll_task = asyncio.create_task(self.poller(stop))
            await asyncio.sleep(self.window[0] - time.monotonic())
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            await asyncio.sleep(self.window[1] - time.monotonic())
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            await asyncio.gather(*tasks)
            if self.mode == "native":
                poll_task.cancel()
            await pool.close()
        finally:
            h1.Connection = original  # type: ignore[misc]
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        out: dict[str, Any] = {
            "mode": self.mode,
            "tokens": self.tokens,
            "deltas": self.deltas,
            "cpu_s": round(cpu, 3),
            "tok_per_s": round(self.tokens / seconds),
            "us_per_token": round(cpu / max(1, self.tokens) * 1e6, 2),
            "us_per_delta": round(cpu / max(1, self.deltas) * 1e6, 2),
            "voluntary_switches": r1.ru_nvcsw - r0.ru_nvcsw,
            "miscounted_requests": self.miscounted,
        }
        if self.stamp_lead_ms:
            lead = sorted(self.stamp_lead_ms)
            out["stamp_before_poll_ms_p50_p99"] = (
                round(lead[len(lead) // 2], 2),
                round(lead[int(len(lead) * 0.99)], 2),
            )
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=240)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--poll-ms", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--server-procs", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        native = build(Path(tmp))
        port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "standin_server.py"),
                "--port",
                str(port),
                "--procs",
                str(args.server_procs),
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
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
                    out = uvloop.run(Run(mode, args, url, native).main())
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
