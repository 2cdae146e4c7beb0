"""A lean HTTP/1.1 client for the sender process: streamed responses read inside the transport's callback.

The sender reads thousands of token streams at once, a network chunk per delta. aiohttp wakes a coroutine
for every chunk (a future, a task step, its stream reader's bookkeeping): measured against a stand-in
server, 34-39 us of CPU per delta under uvloop, against 18 us for a bare asyncio.Protocol that parses the
same bytes in `data_received` (benchmarks/RESULTS.md, "Capacity"). So the completion path of the sender
process runs on this: one request at a time per keep-alive connection, the response's head parsed, its
body de-chunked and handed to a `Sink` as it arrives, nothing awaited per chunk. What it does not do,
because soakd's requests never need it: pipelining, redirects, cookies, proxies, compression, `Expect`.

The pool opens connections on demand up to a limit, and keeps spare idle connections open ahead of
demand for the whole run (the replay's bursts find them open: opening one while every stream in flight
is being read is the sender's worst lateness, measured on an H200): at least the `spare` it was asked
for, and more when the traffic's bursts need them: 1.5x the largest rise in connections in use between
two of the keeper's looks (half a second apart) over the last minute, within the pool's limit. A fixed
count is either too few at a high arrival rate or a waste at a low one; the rise is what the keeper
must have ready before its next look. An idle connection is closed before the server's own keep-alive
timeout would (uvicorn's, which vLLM uses: 5 s), so a request is never written onto a connection the
server is closing; one that is closed under it anyway before any byte of the answer came (a server with
a shorter timeout) is sent once more on a fresh connection, as browsers do.

A pool given the native stream reader (engine/native.py) hands it a 200 answer's chunked event stream
once the head is read, for requests sent with `native`: the socket's reading paused here, the body read
there until its end, the connection given back through `native_end` (or broken, `native_error`).

Over 500 lines because the response parser, the connection that feeds it and the pool that keeps
connections are one protocol's three parts, each small.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import socket
import ssl
import time
from collections import deque
from typing import Protocol, cast
from urllib.parse import unquote, urlsplit

from soakd.engine.native import NativeSink, NativeStreams

IDLE_S = 4.0
"""An idle connection older than this is closed, not reused: under uvicorn's 5 s keep-alive timeout."""
CONNECT_TIMEOUT_S = 30.0
_SPARE_TICK_S = 0.5
_RISE_TICKS = 120  # the keeper's looks the burst is remembered for: a minute
_BURST_MARGIN = 1.5
_MAX_HEAD = 64 * 1024


class ConnectError(Exception):
    """No connection could be opened; `refused` when nothing listens (the server is gone)."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class ProtocolError(Exception):
    """The connection broke or the server's bytes are not HTTP/1.1 (the request failed)."""


class Sink(Protocol):
    """Receives one response; every call comes from the event loop's transport callbacks."""

    def on_head(self, status: int, headers: dict[str, str]) -> None: ...

    def on_body(self, data: bytes) -> None: ...

    def on_end(self) -> None: ...

    def on_error(self, err: Exception) -> None: ...


class Target:
    """Where requests go: scheme, host, port, path prefix, from a base URL."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        default = parts.port is None
        self.host_header = (f"[{self.host}]" if ":" in self.host else self.host) + (
            "" if default else f":{self.port}"
        )
        self.auth = ""
        """Basic credentials from the URL (user:password@), as aiohttp sends them; empty without."""
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.auth = "Basic " + base64.b64encode(pair.encode()).decode()


def request_head(target: Target, method: str, path: str, headers: dict[str, str], body_len: int) -> bytes:
    lines = [f"{method} {target.prefix}{path} HTTP/1.1", f"Host: {target.host_header}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if target.auth and not any(k.lower() == "authorization" for k in headers):
        lines.append(f"Authorization: {target.auth}")
    if method == "POST" or body_len:
        lines.append(f"Content-Length: {body_len}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _IDLE, _NATIVE = range(9)


def _trailer_end(buf: bytes, pos: int) -> int:
    """Where the answer ends after its last chunk: past the empty line, or past the trailer fields and
    the empty line after them; -1 while that has not all come."""
    if buf.startswith(b"\r\n", pos):
        return pos + 2
    end = buf.find(b"\r\n\r\n", pos)
    return end + 4 if end >= 0 else -1


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: Pool | None) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._sink: Sink | None = None
        self._state = _IDLE
        self._buf = b""
        self._left = 0
        self._keep = False
        self._got_bytes = False
        self.idle_since = time.monotonic()
        self._native_ok = False  # this answer's stream may go to the pool's native reader
        self._native_fd = -1  # the socket's fd while the native reader holds the answer
        self.closed = False
        self.counted = False
        """Whether the pool counts it against its limit (Pool.count); its closing uncounts it once."""
        self.made: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- the pool's side
    def send(self, head: bytes, body: bytes, sink: Sink, *, native: bool = False) -> float:
        """Write a request; its answer goes to `sink`. Returns when its bytes were handed to the socket.
        With `native` (the sink is a NativeSink too), a 200 answer's chunked event stream is read by the
        pool's native reader after its head, when the pool has one."""
        assert self.transport is not None and self._sink is None
        self._sink, self._state, self._buf, self._got_bytes = sink, _HEAD, b"", False
        self._native_ok = native and self._pool is not None and self._pool.native is not None
        written = time.monotonic()
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return written

    @property
    def got_bytes(self) -> bool:
        """Whether any byte of the current answer arrived (a reused connection closed before one did
        never served the request)."""
        return self._got_bytes

    def abort(self, sink: Sink | None = None) -> None:
        """Drop the connection now (a cancelled request: the server then aborts it). With `sink`, only
        while that answer is still the connection's: one that ended gave the connection back to the
        pool, and another request may be on it now."""
        if sink is not None and self._sink is not sink:
            return
        self._sink = None
        self._release_native()
        if self.transport is not None:
            self.transport.abort()

    # -- the native reader's side (engine/native.py)
    @property
    def native_held(self) -> bool:
        return self._native_fd >= 0

    def _release_native(self) -> None:
        """Take the answer back from the native reader before the socket closes (its fd may be reused)."""
        if self._native_fd >= 0:
            fd, self._native_fd = self._native_fd, -1
            if self._pool is not None and self._pool.native is not None:
                self._pool.native.remove(fd)

    def _hand_over(self, rest: bytes) -> bool:
        """Give the body's reading to the native reader, with the bytes already read; False when it
        would not take the socket (then reading goes on here, the body chunked)."""
        if self._native_fd >= 0:
            raise ProtocolError("bytes read beside the native reader")  # never: its reading is paused
        self._state = _SIZE
        pool, transport, sink = self._pool, self.transport, self._sink
        assert pool is not None and pool.native is not None and transport is not None and sink is not None
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        transport.pause_reading()
        fd = sock.fileno()
        try:
            pool.native.add(self, cast(NativeSink, sink), fd, rest)
        except (OSError, ValueError):
            transport.resume_reading()
            return False
        self._native_fd = fd
        self._state = _NATIVE
        return True

    def native_end(self, reusable: bool) -> None:
        """The native reader read the answer to its end; `reusable`: nothing followed it."""
        if self._native_fd < 0:
            return
        self._native_fd = -1
        self._keep = self._keep and reusable
        if self._keep and self.transport is not None:
            self.transport.resume_reading()
        self._done()

    def native_error(self, why: str) -> None:
        """The answer broke on the native path (cut short, malformed, or its news failed in soakd): the
        request failed. A stream the reader still holds is taken back from it first."""
        if self._native_fd < 0:
            return
        self._release_native()
        sink, self._sink = self._sink, None
        self._state = _IDLE
        if sink is not None:
            sink.on_error(ProtocolError(why))
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, and it calls this a loop step after
        # create_connection returns: Pool.connect waits for `made`.
        self.transport = cast(asyncio.Transport, transport)
        if not self.made.done():
            self.made.set_result(None)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._release_native()
        if not self.made.done():
            self.made.set_result(None)
        sink, self._sink = self._sink, None
        if sink is not None:
            if self._state == _UNTIL_CLOSE and exc is None:
                sink.on_end()
            else:
                sink.on_error(ProtocolError(f"connection closed by the server{f': {exc}' if exc else ''}"))
        if self._pool is not None:
            self._pool.discard(self)

    def data_received(self, data: bytes) -> None:
        if self._sink is None:
            # Bytes on an idle connection: nothing to answer, the connection cannot be trusted.
            if self.transport is not None:
                self.transport.abort()
            return
        self._got_bytes = True
        try:
            self._feed(data)
        except (ValueError, ProtocolError) as err:
            self._release_native()
            sink, self._sink = self._sink, None
            if sink is not None:
                bad = err if isinstance(err, ProtocolError) else ProtocolError(f"malformed answer: {err}")
                sink.on_error(bad)
            if self.transport is not None:
                self.transport.abort()

    def _feed(self, data: bytes) -> None:
        if self._state == _SIZE and not self._buf and (sink := self._sink) is not None:
            # The common read of a stream: one whole chunk ("<hex>\r\n<payload>\r\n"), handed over
            # without the state machine's bookkeeping.
            end = data.find(b"\r\n")
            if 0 < end <= 8 and data.find(b";", 0, end) < 0:
                stop = end + 2 + int(data[:end], 16)
                if stop > end + 2 and len(data) == stop + 2 and data.endswith(b"\r\n"):
                    sink.on_body(data[end + 2 : stop])
                    return
        buf = self._buf + data if self._buf else data
        pos = 0
        while self._sink is not None:
            state = self._state
            if state == _SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                size = int(buf[pos:end].split(b";", 1)[0], 16)
                if size < 0:
                    raise ProtocolError("negative chunk size")
                pos = end + 2
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._left, self._state = size, _DATA
            elif state == _DATA:
                take = min(self._left, len(buf) - pos)
                if take <= 0:
                    break
                self._sink.on_body(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = _DATA_END
            elif state == _DATA_END:
                if len(buf) - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("malformed chunk")
                pos += 2
                self._state = _SIZE
            elif state == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if len(buf) - pos > _MAX_HEAD:
                        raise ProtocolError("response head too large")
                    break
                head = buf[pos:end].decode("latin-1")
                pos = end + 4
                self._head(head)
            elif state == _TRAILER:
                stop = _trailer_end(buf, pos)
                if stop >= 0:
                    pos = stop
                    self._done()
                break
            elif state == _LENGTH:
                take = min(self._left, len(buf) - pos)
                if take > 0:
                    self._sink.on_body(buf[pos : pos + take])
                    pos += take
                    self._left -= take
                if self._left == 0:
                    self._done()
                    break
                break
            elif state == _UNTIL_CLOSE:
                if pos < len(buf):
                    self._sink.on_body(buf[pos:])
                pos = len(buf)
                break
            elif state == _NATIVE:
                if self._hand_over(buf[pos:]):
                    pos = len(buf)
                    break
            else:
                break
        self._buf = buf[pos:] if pos < len(buf) else b""

    def _head(self, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ProtocolError(f"not an HTTP/1.1 answer: {lines[0][:60]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            return  # an interim answer: the real head follows
        conn = headers.get("connection", "").lower()
        self._keep = parts[0] == "HTTP/1.1" and "close" not in conn
        sink = self._sink
        assert sink is not None
        sink.on_head(status, headers)
        if status in (204, 304):
            self._left, self._state = 0, _LENGTH
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _NATIVE if self._native_ok and status == 200 else _SIZE
        elif "content-length" in headers:
            self._left, self._state = int(headers["content-length"]), _LENGTH
            if self._left < 0:
                raise ProtocolError("negative content-length")
        else:
            self._keep, self._state = False, _UNTIL_CLOSE
        if self._state == _LENGTH and self._left == 0:
            self._done()

    def _done(self) -> None:
        sink, self._sink = self._sink, None
        self._state = _IDLE
        if sink is not None:
            sink.on_end()
        if self._keep and self._pool is not None and not self.closed:
            self.idle_since = time.monotonic()
            self._pool.release(self)
        elif self.transport is not None:
            self.transport.close()


class Pool:
    """Connections to one server: reused while fresh, opened on demand up to `limit` (0: no limit), and
    `spare` kept open idle ahead of demand once `keep_spare` is called."""

    def __init__(
        self, target: Target, limit: int = 0, idle_s: float = IDLE_S, native: NativeStreams | None = None
    ) -> None:
        self.target = target
        self.native = None if target.tls else native
        """The native stream reader its connections hand streams to (never through TLS)."""
        self._limit = limit
        self._idle_s = idle_s
        self._idle: deque[Connection] = deque()
        self._open = 0
        self._waiters: deque[asyncio.Future[Connection | None]] = deque()
        self._ssl = ssl.create_default_context() if target.tls else None
        self._spare = 0
        self._keeper: asyncio.Task[None] | None = None
        self._peak = 0  # connections in use, the most since the keeper's last look
        self._at_look = 0  # connections in use at the keeper's last look
        self._rises: deque[int] = deque(maxlen=_RISE_TICKS)
        self.spare_target = 0
        """Idle connections the keeper holds open now (the asked-for spare, or the bursts' need)."""

    async def connect(self, *, pooled: bool = True) -> Connection:
        """A new connection, given back to the pool after each answer when `pooled` (counted against the
        limit by `acquire` or `count`). Raises ConnectError."""
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(self if pooled else None),
                    self.target.host,
                    self.target.port,
                    ssl=self._ssl,
                ),
                CONNECT_TIMEOUT_S,
            )
        except TimeoutError as err:
            raise ConnectError(f"connect timed out after {CONNECT_TIMEOUT_S:.0f} s", refused=False) from err
        except OSError as err:
            refused = isinstance(err, ConnectionRefusedError)
            raise ConnectError(f"{type(err).__name__}: {err}", refused=refused) from err
        try:
            await conn.made
        except BaseException:
            conn.abort()  # cancelled as it opened (uvloop makes it a loop step later): not left open
            raise
        if conn.closed:
            raise ConnectError("the connection closed as it opened", refused=False)
        return conn

    async def acquire(self) -> tuple[Connection, bool]:
        """A connection for one request, and whether it was opened for it. Raises ConnectError."""
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the freshest
            if self._stale(conn, now):
                self._close(conn)
                continue
            self._note_use()
            return conn, False
        while self._limit and self._open >= self._limit:
            fut: asyncio.Future[Connection | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                got = await fut
            except asyncio.CancelledError:
                # Handed a connection or a free slot as it was cancelled: pass it on, not lose it.
                if fut.done() and not fut.cancelled():
                    handed = fut.result()
                    if handed is not None:
                        self.release(handed)
                    else:
                        self._wake()
                raise
            if got is not None:
                self._note_use()
                return got, False
        self._open += 1  # the slot, taken before the connect's await
        try:
            conn = await self.connect()
        except BaseException:
            self._open -= 1
            self._wake()
            raise
        conn.counted = True
        self._note_use()
        return conn, True

    def _in_use(self) -> int:
        return self._open - len(self._idle)

    def _note_use(self) -> None:
        self._peak = max(self._peak, self._in_use())

    def release(self, conn: Connection) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        self._idle.append(conn)

    def discard(self, conn: Connection) -> None:
        """A connection that closed: it no longer counts, and a waiter may open one instead."""
        if conn in self._idle:
            self._idle.remove(conn)
        if conn.counted:
            conn.counted = False
            self._open -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # it may open a connection now
                return

    def _stale(self, conn: Connection, now: float) -> bool:
        """Closed, or idle long enough that the server may be closing it: not to be reused."""
        return conn.closed or now - conn.idle_since > self._idle_s

    def _close(self, conn: Connection) -> None:
        if conn.transport is not None:
            conn.transport.close()

    def count(self, conn: Connection) -> Connection:
        """Count a connection opened outside `acquire` (ahead of demand) as the pool's; call it before
        the next await, so its closing (which uncounts it) cannot come first."""
        if not conn.counted and not conn.closed:
            conn.counted = True
            self._open += 1
        return conn

    def keep_spare(self, n: int) -> None:
        """Keep at least `n` idle connections open from now on (replacing those that grew stale), more
        when the bursts need them (see the module)."""
        self._spare = max(0, n)
        if self._keeper is None and self._spare:
            self._keeper = asyncio.create_task(self._keep(), name="soakd-spare-connections")

    async def _keep(self) -> None:
        while True:
            now = time.monotonic()
            fresh = 0
            for conn in list(self._idle):
                if self._stale(conn, now):
                    self._idle.remove(conn)
                    self._close(conn)
                else:
                    fresh += 1
            self.spare_target = self._look()
            want = self.spare_target - fresh
            if self._limit:
                want = min(want, self._limit - self._open)
            if want > 0:
                await asyncio.gather(*(self._one_spare() for _ in range(want)), return_exceptions=True)
            await asyncio.sleep(_SPARE_TICK_S)

    def _look(self) -> int:
        """Record the rise in connections in use since the last look; the idle connections to hold until
        the next: the asked-for spare, or 1.5x the largest rise over the last minute."""
        self._rises.append(max(0, self._peak - self._at_look))
        self._at_look = self._peak = self._in_use()
        burst = math.ceil(_BURST_MARGIN * max(self._rises))
        return max(self._spare, burst)

    async def _one_spare(self) -> None:
        conn = self.count(await self.connect())
        conn.idle_since = time.monotonic()
        self.release(conn)

    async def close(self) -> None:
        if self.native is not None:
            self.native.close()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        for conn in list(self._idle):
            self._close(conn)
        self._idle.clear()


class Collect:
    """A Sink that keeps a whole (short) answer: status and up to `limit` bytes of body."""

    def __init__(self, limit: int = 65536) -> None:
        self.status = 0
        self.body = b""
        self._limit = limit
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self.status = status

    def on_body(self, data: bytes) -> None:
        if len(self.body) < self._limit:
            self.body += data[: self._limit - len(self.body)]

    def on_end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_error(self, err: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(err)
