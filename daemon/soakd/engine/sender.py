"""The HTTP sender process: completions sent at their exact due time from a process that does nothing else.

soakd's main process runs collectors, sinks, the controller and the verdict on threads and an event loop
that share one GIL. A request due while another thread holds the GIL (a sink serializing a batch, a
collector's Python between NVML calls) leaves late by up to the interpreter's switch interval, and more
when that thread is descheduled: the tail a soak's latency figures inherit. The sender is a child process
(`python -m soakd.engine.sender_child`) with its own interpreter: the main process hands each request over a
pipe ahead of its due time, with its body already encoded; the child waits for the due time precisely
(soakd.clock's alarm), posts, reads the stream, stamps the send and every delta on the system-wide
monotonic clock, and answers with the stamps and the token counts.

Frames, both ways: two big-endian u32 (header length, body length), a JSON header, the body bytes.
Parent to child: `init` (URL, headers, pool size; on the pipe: an API key is in no argv, and the
variable holding it is removed from the child's environment), `send` (key, due time, request id, whether
to return token ids and speculative metrics; the body is the request's JSON), `cancel` (key), `warm`
(key, connections to open now). Child to parent: `ready`; a `warm`'s final frame (connections opened);
per request progress (the first token at once, then tokens so far at most every PROGRESS_S, so live
counters move during long generations; the reports of one flush as one `p` frame of key, tokens pairs)
and one final frame (stamps, tokens, ids, speculative counts, or an error and its kind), after its
progress. End of input stops the child: it never outlives soakd.

Over 500 lines because the frames' two ends (the writer, the chunked splitter, the per-request mailbox)
and the parent's handles on one child and on several belong together: each side is read against the
other.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import structlog

from soakd.engine.base import GenerationRequest
from soakd.errors import EngineError, HarnessError

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
_READ_BYTES = 1 << 20
_START_TIMEOUT_S = 60.0
_WARM_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 5.0
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


# msgspec: the frames' JSON several times faster than the json module's (a frame's parse was ~5 us).
_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.Decoder().decode


def frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    try:
        head = _ENCODE(header)
    except UnicodeEncodeError:
        # A lone surrogate (a server's error text cut inside an emoji pair) has no UTF-8: replaced, so
        # the frame, often a request's final one, still leaves.
        head = _ENCODE(_replace_surrogates(header))
    return _HEAD.pack(len(head), len(body)) + head + body


def _replace_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_replace_surrogates(v) for v in value]
    return value


def progress_frame(counts: dict[int, int]) -> bytes:
    """One frame with the new tokens of many requests (key, tokens, key, tokens, ...): the reports of a
    flush leave as one frame, not one each (one parse and one read in the parent, however many)."""
    flat: list[int] = []
    for key, n in counts.items():
        flat += (key, n)
    return frame({"p": flat})


class FrameSplitter:
    """Frames from a byte stream in chunks, as many as each chunk completes: one read of the pipe for
    everything the child flushed, not three awaited reads per frame. A bad frame is raised after the good
    ones before it were handed out (on the next feed or the end), so their requests keep their answers."""

    __slots__ = ("_buf", "_error")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._error: Exception | None = None

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        self.check()
        buf = self._buf
        buf += data
        out: list[tuple[dict[str, Any], bytes]] = []
        at, size = 0, len(buf)
        try:
            while size - at >= _HEAD.size:
                head_len, body_len = _sizes(_HEAD.unpack_from(buf, at))
                end = at + _HEAD.size + head_len + body_len
                if end > size:
                    break
                start = at + _HEAD.size
                out.append((_header(buf[start : start + head_len]), bytes(buf[start + head_len : end])))
                at = end
        except (FrameError, ValueError) as err:
            if not out:
                raise
            self._error = err
        del buf[:at]
        return out

    def check(self) -> None:
        """Raise the error of a bad frame found by the last feed, once its good frames were handled (a
        child whose output went bad is not trusted with more requests until it writes again)."""
        if self._error is not None:
            raise self._error

    def end(self) -> None:
        """The input ended: an error when it ended inside a frame (or a bad frame is still to be told)."""
        self.check()
        if self._buf:
            raise FrameError(f"input ended inside a frame ({len(self._buf)} bytes of it)")


class Mailbox:
    """One key's frames from the child, in order, for its one consumer: a deque and at most one waiter
    (asyncio.Queue's bookkeeping is for many producers and consumers; this is on every report). One
    consumer only: a second waiting `get` would take the first one's waiter."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[dict[str, Any]] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: dict[str, Any]) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> dict[str, Any]:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self._items.popleft()


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at a clean end of input (nothing half read)."""
    try:
        prefix = await reader.readexactly(_HEAD.size)
    except asyncio.IncompleteReadError as err:
        if err.partial:
            raise FrameError("input ended inside a frame's length prefix") from err
        return None
    head_len, body_len = _sizes(_HEAD.unpack(prefix))
    head = await reader.readexactly(head_len)
    body = await reader.readexactly(body_len) if body_len else b""
    return _header(head), body


def _sizes(prefix: tuple[int, int]) -> tuple[int, int]:
    """A frame's (header, body) lengths from its prefix, refused above the bounds before any is read."""
    head_len, body_len = prefix
    if head_len > MAX_HEADER or body_len > MAX_BODY:
        raise FrameError(f"frame announces {head_len} + {body_len} bytes, above the bounds")
    return head_len, body_len


def _header(raw: bytes | bytearray) -> dict[str, Any]:
    header = _DECODE(raw)
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header


# ------------------------------------------------------------------------------------ the parent's side


class SenderProcess:
    """The parent's handle on one sender child: start it, hand it requests, read its answers."""

    def __init__(
        self, url: str, headers: dict[str, str], max_connections: int, nice: int = 0, reader: str = "auto"
    ) -> None:
        self._init = {
            "op": "init",
            "url": url,
            "headers": headers,
            "max_connections": max_connections,
            "nice": nice,
            "reader": reader,
        }
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, Mailbox] = {}
        self._next = 0
        self._exited = False
        self.loop_kind = ""
        """The child's event loop ("uvloop" or "asyncio"), from its ready frame."""
        self.nice: int | None = None
        """The child's nice value once started; `nice_error` says why a lower one was refused."""
        self.nice_error = ""
        self.reader = ""
        """Which reader reads the child's streams ("native" or "python"), from its ready frame;
        `reader_note` says why not the native one where it was not taken."""
        self.reader_note = ""
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
                "soakd.engine.sender_child",
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
        nice = got[0].get("nice")
        self.nice = nice if isinstance(nice, int) else None
        self.nice_error = str(got[0].get("nice_error", ""))
        self.reader = str(got[0].get("reader", ""))
        self.reader_note = str(got[0].get("reader_note", ""))
        self._reader = asyncio.create_task(self._read(proc.stdout), name="soakd-sender-reader")

    def submit(self, request: GenerationRequest, body: bytes) -> tuple[int, Mailbox]:
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

    def _post(self, header: dict[str, Any], body: bytes = b"") -> tuple[int, Mailbox]:
        """Write a frame under a fresh key; the child's answers to it arrive on the returned queue."""
        assert self._proc is not None and self._proc.stdin is not None
        self._next += 1
        key = self._next
        queue = self._pending[key] = Mailbox()
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
            splitter = FrameSplitter()
            while data := await reader.read(_READ_BYTES):
                for header, _ in splitter.feed(data):
                    self._take(header)
                splitter.check()
            splitter.end()
        # TypeError: a frame of the wrong shape (a `p` that is not pairs of ints).
        except (FrameError, asyncio.IncompleteReadError, ValueError, TypeError, ConnectionError) as err:
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
                pending.put_nowait({"final": True, "error": {"kind": KIND_SENDER, "message": message}})
            self._pending.clear()

    def _take(self, header: dict[str, Any]) -> None:
        """One frame from the child to its key's mailbox (a key forgotten since is dropped)."""
        flat = header.get("p")
        if flat is not None:
            pending = self._pending
            for i in range(0, len(flat) - 1, 2):
                if (box := pending.get(flat[i])) is not None:
                    box.put_nowait({"n": flat[i + 1]})
        elif (box := self._pending.get(header.get("key", -1))) is not None:
            box.put_nowait(header)

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


class Senders:
    """Several sender processes as one: requests handed out in turn, a child that exited started again
    (each restart logged and counted, its spare connections opened again), all stopped together. One
    that cannot be kept running is soakd's failure, not the engine's (HarnessError)."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        max_connections: int,
        n: int,
        secret_env: str,
        nice: int = 0,
        reader: str = "auto",
    ) -> None:
        self._url, self._headers, self._secret_env, self._nice = url, headers, secret_env, nice
        self._reader_kind = reader
        # The pool's limit (when there is one) shared out: each child holds its part.
        self._limit = -(-max_connections // n) if max_connections else 0
        self.slots: list[SenderProcess] = [self._make() for _ in range(n)]
        self._turn = 0
        self._warm_each = 0  # connections each keeps open ahead of demand (0: none asked)
        self._lock = asyncio.Lock()
        self._restart_times: deque[float] = deque()
        self.restarts = 0

    def _make(self) -> SenderProcess:
        return SenderProcess(self._url, self._headers, self._limit, self._nice, self._reader_kind)

    async def start(self) -> None:
        """Start every child; one failing cancels the others' starts (each stops its child when
        cancelled), and its own error is the one raised."""
        try:
            async with asyncio.TaskGroup() as group:
                for sender in self.slots:
                    group.create_task(sender.start(self._secret_env))
        except BaseExceptionGroup as err:
            raise err.exceptions[0] from None

    async def next(self) -> SenderProcess:
        """The sender for the next request, in turn."""
        slot, self._turn = self._turn % len(self.slots), self._turn + 1
        return await self._live(slot)

    async def _live(self, slot: int) -> SenderProcess:
        if slot < len(self.slots) and self.slots[slot].running:
            return self.slots[slot]  # no lock: one slot's restart holds up no other slot's requests
        async with self._lock:
            if slot >= len(self.slots):
                raise EngineError("engine stopped")
            sender = self.slots[slot]
            if sender.running:
                return sender
            now = time.monotonic()
            while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
                self._restart_times.popleft()
            if len(self._restart_times) >= MAX_RESTARTS:
                raise HarnessError(
                    f"the sender process exited {MAX_RESTARTS + 1} times within {RESTART_WINDOW_S:.0f} s"
                )
            self._restart_times.append(now)
            self.restarts += 1
            await sender.stop()
            fresh = self.slots[slot] = self._make()
            try:
                await fresh.start(self._secret_env)
            except EngineError as err:
                raise HarnessError(str(err)) from err
            warmed = await fresh.warm(self._warm_each) if self._warm_each else 0
            log.warning("sender_restarted", restarts=self.restarts, pid=fresh.pid, warmed=warmed)
            return fresh

    async def warm(self, n: int) -> int:
        """Have the children open `n` connections between them now and keep them open ahead of demand
        for the whole run; how many they opened."""
        self._warm_each = -(-n // len(self.slots))
        live = [await self._live(i) for i in range(len(self.slots))]
        return sum(await asyncio.gather(*(s.warm(self._warm_each) for s in live)))

    async def stop(self) -> None:
        async with self._lock:  # not while a restart is under way: it would outlive the engine
            senders, self.slots = self.slots, []
        await asyncio.gather(*(s.stop() for s in senders))


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
