"""The HTTP sender process: completions sent at their exact due time from a process that does nothing else.

soakd's main process runs collectors, sinks, the controller and the verdict on threads and an event loop
that share one GIL. A request due while another thread holds the GIL (a sink serializing a batch, a
collector's Python between NVML calls) leaves late by up to the interpreter's switch interval, and more
when that thread is descheduled: the tail a soak's latency figures inherit. The sender is a child process
(`python -m soakd.engine.sender`) with its own interpreter: the main process hands each request over a
pipe ahead of its due time, with its body already encoded; the child waits for the due time precisely
(soakd.clock's alarm), posts, reads the stream, stamps the send and every delta on the system-wide
monotonic clock, and answers with the stamps and the token counts.

Frames, both ways: two big-endian u32 (header length, body length), a JSON header, the body bytes.
Parent to child: `init` (URL, headers, pool size; on the pipe: an API key is in no argv, and the
variable holding it is removed from the child's environment), `send` (key, due time, request id, whether
to return token ids and speculative metrics; the body is the request's JSON), `cancel` (key), `warm`
(key, connections to open now). Child to parent: `ready`; a `warm`'s final frame (connections opened);
per request progress frames (the first token at once, then tokens so far at most every
PROGRESS_S, so live counters move during long generations) and one final frame (stamps, tokens, ids,
speculative counts, or an error and its kind). End of input stops the child: it never outlives soakd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from soakd.engine.base import GenerationRequest, SpecSteps, Stamps
from soakd.engine.completions import (
    BODY_CHARS,
    KIND_ENGINE,
    KIND_GONE,
    KIND_REQUEST,
    RequestError,
    ServerGone,
    error_message,
    new_tokens,
    usage_tokens,
)
from soakd.engine.h1 import Collect, ConnectError, Connection, Pool, ProtocolError, Target, request_head
from soakd.errors import EngineError
from soakd.sse import DataSplitter

log = structlog.get_logger(__name__)

_HEAD = struct.Struct(">II")
# Bounds on what a frame may announce, checked before reading it: a prompt of the longest context as
# JSON is a few MiB; the header holds at most a request's output token ids.
MAX_HEADER = 64 * 1024 * 1024
MAX_BODY = 256 * 1024 * 1024
PROGRESS_S = 0.5
"""Longest a request's new tokens wait before the child reports them."""
FLUSH_S = 0.002
"""Longest a frame for the parent waits for others to leave with it."""
_START_TIMEOUT_S = 60.0
_WARM_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 5.0
_HEALTH_TIMEOUT_S = 10.0
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
"""A sender that exits more than MAX_RESTARTS times within this window is a bug, not bad luck: the
replay ends (HarnessError) instead of restarting it again."""

KIND_SENDER = "sender"
"""A final frame's error kind when the child itself is gone (the request's outcome is unknown)."""


_LIVE: set[int] = set()  # pids of the sender processes running now, for soakd's own resource figures


def sender_pids() -> list[int]:
    """Pids of the sender processes running now (soakd's own processes, not the engine's)."""
    return sorted(_LIVE)


class FrameError(Exception):
    """A frame announced more than the bounds allow, or its header is not a JSON object."""


def frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _HEAD.pack(len(head), len(body)) + head + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at a clean end of input (nothing half read)."""
    try:
        prefix = await reader.readexactly(_HEAD.size)
    except asyncio.IncompleteReadError as err:
        if err.partial:
            raise FrameError("input ended inside a frame's length prefix") from err
        return None
    head_len, body_len = _HEAD.unpack(prefix)
    if head_len > MAX_HEADER or body_len > MAX_BODY:
        raise FrameError(f"frame announces {head_len} + {body_len} bytes, above the bounds")
    head = await reader.readexactly(head_len)
    body = await reader.readexactly(body_len) if body_len else b""
    header = json.loads(head)
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header, body


# ------------------------------------------------------------------------------------ the parent's side


@dataclass(slots=True)
class _Pending:
    queue: asyncio.Queue[dict[str, Any]]


class SenderProcess:
    """The parent's handle on one sender child: start it, hand it requests, read its answers."""

    def __init__(self, url: str, headers: dict[str, str], max_connections: int) -> None:
        self._init = {"op": "init", "url": url, "headers": headers, "max_connections": max_connections}
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, _Pending] = {}
        self._next = 0
        self._exited = False
        self.loop_kind = ""
        """The child's event loop ("uvloop" or "asyncio"), from its ready frame."""
        self.submitted = 0
        """Requests handed to this child."""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return (
            self._proc is not None
            and not self._exited
            and self._reader is not None
            and not self._reader.done()
        )

    async def start(self, secret_env: str = "") -> None:
        """Start the child and wait for its ready frame; `secret_env` names a variable (an API key) kept
        out of the child's environment (the key reaches it on the pipe)."""
        try:
            await self._start(secret_env)
        except BaseException:
            # Failed or cancelled midway: no child is left running unread.
            await self.stop()
            raise

    async def _start(self, secret_env: str) -> None:
        env = dict(os.environ)
        if secret_env:
            env.pop(secret_env, None)
        # soakd as this process imports it: where the environment finds it, else where it was found here
        # (appended: the environment's and the standard library's modules come first; -P keeps the
        # working directory out).
        env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH", ""), _package_root()] if p)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",
                "-m",
                "soakd.engine.sender",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
                # Its own session: a Ctrl-C on the terminal reaches soakd, which drains and then stops
                # the child, instead of killing requests in flight.
                start_new_session=True,
            )
        except OSError as err:
            raise EngineError(f"cannot start the sender process: {err}") from err
        proc = self._proc
        _LIVE.add(proc.pid)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(frame(self._init))
        try:
            got = await asyncio.wait_for(read_frame(proc.stdout), _START_TIMEOUT_S)
        except (TimeoutError, FrameError, asyncio.IncompleteReadError, ValueError) as err:
            raise EngineError(f"the sender process did not start: {type(err).__name__}") from err
        if got is None or got[0].get("op") != "ready":
            raise EngineError(f"the sender process did not start (exit code {proc.returncode})")
        self.loop_kind = str(got[0].get("loop", ""))
        self._reader = asyncio.create_task(self._read(proc.stdout), name="soakd-sender-reader")

    def submit(self, request: GenerationRequest, body: bytes) -> tuple[int, asyncio.Queue[dict[str, Any]]]:
        """Hand a request over; its progress and final frames arrive on the returned queue."""
        if self._proc is None or self._proc.stdin is None or self._exited:
            raise EngineError("the sender process is not running")
        header = {
            "op": "send",
            "at": request.send_at,
            "rid": request.request_id,
            "ids": request.output_ids is not None,
            "spec": request.spec is not None,
        }
        self.submitted += 1
        return self._post(header, body)

    def _post(self, header: dict[str, Any], body: bytes = b"") -> tuple[int, asyncio.Queue[dict[str, Any]]]:
        """Write a frame under a fresh key; the child's answers to it arrive on the returned queue."""
        assert self._proc is not None and self._proc.stdin is not None
        self._next += 1
        key = self._next
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._pending[key] = _Pending(queue)
        self._proc.stdin.write(frame({**header, "key": key}, body))
        return key, queue

    def forget(self, key: int, *, cancel: bool) -> None:
        """Drop a request's queue; with `cancel`, the child abandons it (closing its connection aborts
        it in the server)."""
        if self._pending.pop(key, None) is not None and cancel and self.running:
            assert self._proc is not None and self._proc.stdin is not None
            self._proc.stdin.write(frame({"op": "cancel", "key": key}))

    async def warm(self, connections: int) -> int:
        """Have the child open `connections` connections to the server now; how many it opened (0 when
        it could not, or took longer than a few seconds)."""
        if self._proc is None or self._proc.stdin is None or not self.running:
            return 0
        key, queue = self._post({"op": "warm", "n": connections})
        try:
            header = await asyncio.wait_for(queue.get(), _WARM_TIMEOUT_S)
        except TimeoutError:
            return 0
        finally:
            self._pending.pop(key, None)
        return int(header.get("opened", 0))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "end of output"
        try:
            while (got := await read_frame(reader)) is not None:
                header = got[0]
                pending = self._pending.get(header.get("key", -1))
                if pending is not None:
                    pending.queue.put_nowait(header)
        except (FrameError, asyncio.IncompleteReadError, ValueError, ConnectionError) as err:
            why = f"{type(err).__name__}: {err}"[:200]
        finally:
            self._exited = True
            code = None
            if self._proc is not None:
                with contextlib.suppress(TimeoutError):
                    code = await asyncio.wait_for(self._proc.wait(), 2.0)
                if code is not None:
                    _LIVE.discard(self._proc.pid)
            message = f"the sender process exited (code {code}, {why})"
            if self._pending:
                log.error("sender_exited", code=code, reason=why, requests_lost=len(self._pending))
            for pending in self._pending.values():
                pending.queue.put_nowait({"final": True, "error": {"kind": KIND_SENDER, "message": message}})
            self._pending.clear()

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # end of input: the child cancels what it has and exits
            try:
                await asyncio.wait_for(proc.wait(), _STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        finally:
            _LIVE.discard(proc.pid)
            self._exited = True
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


def take_final(header: dict[str, Any], request: GenerationRequest) -> None:
    """Copy a final frame's results into the request (stamps, token ids, speculative counts)."""
    stamps = header.get("stamps")
    if request.stamps is not None and isinstance(stamps, dict):
        request.stamps.sent = stamps.get("sent")
        request.stamps.written = stamps.get("written")
        request.stamps.new_connection = bool(stamps.get("new_conn", False))
        request.stamps.first = stamps.get("first")
        request.stamps.last = stamps.get("last")
        request.stamps.gaps = float(stamps.get("gaps", 0.0))
        request.stamps.deltas = int(stamps.get("deltas", 0))
    ids = header.get("ids")
    if request.output_ids is not None and isinstance(ids, list):
        request.output_ids.extend(int(i) for i in ids)
    spec = header.get("spec")
    if request.spec is not None and isinstance(spec, dict):
        request.spec.accepted.extend(int(i) for i in spec.get("accepted", []))
        request.spec.drafted.extend(int(i) for i in spec.get("drafted", []))


async def stream_via(
    sender: SenderProcess, request: GenerationRequest, body: bytes
) -> AsyncIterator[dict[str, Any]]:
    """The frames of one request sent through `sender`: progress frames, then the final one.

    Leaving early (a cancelled consumer) cancels the request in the child.
    """
    key, queue = sender.submit(request, body)
    done = False
    try:
        while True:
            header = await queue.get()
            done = bool(header.get("final"))
            yield header
            if done:
                return
    finally:
        sender.forget(key, cancel=not done)


def _package_root() -> str:
    import soakd

    return str(Path(soakd.__file__).resolve().parent.parent)


# ------------------------------------------------------------------------------------- the child's side


class _Stream:
    """One completion's answer, read in the connection's callbacks (engine/h1.py): tokens counted from
    each event, deltas stamped, progress reported, nothing awaited per chunk."""

    def __init__(
        self,
        child: _Child,
        key: int,
        stamps: Stamps,
        output_ids: list[int] | None,
        spec: SpecSteps | None,
    ) -> None:
        self._child, self._key, self.stamps = child, key, stamps
        self._ids, self._spec = output_ids, spec
        self._lean = output_ids is None
        self._splitter = DataSplitter()
        self._seen = 0
        self.pending = 0
        self._reported_at = stamps.sent or time.monotonic()
        self._status = 0
        self._error_body = b""
        self.conn: Connection | None = None
        self.written: float | None = None
        self.new_conn = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def again(self) -> None:
        """Ready to be sent once more (nothing of the first answer arrived)."""
        self._status, self._error_body, self._splitter = 0, b"", DataSplitter()
        self.done = asyncio.get_running_loop().create_future()

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self._status = status

    def on_body(self, data: bytes) -> None:
        if self._status != 200:
            if len(self._error_body) < BODY_CHARS:
                self._error_body += data[: BODY_CHARS - len(self._error_body)]
            return
        for event in self._splitter.feed(data):
            if event == b"[DONE]" or self.done.done():
                continue
            total = usage_tokens(event) if self._lean else None
            try:
                if total is not None:
                    n, self._seen = max(0, total - self._seen), max(self._seen, total)
                else:
                    n, self._seen = new_tokens(event, self._seen, self._ids, self._spec)
            except RequestError as err:
                # A stream's error event: the request failed; dropping the connection aborts it.
                self._fail(err)
                if self.conn is not None:
                    self.conn.abort()
                return
            if n:
                self._tokens(n)

    def _tokens(self, n: int) -> None:
        now = time.monotonic()
        stamps = self.stamps
        first = stamps.first is None
        if first:
            stamps.first = now
        else:
            stamps.gaps += now - (stamps.last or now)
            stamps.deltas += 1
        stamps.last = now
        self.pending += n
        # The first token at once (the consumer learns the stream began), then at most every PROGRESS_S.
        if first or now - self._reported_at >= PROGRESS_S:
            self._child.write({"key": self._key, "n": self.pending})
            self.pending = 0
            self._reported_at = now

    def on_end(self) -> None:
        if self._status != 200:
            text = self._error_body.decode("utf-8", errors="replace")
            self._fail(RequestError(error_message(self._status, text)))
        elif not self.done.done():
            self.done.set_result(None)

    def on_error(self, err: Exception) -> None:
        self._fail(err)

    def _fail(self, err: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(err)


class _Child:
    """Sends each request at its time and reports on it; one connection pool, one event loop."""

    def __init__(self, init: dict[str, Any], out: asyncio.StreamWriter) -> None:
        from soakd.clock import SystemClock

        self._target = Target(str(init["url"]))
        self._out = out
        self._clock = SystemClock()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[bytes] = []
        self._headers = {str(k): str(v) for k, v in dict(init.get("headers", {})).items()}
        self.pool = Pool(self._target, max(0, int(init.get("max_connections", 0))))

    async def warm(self) -> None:
        """Pay the first request's one-time costs before any request is due: the pool's first
        connection, the first request's code paths, the alarm thread's start."""
        await self._open_healthy(1, limit_s=5.0)
        await self._clock.sleep_until(time.monotonic() + 0.001)

    async def _open_healthy(self, n: int, limit_s: float = _HEALTH_TIMEOUT_S) -> int:
        """Open `n` connections at once, each proven with GET /health; those answered 200 join the pool."""
        head = request_head(self._target, "GET", "/health", self._headers, 0)

        async def one() -> bool:
            try:
                conn = self.pool.count(await self.pool.connect())
            except ConnectError:
                return False
            sink = Collect(BODY_CHARS)
            conn.send(head, b"", sink)
            try:
                await asyncio.wait_for(asyncio.shield(sink.done), limit_s)
            except (TimeoutError, ProtocolError):
                conn.abort()
                return False
            if sink.status != 200 or conn.closed:
                conn.abort()
                return False
            return True  # its answer's end put it into the pool

        return sum(await asyncio.gather(*(one() for _ in range(max(0, n)))))

    def handle(self, header: dict[str, Any], body: bytes) -> None:
        op = header.get("op")
        key = int(header.get("key", 0))
        if op == "send":
            self._spawn(key, self._one(key, header, body))
        elif op == "cancel" and (running := self._tasks.get(key)) is not None:
            running.cancel()
        elif op == "warm":
            self._spawn(key, self._warm(key, int(header.get("n", 0))))

    def _spawn(self, key: int, work: Coroutine[Any, Any, None]) -> None:
        """Run one keyed piece of work (a request, a warm); it is cancelled by key or at close."""
        task = asyncio.create_task(work)
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

    async def _warm(self, key: int, n: int) -> None:
        opened = await self._open_healthy(n)
        # From now on the pool keeps that many open ahead of demand, replacing stale ones.
        self.pool.keep_spare(n)
        self.write({"key": key, "final": True, "opened": opened})

    def write(self, header: dict[str, Any]) -> None:
        """Queue a frame for the parent; the frames of FLUSH_S leave in one write (a pipe write per
        frame, each waking the parent, was the largest single cost of the sender at 10,000 tokens/s).
        What the frames carry was stamped when it happened: the wait delays only its bookkeeping."""
        self._outbox.append(frame(header))
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        if self._outbox:
            data, self._outbox = b"".join(self._outbox), []
            self._out.write(data)

    async def _one(self, key: int, header: dict[str, Any], body: bytes) -> None:
        at = header.get("at")
        if isinstance(at, (int, float)):
            await self._clock.sleep_until(float(at))
        output_ids: list[int] | None = [] if header.get("ids") else None
        spec = SpecSteps() if header.get("spec") else None
        stamps = Stamps(sent=time.monotonic())
        head = request_head(
            self._target,
            "POST",
            "/v1/completions",
            {**self._headers, "X-Request-Id": str(header.get("rid", "")), "Content-Type": "application/json"},
            len(body),
        )
        final: dict[str, Any] = {"key": key, "final": True}
        stream = _Stream(self, key, stamps, output_ids, spec)
        try:
            await self._exchange(stream, head, body)
        except ServerGone as err:
            final["error"] = {"kind": KIND_GONE, "message": str(err)}
        except EngineError as err:
            final["error"] = {"kind": KIND_ENGINE, "message": str(err)}
        except RequestError as err:
            final["error"] = {"kind": KIND_REQUEST, "message": str(err)}
        # One request's failure is reported, never the sender's end: the boundary per request.
        except Exception as err:  # noqa: BLE001
            final["error"] = {"kind": KIND_REQUEST, "message": f"{type(err).__name__}: {err}"[:200]}
        final["n"] = stream.pending
        final["stamps"] = {
            "sent": stamps.sent,
            "written": stream.written,
            "new_conn": stream.new_conn,
            "first": stamps.first,
            "last": stamps.last,
            "gaps": stamps.gaps,
            "deltas": stamps.deltas,
        }
        if output_ids is not None:
            final["ids"] = output_ids
        if spec is not None:
            final["spec"] = {"accepted": spec.accepted, "drafted": spec.drafted}
        self.write(final)

    async def _exchange(self, stream: _Stream, head: bytes, body: bytes) -> None:
        """Send on a pooled connection and wait for the answer's end. A reused connection closed before
        any byte of its answer came never served the request: it is sent once more on a fresh one."""
        for attempt in range(2):
            try:
                conn, new = await self.pool.acquire()
            except ConnectError as err:
                gone = ServerGone if err.refused else EngineError
                raise gone(f"server unreachable: {err}"[:200]) from err
            stream.conn = conn
            stream.new_conn = stream.new_conn or new
            stream.written = conn.send(head, body, stream)
            try:
                await stream.done
            except asyncio.CancelledError:
                conn.abort()  # dropping the connection is what makes the server abort the request
                raise
            except ProtocolError as err:
                if attempt == 0 and not new and not conn.got_bytes:
                    stream.again()
                    continue
                raise await self._broken(err) from err
            return

    async def _broken(self, err: Exception) -> Exception:
        """What a broken connection means: a server that died (ServerGone) or one failed request. A
        dropped keep-alive connection or a cut stream says nothing by itself; a fresh connection being
        refused does."""
        message = f"{type(err).__name__}: {err}"[:200]
        try:
            conn = await self.pool.connect(pooled=False)
        except ConnectError as refused:
            gone = ServerGone if refused.refused else EngineError
            return gone(f"server unreachable after {message}"[:200])
        sink = Collect(BODY_CHARS)
        conn.send(request_head(self._target, "GET", "/health", self._headers, 0), b"", sink)
        with contextlib.suppress(Exception):  # there, but slow or odd: judge this request alone
            await asyncio.wait_for(sink.done, _HEALTH_TIMEOUT_S)
        conn.abort()
        return RequestError(message)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self.flush()
        await self.pool.close()


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout.buffer)
    out = asyncio.StreamWriter(transport, protocol, None, loop)
    got = await read_frame(reader)
    if got is None or got[0].get("op") != "init":
        return
    child = _Child(got[0], out)
    await child.warm()
    loop_kind = type(loop).__module__.split(".")[0]
    out.write(frame({"op": "ready", "pid": os.getpid(), "loop": loop_kind}))
    try:
        while (got := await read_frame(reader)) is not None:
            child.handle(*got)
    finally:
        await child.close()
        with contextlib.suppress(ConnectionError):
            await out.drain()


def main() -> None:
    import gc

    # What the imports made is frozen, so a full collection walks only what requests allocate (little):
    # its pauses would be send jitter.
    gc.freeze()
    structlog.configure(
        processors=[structlog.processors.TimeStamper(fmt="iso"), structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        loop_runner()(_serve())


def loop_runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    """uvloop's runner where it is installed, else asyncio's. Reading thousands of streams is mostly
    event-loop work per network chunk, which uvloop does in C: it halves the sender's CPU per delta
    (benchmarks/RESULTS.md, "Capacity")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


if __name__ == "__main__":
    main()
