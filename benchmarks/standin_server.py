"""An OpenAI-compatible stand-in server fast enough never to be the bottleneck of a soakd capacity run.

Run:  python benchmarks/standin_server.py --port P [--procs N] [--arrivals DIR] [--delta-ms 20 100]
                                          [--tokens 1 4] [--ttft-ms 20 60] [--keepalive-s 5]

`--procs` processes each bind the port with SO_REUSEPORT (the kernel spreads connections over them) and
serve HTTP/1.1 on a bare asyncio Protocol: no framework between the socket and the bytes. Each POST
/v1/completions with `"stream": true` is answered as vLLM answers it: an SSE stream in chunked transfer
encoding, one chunk per delta of 1-4 tokens (uniform; `--tokens`), deltas 20-100 ms apart per stream
(`--delta-ms`), the first after 20-60 ms (`--ttft-ms`), exactly `max_tokens` tokens, each chunk with
continuous usage (`completion_tokens` so far) when asked, token ids when `return_token_ids` is set, a
last chunk with `finish_reason` and a usage-only chunk, then `data: [DONE]`. Idle keep-alive connections
are closed after `--keepalive-s` (uvicorn's default, which vLLM's server keeps: 5 s), so a client's pool
goes cold the way it does in front of vLLM. Also answers GET /health, /v1/models, /version, /metrics
(a few vLLM-named counters).

With `--arrivals DIR` each process stamps `time.time_ns()` when the first bytes of each request reach it
(before parsing) and writes `arrivals-<pid>.jsonl` (method, path, X-Request-Id, t_ns) when it stops
(SIGTERM or SIGINT): the arrival as the server sees it, as benchmarks/bench_arrival.py's pass-through
stamps it, without a hop in between.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

_WORDS = [b" the", b" a", b" soak", b" token", b" of", b" night", b" and", b" GPU"]


class Settings:
    def __init__(self, args: argparse.Namespace) -> None:
        self.delta_s = (args.delta_ms[0] / 1000, args.delta_ms[1] / 1000)
        self.tokens = (int(args.tokens[0]), int(args.tokens[1]))
        self.ttft_s = (args.ttft_ms[0] / 1000, args.ttft_ms[1] / 1000)
        self.keepalive_s = float(args.keepalive_s)
        self.max_model_len = int(args.max_model_len)
        self.arrivals: list[tuple[str, str, str, int]] | None = [] if args.arrivals else None


class Stats:
    def __init__(self) -> None:
        self.requests = self.tokens = self.deltas = self.streams = self.peak_streams = 0


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class Http(asyncio.Protocol):
    """One connection: requests in order (no pipelining needed by any client here), streams out."""

    def __init__(self, cfg: Settings, stats: Stats) -> None:
        self.cfg, self.stats = cfg, stats
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.idle: asyncio.TimerHandle | None = None
        self.arrived = 0
        self.loop = asyncio.get_running_loop()
        self.rng = random.Random(id(self))  # noqa: S311 (timing jitter, not secrets)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.idle is not None:
            self.idle.cancel()

    def _arm_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.idle = self.loop.call_later(self.cfg.keepalive_s, self._close_idle)

    def _close_idle(self) -> None:
        if not self.busy and self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.buf:
            self.arrived = time.time_ns()
        self.buf += data
        self._parse()

    def _parse(self) -> None:
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            lines = head.split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length", "0"))
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            arrived, self.arrived = self.arrived, time.time_ns() if self.buf else 0
            if self.cfg.arrivals is not None:
                self.cfg.arrivals.append((method, path, headers.get("x-request-id", ""), arrived))
            self.stats.requests += 1
            self._route(method, path.split("?", 1)[0], body, headers.get("connection", "").lower() == "close")

    def _send(self, status: str, body: bytes, ctype: bytes = b"application/json") -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status.encode(), ctype, len(body), body)
        )
        self._arm_idle()

    def _route(self, method: str, path: str, body: bytes, close: bool) -> None:
        if method == "GET" and path == "/health":
            self._send("200 OK", b"")
        elif method == "GET" and path == "/v1/models":
            card = {"id": "standin", "object": "model", "max_model_len": self.cfg.max_model_len}
            self._send("200 OK", json.dumps({"object": "list", "data": [card]}).encode())
        elif method == "GET" and path == "/version":
            self._send("200 OK", b'{"version":"standin"}')
        elif method == "GET" and path == "/metrics":
            s = self.stats
            text = (
                f"vllm:num_requests_running {s.streams}\n"
                f"vllm:generation_tokens_total {s.tokens}\n"
                f"vllm:request_success_total {s.requests}\n"
            )
            self._send("200 OK", text.encode(), b"text/plain; version=0.0.4")
        elif method == "POST" and path == "/v1/completions":
            self._completion(json.loads(body))
        else:
            self._send("404 Not Found", b'{"error":"not found"}')
        if close and self.transport is not None:
            self.transport.close()

    def _completion(self, req: dict[str, Any]) -> None:
        max_tokens = int(req.get("max_tokens") or 16)
        prompt = req.get("prompt")
        n_prompt = len(prompt) if isinstance(prompt, list) else 1
        usage = bool((req.get("stream_options") or {}).get("continuous_usage_stats"))
        ids = bool(req.get("return_token_ids"))
        if not req.get("stream"):
            doc = {
                "choices": [{"index": 0, "text": "x" * max_tokens, "finish_reason": "length"}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens},
            }
            self._send("200 OK", json.dumps(doc).encode())
            return
        assert self.transport is not None
        self.busy = True
        if self.idle is not None:
            self.idle.cancel()
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        self.stats.streams += 1
        self.stats.peak_streams = max(self.stats.peak_streams, self.stats.streams)
        rid = b"cmpl-%d" % self.rng.getrandbits(48)
        created = int(time.time())
        state = [0]  # tokens sent so far

        def delta() -> None:
            if self.transport is None or self.transport.is_closing():
                self.stats.streams -= 1
                return
            done = state[0]
            n = min(max_tokens - done, self.rng.randint(*self.cfg.tokens))
            state[0] = done + n
            last = state[0] >= max_tokens
            text = b"".join(self.rng.choice(_WORDS) for _ in range(n))
            choice = b'{"index":0,"text":"%s","logprobs":null,"finish_reason":%s,"stop_reason":null%s}' % (
                text,
                b'"length"' if last else b"null",
                b',"token_ids":[%s]' % b",".join(b"%d" % (100 + i) for i in range(done, done + n))
                if ids
                else b"",
            )
            use = (
                b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}'
                % (n_prompt, n_prompt + state[0], state[0])
                if usage
                else b""
            )
            out = _chunk(
                b'data: {"id":"%s","object":"text_completion","created":%d,"model":"standin",'
                b'"choices":[%s]%s}\n\n' % (rid, created, choice, use)
            )
            self.stats.tokens += n
            self.stats.deltas += 1
            if last:
                out += _chunk(
                    b'data: {"id":"%s","object":"text_completion","created":%d,"model":"standin",'
                    b'"choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}\n\n'
                    % (rid, created, n_prompt, n_prompt + max_tokens, max_tokens)
                )
                out += _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
                self.transport.write(out)
                self.stats.streams -= 1
                self.busy = False
                self._arm_idle()
                if self.buf:
                    self._parse()
                return
            self.transport.write(out)
            self.loop.call_later(self.rng.uniform(*self.cfg.delta_s), delta)

        self.loop.call_later(self.rng.uniform(*self.cfg.ttft_s), delta)


def serve(port: int, args: argparse.Namespace) -> None:
    cfg, stats = Settings(args), Stats()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(4096)
        server = await loop.create_server(lambda: Http(cfg, stats), sock=sock)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()

    asyncio.run(main())
    if cfg.arrivals is not None:
        out = Path(args.arrivals) / f"arrivals-{os.getpid()}.jsonl"
        with out.open("w", encoding="utf-8") as f:
            for method, path, rid, t_ns in cfg.arrivals:
                f.write(json.dumps({"method": method, "path": path, "rid": rid, "t_ns": t_ns}) + "\n")
    summary = {
        "pid": os.getpid(),
        "requests": stats.requests,
        "tokens": stats.tokens,
        "deltas": stats.deltas,
        "peak_streams": stats.peak_streams,
    }
    print(json.dumps(summary), file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--arrivals", default="")
    p.add_argument("--delta-ms", type=float, nargs=2, default=(20.0, 100.0))
    p.add_argument("--tokens", type=int, nargs=2, default=(1, 4))
    p.add_argument("--ttft-ms", type=float, nargs=2, default=(20.0, 60.0))
    p.add_argument("--keepalive-s", type=float, default=5.0)
    p.add_argument("--max-model-len", type=int, default=32768)
    args = p.parse_args()
    children = []
    for _ in range(args.procs):
        pid = os.fork()
        if pid == 0:
            try:
                serve(args.port, args)
            finally:
                os._exit(0)
        children.append(pid)

    def forward(sig: int, _: Any) -> None:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for pid in children:
        while True:
            try:
                os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue


if __name__ == "__main__":
    main()
