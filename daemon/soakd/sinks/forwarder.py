"""Ship the spool to a LineWriter from a persisted cursor, so that a database outage loses nothing.

The cursor (segment name, byte offset after the last shipped line) moves only after the writer accepted a
batch, and is saved atomically after every batch: a failed write is retried from the same place (after
an exponential backoff), and a restarted daemon resumes where the last one stopped. A crash between a
write and the cursor save ships that batch twice, which InfluxDB absorbs (a point with the same series
and time is overwritten). The backlog (lines, bytes, age of the oldest line) is kept by counting only
what was appended since the last look, so reporting it every second stays cheap during a long outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from soakd.config import InfluxConfig
from soakd.errors import SinkError, SinkRejected
from soakd.files import read_json_no_follow
from soakd.metric import FieldValue
from soakd.sinks.influx import LineWriter
from soakd.sinks.spool import FILE_MODE, list_segments, open_segment, read_lines

log = structlog.get_logger(__name__)

EventFields = dict[str, float | int | str]
# Batches the database refused (HTTP 400) are kept here, beside the segments, for a person to inspect.
REJECTED_FILE = "rejected.lp"
EventCallback = Callable[[str, EventFields], None]
SleepFn = Callable[[float], Awaitable[None]]

_READ_CHUNK = 1 << 20
# Failures to save the cursor are logged the first time and then every this many.
_LOG_EVERY = 100


@dataclass(frozen=True, slots=True, order=True)
class _Cursor:
    segment: str  # file name; "" before the first segment
    offset: int


@dataclass(frozen=True, slots=True)
class _Batch:
    lines: list[str]
    cursor: _Cursor  # where the cursor goes once these lines are shipped
    newlines: int  # complete lines passed over (empty ones included)
    nbytes: int  # bytes passed over (a skipped torn tail included)
    recount: bool  # a segment was read again from its start: the backlog counts must be redone


class Forwarder:
    """Reads complete lines from the spool directory in batches and ships them through a writer."""

    def __init__(
        self,
        spool_dir: Path,
        writer: LineWriter,
        batch_lines: int,
        state_path: Path | None = None,
        *,
        on_event: EventCallback | None = None,
        sleep: SleepFn = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 10.0,
    ) -> None:
        if batch_lines < 1:
            raise ValueError("batch_lines must be at least 1")
        self.spool_dir = spool_dir
        self.writer = writer
        self.batch_lines = batch_lines
        self.state_path = state_path if state_path is not None else spool_dir / "forwarder.json"
        self.on_event = on_event
        self._sleep = sleep
        self._clock = clock
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.lines_shipped = 0
        self.lines_rejected = 0
        self.batches = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.state_save_failures = 0
        self.last_error = ""
        self.outage_started_ns: int | None = None
        self._outage_started_mono: float | None = None
        self._last_outage_s = 0.0
        self._retry_at = 0.0
        self._cursor = self._load_state()
        # The backlog between the cursor and `_scan` (how far the spool has been counted).
        self._scan = self._cursor
        self._scan_lines = 0
        self._scan_bytes = 0
        self._scan_names: set[str] = set()
        # The time of the first unshipped line, for the cursor it was read at.
        self._age_cursor: _Cursor | None = None
        self._age_time_ns: int | None = None

    # -- public state -------------------------------------------------------------------------------

    @property
    def cursor(self) -> tuple[str, int]:
        """(segment file name, byte offset after the last shipped line)."""
        return self._cursor.segment, self._cursor.offset

    @property
    def outage_s(self) -> float:
        """Seconds the current outage has lasted, or the length of the last one (0.0 if none yet)."""
        if self._outage_started_mono is not None:
            return max(0.0, self._clock() - self._outage_started_mono)
        return self._last_outage_s

    def backlog_bytes(self) -> int:
        """Bytes of the spool not shipped yet (a torn trailing line included)."""
        self._refresh_backlog()
        return self._scan_bytes

    def backlog_lines(self) -> int:
        """Complete lines of the spool not shipped yet."""
        self._refresh_backlog()
        return self._scan_lines

    def backlog_age_s(self, now_ns: int | None = None) -> float:
        """Seconds from the first unshipped line's timestamp to `now_ns` (0.0 with nothing unshipped)."""
        self._refresh_backlog()
        if self._scan_lines == 0:
            return 0.0
        if self._age_cursor != self._cursor:
            batch = self._read_batch(limit=1)
            self._age_time_ns = _line_time_ns(batch.lines[0]) if batch.lines else None
            # With no complete line yet, look again next time instead of remembering "none".
            self._age_cursor = self._cursor if batch.lines else None
        if self._age_time_ns is None:
            return 0.0
        now = time.time_ns() if now_ns is None else now_ns
        return max(0.0, (now - self._age_time_ns) / 1e9)

    def series_fields(self, now_ns: int | None = None) -> dict[str, FieldValue]:
        """The `sink` point: backlog, outage and shipping counters (cheap: see the module docstring)."""
        return {
            "backlog_lines": self.backlog_lines(),
            "backlog_bytes": self._scan_bytes,
            "backlog_age_s": self.backlog_age_s(now_ns),
            "outage_s": self.outage_s,
            "lines_shipped": self.lines_shipped,
            "lines_rejected": self.lines_rejected,
            "batches": self.batches,
            "failures": self.failures,
            "consecutive_failures": self.consecutive_failures,
        }

    # -- shipping -----------------------------------------------------------------------------------

    async def step(self) -> int:
        """Ship up to `batch_lines` lines; returns how many (0 when caught up, when the write failed, or
        while backing off after a failure: the next attempt waits `backoff_initial_s`, doubling up to
        `backoff_max_s`, so a periodic caller does not hammer a database that is down)."""
        if self.consecutive_failures and self._clock() < self._retry_at:
            return 0
        return await self._attempt()

    async def drain(self, timeout_s: float) -> bool:
        """Ship until caught up (True) or until `timeout_s` has passed (False), backing off on failures.

        An attempt in flight when the time runs out is allowed to finish (the writer's timeout bounds it).
        """
        deadline = self._clock() + timeout_s
        while True:
            failures_before = self.failures
            shipped = await self._attempt()
            failed = self.failures > failures_before
            if not failed and shipped == 0 and self._caught_up():
                return True
            remaining = deadline - self._clock()
            if remaining <= 0:
                log.warning(
                    "forwarder_drain_timeout",
                    backlog_lines=self.backlog_lines(),
                    last_error=self.last_error,
                )
                return False
            if failed:
                await self._sleep(min(max(0.0, self._retry_at - self._clock()), remaining))

    # -- internals ----------------------------------------------------------------------------------

    async def _attempt(self) -> int:
        batch = self._read_batch()
        if batch.cursor == self._cursor:
            return 0
        lines = batch.lines
        refused = False
        if lines:
            try:
                await self.writer.write(lines)
            except SinkRejected as err:
                self._set_aside(lines, str(err), batch.cursor)
                refused = True
            except SinkError as err:
                self._record_failure(str(err), len(lines))
                return 0
        recovering = bool(lines) and self.consecutive_failures > 0
        self._advance(batch)
        # A refused batch moved the cursor on (set aside) but was not shipped: counted as rejected only.
        self.lines_shipped += 0 if refused else len(lines)
        self.batches += 1 if lines else 0
        self._save_state()
        if recovering:
            self._record_recovery(len(lines))
        return len(lines)

    def _caught_up(self) -> bool:
        batch = self._read_batch(limit=1)
        return not batch.lines and batch.cursor == self._cursor

    def _pending_segments(self) -> list[Path]:
        return [p for p in list_segments(self.spool_dir) if p.name >= self._cursor.segment]

    def _read_batch(self, limit: int | None = None) -> _Batch:
        """The next complete lines after the cursor and the cursor after them; reads, never moves."""
        want = self.batch_lines if limit is None else limit
        segments = self._pending_segments()
        lines: list[str] = []
        cursor = self._cursor
        newlines = nbytes = 0
        recount = False
        for i, path in enumerate(segments):
            last = i == len(segments) - 1
            offset = cursor.offset if path.name == cursor.segment else 0
            try:
                f = open_segment(path)
            except FileNotFoundError:  # gone since it was listed, or refused
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                if offset > size:
                    # The segment shrank under us (replaced by hand?): re-ship it whole rather than lose it.
                    log.warning("forwarder_cursor_past_end", segment=path.name, offset=offset, size=size)
                    offset = 0
                    recount = True
                f.seek(offset)
                torn = 0
                for raw, length in read_lines(f):
                    if raw is not None and not raw.endswith(b"\n"):
                        torn = length
                        break
                    offset += length
                    nbytes += length
                    newlines += 1
                    if raw is None:
                        # Not soakd's (it writes no line this long): never shipped, never held whole.
                        log.warning("forwarder_skipped_long_line", segment=path.name, bytes=length)
                    elif raw != b"\n":
                        lines.append(raw[:-1].decode("utf-8", errors="replace"))
                    if len(lines) >= want:
                        return _Batch(lines, _Cursor(path.name, offset), newlines, nbytes, recount)
            cursor = _Cursor(path.name, offset)
            if torn and not last:
                # A later segment exists, so this one is final: its torn tail will never be completed.
                log.warning("forwarder_skipped_torn_line", segment=path.name, bytes=torn)
                cursor = _Cursor(path.name, offset + torn)
                nbytes += torn
        return _Batch(lines, cursor, newlines, nbytes, recount)

    def _advance(self, batch: _Batch) -> None:
        self._cursor = batch.cursor
        if batch.recount or self._scan < batch.cursor:
            # Shipped past what was counted (or counted wrongly): count from the new cursor.
            self._reset_scan()
        else:
            self._scan_lines -= batch.newlines
            self._scan_bytes -= batch.nbytes

    def _reset_scan(self) -> None:
        self._scan = self._cursor
        self._scan_lines = 0
        self._scan_bytes = 0
        self._scan_names = set()

    def _refresh_backlog(self) -> None:
        """Count the newlines appended to the spool since the last call (only those bytes are read)."""
        segments = self._pending_segments()
        names = {p.name for p in segments}
        if any(n not in names for n in self._scan_names if n >= self._cursor.segment):
            # A counted segment is gone (deleted by hand): its lines are no longer a backlog.
            log.warning("forwarder_segment_vanished", cursor=self._cursor.segment)
            self._reset_scan()
        if not self._count_from_scan(segments):
            self._reset_scan()
            self._count_from_scan(segments)
        self._scan_names = {n for n in self._scan_names if n >= self._cursor.segment}

    def _count_from_scan(self, segments: list[Path]) -> bool:
        """Advance `_scan` to the end of the spool, counting; False when a counted segment shrank."""
        for path in segments:
            if path.name < self._scan.segment:
                continue
            start = self._scan.offset if path.name == self._scan.segment else 0
            try:
                f = open_segment(path)
            except FileNotFoundError:
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                if size < start:
                    if self._scan != self._cursor:
                        return False
                    start = 0  # the cursor itself is past the end: _read_batch re-reads it whole
                f.seek(start)
                left = size - start
                while left > 0 and (chunk := f.read(min(_READ_CHUNK, left))):
                    self._scan_lines += chunk.count(b"\n")
                    left -= len(chunk)
            self._scan_bytes += size - start
            self._scan = _Cursor(path.name, size)
            self._scan_names.add(path.name)
        return True

    def _set_aside(self, lines: list[str], reason: str, end: _Cursor) -> None:
        """Keep a refused batch on disk (never dropped silently) and let the rest flow on."""
        path = self.spool_dir / REJECTED_FILE
        try:
            _append_file(path, "".join(line + "\n" for line in lines).encode("utf-8"))
            kept_in = str(path)
        except OSError as err:
            # The lines are still in the spool itself (segments are never trimmed): say where.
            cur = self._cursor
            start = f"{cur.segment}:{cur.offset}" if cur.segment else "the first segment"
            kept_in = f"spool, from {start} to {end.segment}:{end.offset}"
            log.error("sink_rejected_not_set_aside", path=str(path), error=str(err), kept_in=kept_in)
        self.lines_rejected += len(lines)
        log.error("sink_rejected_batch", lines=len(lines), reason=reason, kept_in=kept_in)
        self._emit("sink_rejected", {"lines": len(lines), "reason": reason})

    def _record_failure(self, reason: str, batch: int) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error = reason
        # The exponent is capped so a days-long outage cannot overflow the float.
        delay = self.backoff_initial_s * 2 ** min(self.consecutive_failures - 1, 30)
        self._retry_at = self._clock() + min(delay, self.backoff_max_s)
        if self.consecutive_failures > 1:
            log.debug("forwarder_write_failed", reason=reason, consecutive=self.consecutive_failures)
            return
        self.outage_started_ns = time.time_ns()
        self._outage_started_mono = self._clock()
        backlog = self.backlog_lines()
        log.warning("sink_outage", reason=reason, backlog_lines=backlog, batch_lines=batch)
        self._emit("sink_outage", {"backlog_lines": backlog, "outage_s": 0.0, "reason": reason})

    def _record_recovery(self, shipped: int) -> None:
        outage_s = self.outage_s
        failures = self.consecutive_failures
        reason = self.last_error
        self._last_outage_s = outage_s
        self._outage_started_mono = None
        self.outage_started_ns = None
        self.consecutive_failures = 0
        # The backlog the outage left behind, this first batch included.
        backlog = self.backlog_lines() + shipped
        log.info("sink_backfill", outage_s=round(outage_s, 3), failures=failures, backlog_lines=backlog)
        self._emit("sink_backfill", {"backlog_lines": backlog, "outage_s": outage_s, "reason": reason})

    def _emit(self, kind: str, fields: EventFields) -> None:
        if self.on_event is not None:
            self.on_event(kind, fields)

    def _load_state(self) -> _Cursor:
        try:
            data = read_json_no_follow(self.state_path)
        except FileNotFoundError:
            return _Cursor("", 0)
        except (OSError, ValueError) as err:
            # Starting over re-ships points InfluxDB already has (harmless overwrites); guessing loses data.
            log.warning("forwarder_state_unreadable", path=str(self.state_path), error=str(err))
            return _Cursor("", 0)
        segment = data.get("segment") if isinstance(data, dict) else None
        offset = data.get("offset") if isinstance(data, dict) else None
        shipped = data.get("lines_shipped", 0) if isinstance(data, dict) else 0
        if not isinstance(segment, str) or not isinstance(offset, int) or offset < 0:
            log.warning("forwarder_state_invalid", path=str(self.state_path))
            return _Cursor("", 0)
        self.lines_shipped = shipped if isinstance(shipped, int) else 0
        log.info("forwarder_resumed", segment=segment, offset=offset, lines_shipped=self.lines_shipped)
        return _Cursor(segment, offset)

    def _save_state(self) -> None:
        state = {
            "segment": self._cursor.segment,
            "offset": self._cursor.offset,
            "lines_shipped": self.lines_shipped,
        }
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            _write_file(tmp, json.dumps(state).encode("utf-8"))
            tmp.replace(self.state_path)
        except OSError as err:
            # A full disk must not stop shipping: the cursor lives on in memory, and a restart resumes
            # from the last saved one (re-shipping points InfluxDB overwrites).
            self.state_save_failures += 1
            if self.state_save_failures == 1 or self.state_save_failures % _LOG_EVERY == 0:
                log.error(
                    "forwarder_state_not_saved",
                    path=str(self.state_path),
                    error=str(err),
                    failures=self.state_save_failures,
                )


def _line_time_ns(line: str) -> int | None:
    """A line-protocol line's timestamp: its last space-separated token, in nanoseconds."""
    try:
        return int(line.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_file(path: Path, data: bytes) -> None:
    """Create or replace `path` (mode 0600 whatever the umask) with `data`, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _append_file(path: Path, data: bytes) -> None:
    """Append `data` to `path` (mode 0600), fsynced; a failed append is cut back off, whole or nothing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


async def ship_backlog(icfg: InfluxConfig, spool_dir: Path) -> tuple[int, int]:
    """Ship what a finished run's spool still holds (`soakd report --ship`): (lines InfluxDB took,
    lines it refused, kept in the spool's rejected.lp); SinkError when it does not take them in time."""
    from soakd.sinks.influx import make_writer

    writer = make_writer(icfg, os.environ)
    try:
        fwd = Forwarder(spool_dir, writer, icfg.batch_lines)
        before, refused_before = fwd.lines_shipped, fwd.lines_rejected
        if not await fwd.drain(icfg.final_drain_timeout):
            raise SinkError(f"InfluxDB did not take the backlog: {fwd.last_error}")
        return fwd.lines_shipped - before, fwd.lines_rejected - refused_before
    finally:
        await writer.aclose()
