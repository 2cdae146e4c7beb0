"""The sender process's side (run as `python -m soakd.engine.sender_child`): requests sent at their due
time, their streams read, stamps and token counts reported to soakd over its pipe.

One event loop (uvloop where installed) with one connection pool (engine/h1.py); the frames both ways and
the parent's side are engine/sender.py. Each answer's event stream is read by the native reader where it
is built (engine/native.py: polled, stamped by the kernel), else in its connection's callbacks; either
way `_Stream` takes it: the running token count read without a JSON parse where the event allows, every
delta stamped, progress reported at most every PROGRESS_S; frames to the parent gathered for FLUSH_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from soakd.engine.base import SpecSteps, Stamps
from soakd.engine.completions import (
    BODY_CHARS,
    KIND_ENGINE,
    KIND_GONE,
    KIND_REQUEST,
    RequestError,
    ServerGone,
    error_message,
    new_tokens,
)
from soakd.engine.h1 import Collect, ConnectError, Connection, Pool, ProtocolError, Target, request_head
from soakd.engine.native import UNAVAILABLE, NativeStreams, available
from soakd.engine.sender import FLUSH_S, PROGRESS_S, frame, progress_frame, read_frame
from soakd.errors import EngineError
from soakd.sse import DataSplitter, event_data

_HEALTH_TIMEOUT_S = 10.0


class _Stream:
    """One completion's answer, read in the connection's callbacks (engine/h1.py) or by the native
    reader's poll (engine/native.py): tokens counted from each event, deltas stamped, progress
    reported, nothing awaited per chunk."""

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
        self._splitter = DataSplitter()
        self._seen = 0
        self.pending = 0
        self._reported_at = stamps.sent or time.monotonic()
        self._status = 0
        self._error_body = b""
        self.conn: Connection | None = None
        self.written: float | None = None
        self.new_conn = False
        self.native = False
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
            if not self._event(event, None):
                return

    def _event(self, data: bytes, stamp: float | None) -> bool:
        """One event's data parsed and its tokens counted, stamped `stamp` (None: now); False when it
        ended the request (an error event: the request failed, dropping the connection aborts it)."""
        try:
            n, self._seen = new_tokens(data, self._seen, self._ids, self._spec)
        except RequestError as err:
            self._fail(err)
            if self.conn is not None:
                self.conn.abort(self)
            return False
        if n:
            at = time.monotonic() if stamp is None else stamp
            self._tokens(n, 1, at, at)
        return True

    def on_native_tokens(self, seen: int, events: int, first: float, last: float) -> None:
        # From the running count as kept here: one only the parse of a handed event could read has
        # moved it already, and is not counted twice.
        n = seen - self._seen
        if n > 0 and not self.done.done():
            self._seen = seen
            self._tokens(n, events, first, last, report=True)

    def on_native_failure(self, err: Exception) -> None:
        self._fail(RequestError(f"unreadable stream event: {type(err).__name__}"))

    def on_native_event(self, raw: bytes, stamp: float) -> None:
        data = event_data(raw)
        if data and data != b"[DONE]" and not self.done.done():
            self._event(data, stamp)

    def _tokens(self, n: int, events: int, first_at: float, last_at: float, *, report: bool = False) -> None:
        """`n` new tokens in `events` deltas, the first and last of them stamped `first_at`, `last_at`
        (those between, on the native path, are not known: only the sum of the gaps is kept); with
        `report`, progress goes to the parent now (the native reader paces its reports itself)."""
        stamps = self.stamps
        first = stamps.first is None
        if first:
            stamps.first = first_at
            events -= 1
        else:
            stamps.gaps += first_at - (stamps.last or first_at)
        stamps.gaps += last_at - first_at
        stamps.deltas += events
        stamps.last = last_at
        self.pending += n
        now = time.monotonic()
        # The first token at once (the consumer learns the stream began), then at most every PROGRESS_S.
        if report or first or now - self._reported_at >= PROGRESS_S:
            self._child.progress(self._key, self.pending)
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
        self._progress: dict[int, int] = {}  # key -> tokens not yet reported, for the next `p` frame
        self._flush_due = False
        self._headers = {str(k): str(v) for k, v in dict(init.get("headers", {})).items()}
        self.reader, self.reader_note = _reader_choice(str(init.get("reader", "auto")), self._target)
        # Tokens handed out as often as the parent hears of them: the reader sums the deltas between.
        self.native = (
            NativeStreams(after=self.flush, report_s=PROGRESS_S) if self.reader == "native" else None
        )
        self.pool = Pool(self._target, max(0, int(init.get("max_connections", 0))), native=self.native)
        self._health_head = request_head(self._target, "GET", "/health", self._headers, 0)

    async def warm(self) -> None:
        """Pay the first request's one-time costs before any request is due: the pool's first
        connection, the first request's code paths, the alarm thread's start."""
        await self._open_healthy(1, limit_s=5.0)
        await self._clock.sleep_until(time.monotonic() + 0.001)

    async def _health(self, conn: Connection, limit_s: float) -> int | None:
        """GET /health on `conn`: the answer's status, None when none came in time (then the request
        is dropped with its connection)."""
        sink = Collect(BODY_CHARS)
        conn.send(self._health_head, b"", sink)
        try:
            await asyncio.wait_for(asyncio.shield(sink.done), limit_s)
        except (TimeoutError, ProtocolError):
            conn.abort(sink)
            return None
        return sink.status

    async def _open_healthy(self, n: int, limit_s: float = _HEALTH_TIMEOUT_S) -> int:
        """Open `n` connections at once, each proven with GET /health; those answered 200 join the pool."""

        async def one() -> bool:
            try:
                conn = self.pool.count(await self.pool.connect())
            except ConnectError:
                return False
            # Not healthy: counted out. Its connection stays the pool's (a keep-alive answer ended and
            # gave it back; another request may be on it already).
            return await self._health(conn, limit_s) == 200 and not conn.closed

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
        self._outbox_progress()  # a request's progress before its final frame
        self._outbox.append(frame(header))
        self._soon()

    def progress(self, key: int, n: int) -> None:
        """Report `n` new tokens of `key`: gathered with the others' into one frame at the flush."""
        self._progress[key] = self._progress.get(key, 0) + n
        self._soon()

    def _soon(self) -> None:
        # Written in a native poll: they leave at its end, not on a timer of their own (a wake-up more).
        if not self._flush_due and not (self.native is not None and self.native.polling):
            self._flush_due = True
            asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def _outbox_progress(self) -> None:
        """The progress gathered so far into the outbox, as one `p` frame."""
        if self._progress:
            self._outbox.append(progress_frame(self._progress))
            self._progress = {}

    def flush(self) -> None:
        self._flush_due = False
        self._outbox_progress()
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
        stream.native = self.native is not None and output_ids is None
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
                if attempt == 0:
                    conn, new = await self.pool.acquire()
                else:  # not another idle one: after a server restart it may be dead too
                    conn, new = self.pool.count(await self.pool.connect()), True
            except ConnectError as err:
                gone = ServerGone if err.refused else EngineError
                raise gone(f"server unreachable: {err}"[:200]) from err
            stream.conn = conn
            stream.new_conn = stream.new_conn or new
            # Token ids need every event parsed: those answers are read here, not by the native reader.
            stream.written = conn.send(head, body, stream, native=stream.native)
            try:
                await stream.done
            except asyncio.CancelledError:
                # Dropping the connection is what makes the server abort the request; one whose answer
                # ended is the pool's again, and is left alone.
                conn.abort(stream)
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
        try:
            await self._health(conn, _HEALTH_TIMEOUT_S)  # there, but slow or odd: judge this request alone
        finally:
            conn.abort()  # a probe's connection, never the pool's
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
    nice, nice_error = _renice(int(got[0].get("nice", 0)))
    child = _Child(got[0], out)
    await child.warm()
    loop_kind = type(loop).__module__.split(".")[0]
    ready: dict[str, Any] = {
        "op": "ready",
        "pid": os.getpid(),
        "loop": loop_kind,
        "nice": nice,
        "reader": child.reader,
    }
    if child.reader_note:
        ready["reader_note"] = child.reader_note
    if nice_error:
        ready["nice_error"] = nice_error
    out.write(frame(ready))
    try:
        while (got := await read_frame(reader)) is not None:
            child.handle(*got)
    finally:
        await child.close()
        with contextlib.suppress(ConnectionError):
            await out.drain()


def _reader_choice(want: str, target: Target) -> tuple[str, str]:
    """Which reader reads the streams ("native" or "python") for the asked-for one ("auto", "native",
    "python"), and why not the native one when it was not taken. Asked for "native" where it cannot
    read, the sender does not start (the parent's config check names the key first)."""
    if want == "python":
        return "python", ""
    why = UNAVAILABLE if not available() else "TLS: read through the TLS layer" if target.tls else ""
    if not why:
        return "native", ""
    if want == "native":
        raise EngineError(f"the native stream reader cannot read here: {why}")
    return "python", why


def _renice(want: int) -> tuple[int, str]:
    """Lower this process's nice value to `want` (a negative one needs CAP_SYS_NICE or an RLIMIT_NICE
    that allows it, systemd's LimitNICE=); the nice value in force after, and why not when refused.
    Only the sender: its work is small and all of it is on time, while a nice level for the whole of
    soakd would also raise its collectors, sinks and an in-process engine over the server it measures."""
    error = ""
    if want < 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, want)
        except OSError as err:
            error = f"{type(err).__name__}: {err.strerror}"
    return os.getpriority(os.PRIO_PROCESS, 0), error


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
