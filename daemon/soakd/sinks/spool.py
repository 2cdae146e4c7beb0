"""The durable local spool: append-only line-protocol segments that every sample reaches first.

Layout: `seg-00000001.lp`, `seg-00000002.lp`, ... in one directory, one point per line, each segment at
most `segment_bytes` long (unless one line alone is longer) and holding only complete lines. Segments are
never rewritten: a reopened spool starts a new segment after the highest one, and a segment is final once
a later one exists, which is what lets the forwarder and `soakd report` read them while they are written.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import structlog

from soakd.metric import Sample, parse_line

log = structlog.get_logger(__name__)

SEGMENT_RE = re.compile(r"^seg-(\d{8})\.lp$")
# Same escaping as Sample.to_line applies to a measurement name.
_MEAS_ESC = str.maketrans({",": r"\,", " ": r"\ ", "\n": r"\n", "\\": r"\\"})


def segment_name(index: int) -> str:
    """The file name of segment number `index` (1-based)."""
    return f"seg-{index:08d}.lp"


def segment_index(path: Path) -> int:
    """The number of a segment file (ValueError when the name is not a segment's)."""
    match = SEGMENT_RE.match(path.name)
    if match is None:
        raise ValueError(f"not a spool segment: {path.name}")
    return int(match.group(1))


def list_segments(directory: Path) -> list[Path]:
    """The segment files of a spool directory, oldest first (an absent directory has none)."""
    try:
        names = [entry.name for entry in os.scandir(directory) if SEGMENT_RE.match(entry.name)]
    except FileNotFoundError:
        return []
    # Zero-padded numbers: name order is numeric order.
    return [directory / name for name in sorted(names)]


def _fsync_dir(directory: Path) -> None:
    # A new file's directory entry is durable only once the directory itself is synced.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Spool:
    """Appends samples to the current segment; rotates by size; fsyncs at most every `fsync_interval_s`.

    Every `write()` hands its lines to the OS before returning (one write system call per batch), so a
    crash of the daemon loses nothing that was written; fsync bounds what a power loss can take to the
    last `fsync_interval_s`. Synchronous and cheap enough to call from the event loop.
    """

    def __init__(
        self,
        directory: Path,
        segment_bytes: int,
        fsync_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if segment_bytes <= 0:
            raise ValueError("segment_bytes must be positive")
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.fsync_interval_s = fsync_interval_s
        self._clock = clock
        self.lines_written = 0
        self.bytes_written = 0
        self.segments_created = 0
        self.fsyncs = 0
        directory.mkdir(parents=True, exist_ok=True)
        existing = list_segments(directory)
        self._index = segment_index(existing[-1]) if existing else 0
        self._file: BinaryIO | None = None
        self._size = 0
        self._dirty = False
        self._last_fsync = clock()
        self._open_next()
        log.info("spool_opened", directory=str(directory), segment=self.current_segment.name)

    @property
    def current_segment(self) -> Path:
        """The segment being appended to."""
        return self.directory / segment_name(self._index)

    def segments(self) -> list[Path]:
        """Every segment of this spool, oldest first."""
        return list_segments(self.directory)

    def write(self, samples: Iterable[Sample]) -> int:
        """Append the samples' lines (samples with nothing to write are skipped); returns lines written."""
        f = self._require_open()
        count = 0
        for sample in samples:
            line = sample.to_line()
            if line is None:
                continue
            data = (line + "\n").encode("utf-8")
            # Rotate before a line would overflow the segment; an empty segment takes any line, so a
            # single oversized line gets a segment of its own instead of looping.
            if self._size > 0 and self._size + len(data) > self.segment_bytes:
                self._rotate()
                f = self._require_open()
            f.write(data)
            self._size += len(data)
            self.bytes_written += len(data)
            count += 1
        if count:
            self.lines_written += count
            self._dirty = True
            f.flush()
            if self._clock() - self._last_fsync >= self.fsync_interval_s:
                self._fsync()
        return count

    def flush(self, fsync: bool = True) -> None:
        """Hand buffered data to the OS and, with `fsync`, to the disk."""
        f = self._require_open()
        f.flush()
        if fsync and self._dirty:
            self._fsync()

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        """Flush, fsync and close the current segment. Closing twice is harmless."""
        if self._file is None:
            return
        self.flush(fsync=True)
        self._file.close()
        self._file = None
        log.info(
            "spool_closed",
            segment=self.current_segment.name,
            lines_written=self.lines_written,
            fsyncs=self.fsyncs,
        )

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_open(self) -> BinaryIO:
        if self._file is None:
            raise ValueError("spool is closed")
        return self._file

    def _fsync(self) -> None:
        f = self._require_open()
        f.flush()
        os.fsync(f.fileno())
        self.fsyncs += 1
        self._dirty = False
        self._last_fsync = self._clock()

    def _rotate(self) -> None:
        # The old segment is complete and durable before the next one appears: readers treat any
        # segment followed by a later one as final.
        f = self._require_open()
        f.flush()
        if self._dirty:
            self._fsync()
        f.close()
        self._file = None
        self._open_next()

    def _open_next(self) -> None:
        self._index += 1
        # "xb": never append to or truncate a segment someone else left behind.
        self._file = self.current_segment.open("xb")
        self._size = 0
        self.segments_created += 1
        _fsync_dir(self.directory)


def iter_lines(directory: Path) -> Iterator[str]:
    """Every complete line of every segment, in write order, without its newline.

    A last line without its newline (torn by a crash, or still being written) is skipped.
    """
    for path in list_segments(directory):
        with path.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                if raw == b"\n":
                    continue
                yield raw[:-1].decode("utf-8", errors="replace")


def iter_samples(directory: Path, measurement: str | None = None) -> Iterator[Sample]:
    """The samples of a spool, in write order, optionally only those of one measurement.

    Raises ValueError on a line that is not valid line protocol.
    """
    prefix = None if measurement is None else measurement.translate(_MEAS_ESC)
    for line in iter_lines(directory):
        # Cheap prefix test before parsing: a line starts with its escaped measurement name.
        if prefix is not None and not line.startswith(prefix):
            continue
        sample = parse_line(line)
        if measurement is None or sample.measurement == measurement:
            yield sample
