"""Ship the spool to a LineWriter from a persisted cursor, so that a database outage loses nothing.

The cursor (segment name, byte offset after the last shipped line) moves only after the writer accepted a
batch, and is saved atomically after every batch: a failed write is retried from the same place, and a
restarted daemon resumes where the last one stopped. A crash between a write and the cursor save ships
that batch twice, which InfluxDB absorbs (a point with the same series and time is overwritten).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from soakd.errors import SinkError, SinkRejected
from soakd.sinks.influx import LineWriter
from soakd.sinks.spool import list_segments

log = structlog.get_logger(__name__)

EventFields = dict[str, float | int | str]
# Batches the database refused (HTTP 400) are kept here, beside the segments, for a person to inspect.
REJECTED_FILE = "rejected.lp"
EventCallback = Callable[[str, EventFields], None]
SleepFn = Callable[[float], Awaitable[None]]

_COUNT_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class _Cursor:
    segment: str  # file name; "" before the first segment
    offset: int


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
        self.last_error = ""
        self.outage_started_ns: int | None = None
        self._outage_started_mono: float | None = None
        self._last_outage_s = 0.0
        # Newline counts of final segments (they never change), for backlog_lines().
        self._final_counts: dict[str, int] = {}
        self._cursor = self._load_state()

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
        total = 0
        for path in self._pending_segments():
            size = _size(path)
            total += max(0, size - self._cursor.offset) if path.name == self._cursor.segment else size
        return total

    def backlog_lines(self) -> int:
        """Complete lines of the spool not shipped yet."""
        segments = self._pending_segments()
        total = 0
        for i, path in enumerate(segments):
            start = self._cursor.offset if path.name == self._cursor.segment else 0
            final = i < len(segments) - 1
            if final and start == 0 and path.name in self._final_counts:
                total += self._final_counts[path.name]
                continue
            count = _count_newlines(path, start)
            if final and start == 0:
                self._final_counts[path.name] = count
            total += count
        return total

    # -- shipping -----------------------------------------------------------------------------------

    async def step(self) -> int:
        """Ship up to `batch_lines` lines; returns how many (0 when caught up or when the write failed)."""
        lines, cursor = self._read_batch()
        if cursor == self._cursor:
            return 0
        if lines:
            try:
                await self.writer.write(lines)
            except SinkRejected as err:
                self._set_aside(lines, str(err))
            except SinkError as err:
                self._record_failure(str(err), len(lines))
                return 0
        recovering = bool(lines) and self.consecutive_failures > 0
        self._cursor = cursor
        self.lines_shipped += len(lines)
        self.batches += 1 if lines else 0
        self._save_state()
        if recovering:
            self._record_recovery(len(lines))
        return len(lines)

    async def drain(self, timeout_s: float) -> bool:
        """Ship until caught up (True) or until `timeout_s` has passed (False), backing off on failures.

        An attempt in flight when the time runs out is allowed to finish (the writer's timeout bounds it).
        """
        deadline = self._clock() + timeout_s
        backoff = self.backoff_initial_s
        while True:
            failures_before = self.failures
            shipped = await self.step()
            failed = self.failures > failures_before
            if not failed:
                backoff = self.backoff_initial_s
                if shipped == 0 and self._caught_up():
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
                await self._sleep(min(backoff, remaining))
                backoff = min(backoff * 2, self.backoff_max_s)

    # -- internals ----------------------------------------------------------------------------------

    def _caught_up(self) -> bool:
        lines, cursor = self._read_batch(limit=1)
        return not lines and cursor == self._cursor

    def _pending_segments(self) -> list[Path]:
        return [p for p in list_segments(self.spool_dir) if p.name >= self._cursor.segment]

    def _read_batch(self, limit: int | None = None) -> tuple[list[str], _Cursor]:
        """The next complete lines after the cursor and the cursor after them; reads, never moves."""
        want = self.batch_lines if limit is None else limit
        segments = self._pending_segments()
        lines: list[str] = []
        cursor = self._cursor
        for i, path in enumerate(segments):
            last = i == len(segments) - 1
            offset = cursor.offset if path.name == cursor.segment else 0
            try:
                f = path.open("rb")
            except FileNotFoundError:
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                if offset > size:
                    # The segment shrank under us (replaced by hand?): re-ship it whole rather than lose it.
                    log.warning("forwarder_cursor_past_end", segment=path.name, offset=offset, size=size)
                    offset = 0
                f.seek(offset)
                torn = b""
                for raw in f:
                    if not raw.endswith(b"\n"):
                        torn = raw
                        break
                    offset += len(raw)
                    if raw != b"\n":
                        lines.append(raw[:-1].decode("utf-8", errors="replace"))
                    if len(lines) >= want:
                        return lines, _Cursor(path.name, offset)
            cursor = _Cursor(path.name, offset)
            if torn and not last:
                # A later segment exists, so this one is final: its torn tail will never be completed.
                log.warning("forwarder_skipped_torn_line", segment=path.name, bytes=len(torn))
                cursor = _Cursor(path.name, offset + len(torn))
        return lines, cursor

    def _set_aside(self, lines: list[str], reason: str) -> None:
        """Keep a refused batch on disk (never dropped silently) and let the rest flow on."""
        path = self.spool_dir / REJECTED_FILE
        with path.open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
        self.lines_rejected += len(lines)
        log.error("sink_rejected_batch", lines=len(lines), reason=reason, kept_in=str(path))
        self._emit("sink_rejected", {"lines": len(lines), "reason": reason})

    def _record_failure(self, reason: str, batch: int) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error = reason
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
            data = json.loads(self.state_path.read_text(encoding="utf-8"))
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
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.state_path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _count_newlines(path: Path, start: int) -> int:
    count = 0
    try:
        with path.open("rb") as f:
            f.seek(start)
            while chunk := f.read(_COUNT_CHUNK):
                count += chunk.count(b"\n")
    except FileNotFoundError:
        return 0
    return count
