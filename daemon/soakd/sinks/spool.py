"""The durable local spool: append-only line-protocol segments that every sample reaches first.

Layout: `seg-00000001.lp`, `seg-00000002.lp`, ... in one directory (mode 0700, segments 0600), one point
per line, each segment at most `segment_bytes` long (unless one line alone is longer) and holding only
complete lines. Segments are never rewritten: a reopened spool starts a new segment after the highest
one, and a segment is final once a later one exists, which is what lets the forwarder and `soakd report`
read them while they are written.

The spool is bounded and never raises on a full disk; it degrades instead (state "ok" -> "essential" ->
"full", see `Spool`), counts every line it drops per measurement, and says so through `on_event` and
the log.

Over 500 lines because the writer, the segment readers and the degrade/recover states share one on-disk
format that must change in one place.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

import structlog

from soakd.metric import FieldValue, Sample, parse_line

log = structlog.get_logger(__name__)

SEGMENT_RE = re.compile(r"^seg-(\d{8})\.lp$")
# Same escaping as Sample.to_line applies to a measurement name.
_MEAS_ESC = str.maketrans({",": r"\,", " ": r"\ ", "\n": r"\n", "\\": r"\\"})

DIR_MODE = 0o700
FILE_MODE = 0o600

SpoolState = Literal["ok", "essential", "full"]
# The integer form written as the `spool` series' `state` field (a string field cannot be graphed).
STATE_CODES: dict[SpoolState, int] = {"ok": 0, "essential": 1, "full": 2}

# What a degraded spool still writes: the per-request records the verdict is judged on (`soakd report`
# reads them back from the spool), what soakd saw and did (events, control, throttle), the run's closing
# record, and the sinks' own health, so that the degradation itself stays on record. Everything else is
# periodic telemetry, where a gap thins a graph but loses no outcome.
ESSENTIAL_MEASUREMENTS = frozenset(
    {"requests", "events", "run", "control", "throttle", "sink", "spool", "webhook"}
)

# Free space is read with statvfs at most this often, or sooner once this much was written since.
SPACE_CHECK_INTERVAL_S = 1.0
_SPACE_CHECK_BYTES = 1 << 20
# A full spool tries to write again only with at least this much free to it (statvfs cannot see quotas,
# so an EDQUOT spool simply tries once per check interval).
_RESUME_FREE_BYTES = 1 << 20
# Leaving "essential" for lack of free space needs a little more than `min_free_bytes`, so a disk
# hovering at the threshold does not flap between states (and events) on every check.
_FREE_HYSTERESIS_BYTES = 1 << 20
# While degraded, the log repeats the drop counts this often (the series may be dropped with the rest).
_STILL_DEGRADED_LOG_S = 60.0
# Events raised while emitting events are sent on the same call up to this many; the rest wait for the
# next write, so an event that itself changes the state cannot recurse without bound.
_MAX_EVENTS_PER_WRITE = 8
_TAIL_PROBE = 1 << 16
MAX_LINE_BYTES = 1 << 20
"""The longest line a reader takes: soakd writes none above a few kB (an event's message is capped), so
a longer one is not soakd's; it is skipped with a warning, never held in memory whole."""
_REFUSED_WARNED: set[str] = set()

EventFields = dict[str, FieldValue]
EventCallback = Callable[[str, EventFields], None]
WriteFn = Callable[[int, memoryview], int]


def segment_name(index: int) -> str:
    """The file name of segment number `index` (1-based)."""
    return f"seg-{index:08d}.lp"


def segment_index(path: Path) -> int:
    """The number of a segment file (ValueError when the name is not a segment's)."""
    match = SEGMENT_RE.match(path.name)
    if match is None:
        raise ValueError(f"not a spool segment: {path.name}")
    return int(match.group(1))


class SegmentRefused(FileNotFoundError):
    """A segment name that is not a regular file of its own (a symlink, FIFO, device, folder): readers
    treat it as absent, so nothing soakd did not write is read, shipped or copied."""


def list_segments(directory: Path) -> list[Path]:
    """The segment files of a spool directory, oldest first (an absent directory has none). Only
    regular files count: anything else under a segment's name is refused with one warning."""
    try:
        entries = [e for e in os.scandir(directory) if SEGMENT_RE.match(e.name)]
    except FileNotFoundError:
        return []
    names = []
    for entry in entries:
        try:
            regular = entry.is_file(follow_symlinks=False)
        except OSError:
            regular = False
        if regular:
            names.append(entry.name)
        else:
            _warn_refused(directory / entry.name, "not a regular file (a symlink, FIFO, device or folder)")
    # Zero-padded numbers: name order is numeric order.
    return [directory / name for name in sorted(names)]


def _warn_refused(path: Path, why: str) -> None:
    key = str(path)
    if key not in _REFUSED_WARNED and len(_REFUSED_WARNED) < 10_000:
        _REFUSED_WARNED.add(key)
        log.warning("spool_segment_refused", segment=key, reason=why)


def open_segment(path: Path) -> BinaryIO:
    """Open a segment for reading: never through a symlink, never blocking on a FIFO, regular files only
    (the check is on the opened file, so a swap after `list_segments` is caught too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            _warn_refused(path, "a symlink")
            raise SegmentRefused(errno.ENOENT, "refused: a symlink", str(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _warn_refused(path, "not a regular file")
            raise SegmentRefused(errno.ENOENT, "refused: not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_lines(f: BinaryIO) -> Iterator[tuple[bytes | None, int]]:
    """(line with its newline, bytes) from the file's position on, each line read with a bounded buffer.
    A line over MAX_LINE_BYTES comes as (None, its bytes) after being skipped in chunks; a last line
    without a newline (torn) comes as it is and ends the iteration."""
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw, len(raw)
            if not raw.endswith(b"\n"):
                return
            continue
        skipped = len(raw)
        while True:
            chunk = f.readline(MAX_LINE_BYTES)
            skipped += len(chunk)
            if not chunk:
                yield b"", skipped  # an overlong torn tail: nothing whole to give
                return
            if chunk.endswith(b"\n"):
                break
        yield None, skipped


def torn_tail_bytes(path: Path) -> int:
    """Bytes after the last newline of a file (a line torn by a crash); 0 when it ends on a whole line."""
    with open_segment(path) as f:
        size = os.fstat(f.fileno()).st_size
        end = size
        while end > 0:
            start = max(0, end - _TAIL_PROBE)
            f.seek(start)
            chunk = f.read(end - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                return size - (start + newline + 1)
            end = start
        return size


def fs_space(directory: Path) -> tuple[int, int]:
    """Free bytes on the filesystem holding `directory`: for an unprivileged process, and for this one
    (root may also write into the blocks reserved for it)."""
    st = os.statvfs(directory)
    available = st.f_bavail * st.f_frsize
    return available, st.f_bfree * st.f_frsize if os.geteuid() == 0 else available


def _fsync_dir(directory: Path) -> None:
    # A new file's directory entry is durable only once the directory itself is synced.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(err: OSError) -> str:
    name = errno.errorcode.get(err.errno or 0, "")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return name
    return f"{name or type(err).__name__}: {err.strerror or err}"[:200]


class Spool:
    """Appends samples to the current segment; rotates by size; fsyncs at most every `fsync_interval_s`.

    Every `write()` hands its lines to the OS before returning (one write system call per batch and
    segment), so a crash of the daemon loses nothing that was written; fsync bounds what a power loss can
    take to the last `fsync_interval_s`. Synchronous and cheap enough to call from the event loop.

    Degradation, never an exception (`state`):
      "ok"         everything is written.
      "essential"  the spool holds `max_bytes` (0: no bound) or the filesystem has less than
                   `min_free_bytes` free: only ESSENTIAL_MEASUREMENTS are written, the rest is dropped.
      "full"       a write failed (ENOSPC, EDQUOT, or another OSError): nothing is written; the failed
                   batch is cut back off the segment so no torn line is left, and a write is tried
                   again once per check interval while statvfs shows room.
    Every dropped line is counted per measurement (`dropped`); each state change is logged and passed
    to `on_event` ("spool_degraded", "spool_recovered"). The state returns to "ok" by itself once space
    does (the bound is re-read from the segments on disk while degraded, so deleting files counts).
    """

    def __init__(
        self,
        directory: Path,
        segment_bytes: int,
        fsync_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_bytes: int = 0,
        min_free_bytes: int = 0,
        on_event: EventCallback | None = None,
        write_fn: WriteFn = os.write,
        space_check_interval_s: float = SPACE_CHECK_INTERVAL_S,
    ) -> None:
        if segment_bytes <= 0:
            raise ValueError("segment_bytes must be positive")
        if max_bytes < 0 or min_free_bytes < 0:
            raise ValueError("max_bytes and min_free_bytes cannot be negative")
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.fsync_interval_s = fsync_interval_s
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.space_check_interval_s = space_check_interval_s
        # Assignable after construction: the app's event writer needs the spool to exist first.
        self.on_event = on_event
        self._clock = clock
        self._write_fn = write_fn
        self.lines_written = 0
        self.bytes_written = 0
        self.segments_created = 0
        self.fsyncs = 0
        self.state: SpoolState = "ok"
        self.reason = ""
        self.dropped: dict[str, int] = {}
        self.free_bytes: int | None = None
        self._episode_dropped: dict[str, int] = {}
        self._degraded_since: float | None = None
        self._pending_events: list[tuple[str, EventFields]] = []
        self._emitting = False
        self._last_check = float("-inf")
        self._bytes_since_check = 0
        self._last_still_log = 0.0
        self._closed = False
        self.background_fsync = False
        """True: write() leaves the periodic fsync to `sync_off_loop()`, which a job awaits, so the
        event loop never waits on the disk; rotation and close still fsync inline (their ordering)."""

        directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        # mkdir's mode is filtered by the umask, and an existing directory keeps its own: set it outright.
        try:
            directory.chmod(DIR_MODE)
        except PermissionError as err:
            log.warning("spool_dir_mode_not_set", directory=str(directory), error=_reason(err))
        existing = list_segments(directory)
        self.total_bytes = sum(p.stat().st_size for p in existing)
        self._segments = len(existing)
        self._index = segment_index(existing[-1]) if existing else 0
        if existing:
            self._report_torn_tail(existing[-1])
        self._fd: int | None = None
        self._size = 0
        self._dirty = False
        self._last_fsync = clock()
        try:
            self._open_next()
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # No room for even an empty segment: start full and create it once space returns.
            self._set_state("full", _reason(err))
        log.info(
            "spool_opened", directory=str(directory), segment=self.current_segment.name, state=self.state
        )

    # -- public state -------------------------------------------------------------------------------

    @property
    def current_segment(self) -> Path:
        """The segment being appended to (the last one opened)."""
        return self.directory / segment_name(self._index)

    @property
    def segment_count(self) -> int:
        """Segments in the directory: those found at open plus those created since."""
        return self._segments

    @property
    def closed(self) -> bool:
        return self._closed

    def segments(self) -> list[Path]:
        """Every segment of this spool, oldest first."""
        return list_segments(self.directory)

    def series_fields(self) -> dict[str, FieldValue]:
        """The `spool` point: size, state and what was dropped (per measurement as `dropped_<name>`)."""
        fields: dict[str, FieldValue] = {
            "bytes": self.total_bytes,
            "segments": self._segments,
            "lines_written": self.lines_written,
            "state": STATE_CODES[self.state],
            "state_name": self.state,
            "free_bytes": -1 if self.free_bytes is None else self.free_bytes,
            "dropped_total": sum(self.dropped.values()),
        }
        for measurement, n in sorted(self.dropped.items()):
            fields[f"dropped_{measurement}"] = n
        return fields

    # -- writing ------------------------------------------------------------------------------------

    def write(self, samples: Iterable[Sample]) -> int:
        """Append the samples' lines (samples with nothing to write are skipped); returns lines written.

        Never raises OSError: what cannot be written is dropped, counted and reported (see the class).
        """
        if self._closed:
            raise ValueError("spool is closed")
        batch: list[tuple[str, bytes]] = []
        for sample in samples:
            line = sample.to_line()
            if line is not None:
                batch.append((sample.measurement, (line + "\n").encode("utf-8")))
        written = self._write_batch(batch) if batch else 0
        self._emit_pending()
        return written

    def flush(self, fsync: bool = True) -> None:
        """Make written data durable (`write` already handed it to the OS: without `fsync`, a no-op)."""
        if self._closed:
            raise ValueError("spool is closed")
        if fsync and self._dirty and self._fd is not None:
            self._fsync_or_degrade()
        self._emit_pending()

    def close(self) -> None:
        """Fsync and close the current segment. Closing twice is harmless."""
        if self._closed:
            return
        if self._dirty and self._fd is not None:
            self._fsync_or_degrade()
        self._emit_pending()
        self._close_fd()
        self._closed = True
        done = log.warning if self.dropped else log.info
        done(
            "spool_closed",
            segment=self.current_segment.name,
            lines_written=self.lines_written,
            fsyncs=self.fsyncs,
            state=self.state,
            dropped_total=sum(self.dropped.values()),
            dropped=dict(sorted(self.dropped.items())),
        )

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------

    def _write_batch(self, batch: list[tuple[str, bytes]]) -> int:
        now = self._clock()
        probing = False
        if now - self._last_check >= self.space_check_interval_s or (
            self._bytes_since_check >= _SPACE_CHECK_BYTES
        ):
            probing = self._check_space(now)
        target = self._target_state()
        if self.state == "full" and not probing:
            self._drop(batch)
            return 0
        if self.state not in ("full", target):
            self._set_state(target, self._target_reason())
        if target == "essential":
            keep = [item for item in batch if item[0] in ESSENTIAL_MEASUREMENTS]
            if len(keep) < len(batch):
                self._drop([item for item in batch if item[0] not in ESSENTIAL_MEASUREMENTS])
            batch = keep
        written = self._append_all(batch)
        if self.state == "full" and batch and written == len(batch):
            # The probe went through: space is back.
            self._set_state(target, self._target_reason())
        due = self._clock() - self._last_fsync >= self.fsync_interval_s
        if written and due and not self.background_fsync:
            self._fsync_or_degrade()
        return written

    def _append_all(self, batch: list[tuple[str, bytes]]) -> int:
        """Write the batch in one chunk per segment; on a failure drop (and count) what is left."""
        written = 0
        chunk: list[tuple[str, bytes]] = []
        chunk_size = 0
        for i, item in enumerate(batch):
            size = len(item[1])
            # Rotate before a line would overflow the segment; an empty segment takes any line, so a
            # single oversized line gets a segment of its own instead of looping.
            if self._size + chunk_size > 0 and self._size + chunk_size + size > self.segment_bytes:
                if chunk and not self._append(chunk, chunk_size):
                    self._drop(batch[i:])
                    return written
                written += len(chunk)
                chunk, chunk_size = [], 0
                if not self._rotate():
                    self._drop(batch[i:])
                    return written
            chunk.append(item)
            chunk_size += size
        if chunk and self._append(chunk, chunk_size):
            written += len(chunk)
        return written

    def _append(self, chunk: list[tuple[str, bytes]], size: int) -> bool:
        """One segment's part of a batch, whole or not at all (a failed write is cut back off)."""
        if self._fd is None and not self._reopen():
            self._drop(chunk)
            return False
        fd = self._fd
        assert fd is not None
        data = memoryview(b"".join(line for _, line in chunk))
        done = 0
        try:
            while done < size:
                n = self._write_fn(fd, data[done:])
                if n <= 0:
                    raise OSError(errno.EIO, "write wrote nothing")
                done += n
        except OSError as err:
            self._cut_back(fd, done)
            self._drop(chunk)
            self._set_state("full", _reason(err))
            return False
        self._size += size
        self.total_bytes += size
        self.bytes_written += size
        self._bytes_since_check += size
        self.lines_written += len(chunk)
        self._dirty = True
        return True

    def _cut_back(self, fd: int, written: int) -> None:
        """Remove a failed write's partial bytes, so no torn line sits before the next write."""
        if written == 0:
            return
        try:
            # O_APPEND: the next write goes to the new end, not after a hole.
            os.ftruncate(fd, self._size)
        except OSError as err:
            # The tail stays torn: close the segment, so it becomes final (readers skip a final
            # segment's torn tail) and the next write starts a new one.
            log.error(
                "spool_truncate_failed",
                segment=self.current_segment.name,
                torn_bytes=written,
                error=_reason(err),
            )
            self.total_bytes += written
            self._close_fd()

    def _rotate(self) -> bool:
        # The old segment is complete and durable before the next one appears: readers treat any
        # segment followed by a later one as final.
        if self._dirty and not self._fsync_or_degrade():
            return False
        self._close_fd()
        return self._reopen()

    def _reopen(self) -> bool:
        try:
            self._open_next()
        except OSError as err:
            self._set_state("full", _reason(err))
            return False
        return True

    def _open_next(self) -> None:
        path = self.directory / segment_name(self._index + 1)
        # O_EXCL: never append to or truncate a segment someone else left behind. O_APPEND: after a
        # failed write is truncated away, the next one lands at the new end.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        fd = os.open(path, flags, FILE_MODE)
        self._index += 1
        self._fd = fd
        self._size = 0
        self._dirty = False
        self.segments_created += 1
        self._segments += 1
        os.fchmod(fd, FILE_MODE)  # the umask filtered the mode os.open applied
        _fsync_dir(self.directory)

    def _close_fd(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # Whatever follows goes to a new segment: nothing of this one is left to sync or to fill.
        self._dirty = False
        self._size = 0
        try:
            os.close(fd)
        except OSError as err:
            log.error("spool_close_failed", segment=self.current_segment.name, error=_reason(err))

    def _fsync_or_degrade(self) -> bool:
        fd = self._fd
        if fd is None:
            return False
        try:
            os.fsync(fd)
        except OSError as err:
            self._fsync_failed(err)
            return False
        self.fsyncs += 1
        self._dirty = False
        self._last_fsync = self._clock()
        return True

    def _fsync_failed(self, err: OSError) -> None:
        # After a failed fsync the kernel may have dropped those pages: which lines are durable is
        # unknown, so say where, and leave this segment for a new one once writes work again.
        log.error(
            "spool_fsync_failed",
            segment=self.current_segment.name,
            error=_reason(err),
            hint="lines written since the last fsync may not survive a power loss",
        )
        self._close_fd()
        self._set_state("full", "fsync " + _reason(err))

    async def sync_off_loop(self) -> None:
        """The periodic fsync with its system call in a worker thread, on a duplicate descriptor (a
        rotation or close meanwhile is harmless); a failure is handled here, on the loop, as an inline
        one is. Lines written while it ran stay dirty for the next one."""
        if self._closed or not self._dirty or self._fd is None:
            self._emit_pending()
            return
        fd = os.dup(self._fd)
        mark, started = self.bytes_written, self._clock()
        try:
            await asyncio.to_thread(os.fsync, fd)
        except OSError as err:
            if not self._closed:
                self._fsync_failed(err)
        else:
            self.fsyncs += 1
            self._last_fsync = started
            if self.bytes_written == mark:
                self._dirty = False
        finally:
            os.close(fd)
        if not self._closed:
            self._emit_pending()

    def _check_space(self, now: float) -> bool:
        """Read free space (and, while degraded, the spool's size on disk); True when a full spool
        should try writing again."""
        self._last_check = now
        self._bytes_since_check = 0
        own: int | None = None
        try:
            # min_free_bytes is kept for everyone, so it is judged on what an unprivileged process sees.
            self.free_bytes, own = fs_space(self.directory)
        except OSError as err:
            log.warning("spool_statvfs_failed", directory=str(self.directory), error=_reason(err))
            self.free_bytes = None
        if self.state != "ok":
            # Segments deleted by hand to make room count at once.
            on_disk = list_segments(self.directory)
            self.total_bytes = sum(_size(p) for p in on_disk)
            self._segments = len(on_disk)
            if now - self._last_still_log >= _STILL_DEGRADED_LOG_S:
                self._last_still_log = now
                log.warning(
                    "spool_still_degraded",
                    state=self.state,
                    reason=self.reason,
                    bytes=self.total_bytes,
                    free_bytes=self.free_bytes,
                    dropped=dict(sorted(self._episode_dropped.items())),
                )
        return self.state == "full" and (own is None or own >= _RESUME_FREE_BYTES)

    def _target_state(self) -> SpoolState:
        """ "essential" or "ok", from the bound and the last free-space reading."""
        if self.max_bytes and self.total_bytes >= self.max_bytes:
            return "essential"
        if self.min_free_bytes and self.free_bytes is not None:
            # Already short of space: stay so until a little more than the threshold is free.
            margin = _FREE_HYSTERESIS_BYTES if self.state != "ok" else 0
            if self.free_bytes < self.min_free_bytes + margin:
                return "essential"
        return "ok"

    def _target_reason(self) -> str:
        if self.max_bytes and self.total_bytes >= self.max_bytes:
            return "max_bytes"
        if self._target_state() == "essential":
            return "min_free_bytes"
        return ""

    def _drop(self, items: list[tuple[str, bytes]]) -> None:
        for measurement, _ in items:
            self.dropped[measurement] = self.dropped.get(measurement, 0) + 1
            self._episode_dropped[measurement] = self._episode_dropped.get(measurement, 0) + 1

    def _set_state(self, state: SpoolState, reason: str) -> None:
        if state == self.state and (state != "full" or reason == self.reason):
            return
        before = self.state
        self.state = state
        self.reason = reason
        free = -1 if self.free_bytes is None else self.free_bytes
        if state == "ok":
            degraded_s = 0.0 if self._degraded_since is None else self._clock() - self._degraded_since
            fields: EventFields = {
                "state": state,
                "was": before,
                "degraded_s": round(degraded_s, 3),
                "bytes": self.total_bytes,
                "free_bytes": free,
                "dropped_total": sum(self._episode_dropped.values()),
            }
            for measurement, n in sorted(self._episode_dropped.items()):
                fields[f"dropped_{measurement}"] = n
            log.warning("spool_recovered", **fields)
            self._episode_dropped = {}
            self._degraded_since = None
            self._pending_events.append(("spool_recovered", fields))
            return
        if self._degraded_since is None:
            self._degraded_since = self._clock()
            self._last_still_log = self._degraded_since
        fields = {
            "state": state,
            "was": before,
            "reason": reason,
            "bytes": self.total_bytes,
            "free_bytes": free,
            "max_bytes": self.max_bytes,
            "min_free_bytes": self.min_free_bytes,
        }
        if state == "full":
            log.error("spool_degraded", **fields, writes="none until space returns")
        else:
            log.warning("spool_degraded", **fields, writes=", ".join(sorted(ESSENTIAL_MEASUREMENTS)))
        self._pending_events.append(("spool_degraded", fields))

    def _emit_pending(self) -> None:
        # The callback usually writes an `events` point into this very spool: a nested write() queues
        # its own state changes here instead of calling back again, and this loop sends them, bounded.
        if self._emitting or not self._pending_events:
            return
        self._emitting = True
        try:
            for _ in range(_MAX_EVENTS_PER_WRITE):
                if not self._pending_events:
                    break
                kind, fields = self._pending_events.pop(0)
                if self.on_event is None:
                    continue
                try:
                    self.on_event(kind, fields)
                # A failing listener must not turn a degraded spool into a crashed daemon.
                except Exception as err:  # noqa: BLE001
                    log.error("spool_event_failed", kind=kind, error=f"{type(err).__name__}: {err}"[:200])
        finally:
            self._emitting = False

    def _report_torn_tail(self, path: Path) -> None:
        try:
            torn = torn_tail_bytes(path)
        except OSError as err:
            log.warning("spool_segment_unreadable", segment=path.name, error=_reason(err))
            return
        if torn:
            # A daemon killed mid-write: the whole lines before it are kept (readers stop at the last
            # newline of a segment, and this one is final now that a new segment follows it).
            log.warning(
                "spool_torn_tail",
                segment=path.name,
                bytes=torn,
                kept_bytes=_size(path) - torn,
            )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def iter_numbered_lines(directory: Path) -> Iterator[tuple[Path, int, str]]:
    """(segment, 1-based line number, line) for every complete line of every segment, in write order.

    A last line without its newline (torn by a crash, or still being written) is skipped.
    """
    for path in list_segments(directory):
        try:
            f = open_segment(path)
        except FileNotFoundError:  # gone since it was listed, or refused
            continue
        with f:
            for number, (raw, size) in enumerate(read_lines(f), start=1):
                if raw is None:
                    log.warning("spool_line_too_long", segment=str(path), line=number, bytes=size)
                    continue
                if not raw.endswith(b"\n"):
                    break
                if raw == b"\n":
                    continue
                yield path, number, raw[:-1].decode("utf-8", errors="replace")


def iter_lines(directory: Path) -> Iterator[str]:
    """Every complete line of every segment, in write order, without its newline."""
    for _, _, line in iter_numbered_lines(directory):
        yield line


DamagedFn = Callable[[Path, int, str], None]
"""Told of a line that is not line protocol: (segment, line number, why)."""


def iter_samples(
    directory: Path,
    measurement: str | Collection[str] | None = None,
    on_damaged: DamagedFn | None = None,
) -> Iterator[Sample]:
    """The samples of a spool, in write order, optionally only those of one measurement (or of several).

    A line that is not valid line protocol (a disk or a power loss damaged it) goes to `on_damaged` and
    is skipped; without it, ValueError naming the segment and line.
    """
    wanted = (
        None if measurement is None else {measurement} if isinstance(measurement, str) else set(measurement)
    )
    prefixes = None if wanted is None else tuple(m.translate(_MEAS_ESC) for m in wanted)
    for path, number, line in iter_numbered_lines(directory):
        # Cheap prefix test before parsing: a line starts with its escaped measurement name.
        if prefixes is not None and not line.startswith(prefixes):
            continue
        try:
            sample = parse_line(line)
        except ValueError as err:
            if on_damaged is None:
                raise ValueError(f"{path}:{number}: {err}") from None
            on_damaged(path, number, str(err))
            continue
        if wanted is None or sample.measurement in wanted:
            yield sample
