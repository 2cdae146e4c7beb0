"""The sender's native stream reader, driven: streams handed over by engine/h1.py's connections once
their answer's head is read, polled every POLL_S while any is held, each poll's news given to the
stream's sink.

Reading a stream per delta in Python costs a wake-up, a read and the interpreter's work around them for
every network chunk (~19 us of CPU a delta on a 2-core host); the reader in `_reader.c` drains every
ready socket in one call with the interpreter lock released and hands back, per stream, its new tokens
and the kernel's receive stamps of the first and last delta, so a read that waits for the poll moves no
stamp (benchmarks/RESULTS.md, "A native reader"). What it cannot read without a parse (an error event,
vLLM's speculative metrics, a server that sends no running count) it hands back whole, and the sink
parses it as the Python path does. Requests that want token ids, and TLS connections, stay on the
Python path: the first needs every event parsed, the second reads through the TLS layer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

POLL_S = 0.005
"""How often held streams are read. The stamps are the kernel's, so this bounds only when soakd learns
of a token (its progress frames and live counters), never a measured latency; at 10 ms the CPU per token
fell no further on a 2-core host."""

try:
    from soakd.engine import _reader  # type: ignore[attr-defined]

    UNAVAILABLE = ""
except ImportError as err:  # not built (no C compiler at install, or not Linux)
    _reader = None
    UNAVAILABLE = f"not built ({err})"[:200]


class NativeSink(Protocol):
    """A stream's receiver on the native path; every call comes from the poll, on the event loop."""

    def on_native_tokens(self, seen: int, events: int, first: float, last: float) -> None:
        """`events` deltas whose running count ends at `seen`, the first and last stamped `first` and
        `last` (time.monotonic's clock)."""

    def on_native_event(self, raw: bytes, stamp: float) -> None:
        """An event the reader could not read alone (bytes as sent, its blank line included); may end
        the request (an error event)."""

    def on_native_failure(self, err: Exception) -> None:
        """Reading the answer failed in soakd itself (an event its parse could not take)."""


class NativeConnection(Protocol):
    """What the poll needs of a connection it reads for (engine/h1.py's Connection)."""

    @property
    def native_held(self) -> bool:
        """Whether the native path still owns the answer (an abort takes it back)."""

    def native_end(self, reusable: bool) -> None: ...

    def native_error(self, why: str) -> None: ...


_Handed = tuple[float, int, bytes, int, int, float, float]
"""An event for Python: (stamp, the running count before it, its bytes, and the tokens, deltas, first
and last stamps of what the reader counted since the previous one)."""
_News = tuple[int, int, int, float, float, int, list[_Handed] | None, str | None, int]
"""One stream's news from a poll: (fd, tokens, deltas, first stamp, last stamp, end, handed, why, the
running count)."""


def available() -> bool:
    return _reader is not None


class NativeStreams:
    """The reader and the streams it holds, keyed by socket fd; the poll is scheduled only while one
    is held, so an idle sender is not woken."""

    def __init__(self, after: Callable[[], None] | None = None, report_s: float = 0.0) -> None:
        """`after`: called at the end of every poll (the sender flushes the frames the poll wrote);
        `report_s`: a stream's tokens are handed out at most this often (its first at once, its last
        at its end), the deltas between summed in C, so Python runs per report, not per delta."""
        if _reader is None:
            raise RuntimeError(f"the native stream reader is {UNAVAILABLE}")
        self._reader = _reader.Reader(report_s=report_s)
        self._held: dict[int, tuple[NativeConnection, NativeSink]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._after = after
        self.polling = False
        """True while a poll hands out its news (what is written then can wait for its end)."""

    def __len__(self) -> int:
        return len(self._held)

    @property
    def counted(self) -> int:
        """Events with new tokens read so far."""
        return int(self._reader.counted)

    @property
    def unstamped(self) -> int:
        """Reads the kernel gave no receive stamp (its stamps switched on a moment after the first
        socket asks): stamped when read."""
        return int(self._reader.unstamped)

    @property
    def merged(self) -> int:
        """Of them, those read in one read with a later one, so stamped with that one's arrival."""
        return int(self._reader.merged)

    def add(self, conn: NativeConnection, sink: NativeSink, fd: int, rest: bytes) -> None:
        """Read `fd`'s chunked event stream from here on; `rest`: the body's bytes already read."""
        self._reader.add(fd, fd, rest)
        self._held[fd] = (conn, sink)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(POLL_S, self.poll)

    def remove(self, fd: int) -> None:
        """Forget a stream (its request aborted) before its socket closes."""
        if self._held.pop(fd, None) is not None:
            self._reader.remove(fd)

    def poll(self) -> None:
        self._timer = None
        self.polling = True
        try:
            for news in self._reader.poll():
                try:
                    self._hand_out(news)
                # A bug in one stream's ending must not lose the others' news (the reader let go of it).
                except Exception as err:  # noqa: BLE001
                    log.error("native_news_failed", error=f"{type(err).__name__}: {err}"[:200])
        finally:
            self.polling = False
            if self._held:
                self._timer = asyncio.get_running_loop().call_later(POLL_S, self.poll)
            if self._after is not None:
                self._after()

    def _hand_out(self, news: _News) -> None:
        fd, _, events, first, last, end, handed, why, seen = news
        held = self._held.get(fd)
        if held is None:
            return
        conn, sink = held
        if end:
            del self._held[fd]  # the reader let go of it
        try:
            for stamp, before_seen, raw, _, before_events, before_first, before_last in handed or ():
                if before_events:
                    sink.on_native_tokens(before_seen, before_events, before_first, before_last)
                sink.on_native_event(raw, stamp)
                if not conn.native_held:
                    return  # an error event: the request failed, its connection aborted
            if events:
                sink.on_native_tokens(seen, events, first, last)
            if end > 0:
                conn.native_end(end == 1)  # 2: bytes after the answer's end, not reused
            elif end < 0:
                conn.native_error(why or "the stream failed")
        # One stream's trouble stays its own (as a failed read callback closes only its transport on
        # the Python path): it fails and is taken out of the reader, the others' news is handed out.
        except Exception as err:  # noqa: BLE001
            sink.on_native_failure(err)
            if conn.native_held:
                conn.native_error(f"{type(err).__name__}: {err}"[:200])
            self.remove(fd)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
