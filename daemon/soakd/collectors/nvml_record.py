"""Record raw NVML readings of every GPU to a JSONL file that `RecordedNvml` replays.

This backs `soakd telemetry record --duration D OUT`. The format is the one scripts/record_nvml.py
writes: a header line `{"header": {"driver": ..., "gpus": [static, ...]}}`, then one line per fast
sample `{"t": s since start, "wall_ns": ..., "gpus": [fast reading, ...]}`, with each GPU's slow-tier
readings (`energy_mj`, `margin_c`, `fields` {id: value}, ...) merged into every slow line.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from soakd.collectors.nvml import NvmlSource

FLUSH_EVERY_S = 10.0
"""How much recording time is written between flushes to disk."""


class _Sink(Protocol):
    def write(self, data: bytes, /) -> int: ...

    def flush(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RecordCounts:
    """What one `record` call wrote."""

    gpus: int
    fast_samples: int
    """Lines written (one fast sample of every GPU each)."""
    slow_samples: int
    """Lines that also carry the slow tier."""
    missed: int
    """Fast samples skipped because a read overran its slot (the schedule is not shifted)."""
    duration_s: float
    """Time from the first sample to the end, on `clock`."""


def record(
    source: NvmlSource,
    duration_s: float,
    out: Path,
    fast_hz: float = 10.0,
    slow_hz: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    wall_ns: Callable[[], int] = time.time_ns,
) -> RecordCounts:
    """Sample `source` for `duration_s` seconds into `out` (gzip when the name ends .gz).

    The fast tier is read every 1/fast_hz s on absolute deadlines (no drift; a slot missed because a
    read overran is skipped and counted), the slow tier on every round(fast_hz/slow_hz)-th sample,
    starting with the first. The file is written to a temporary name in the same directory, flushed
    every FLUSH_EVERY_S of recording, and renamed to `out` only when the recording completes: an
    interrupted or failed record (Ctrl-C included) leaves no file behind.
    """
    if duration_s <= 0 or fast_hz <= 0 or slow_hz <= 0:
        raise ValueError("duration_s, fast_hz and slow_hz must be positive")
    slow_every = max(1, round(fast_hz / slow_hz))
    period = 1.0 / fast_hz
    flush_every = max(1, round(FLUSH_EVERY_S * fast_hz))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        raw: IO[bytes] = os.fdopen(fd, "wb")
        with raw:
            if out.name.endswith(".gz"):
                with gzip.GzipFile(fileobj=raw, mode="wb") as gz:
                    counts = _write(
                        source, gz, duration_s, period, slow_every, flush_every, clock, sleep, wall_ns
                    )
            else:
                counts = _write(
                    source, raw, duration_s, period, slow_every, flush_every, clock, sleep, wall_ns
                )
            raw.flush()
            os.fsync(raw.fileno())
        tmp.chmod(0o644)  # mkstemp makes it 0600; a recording is for whoever reads the results
        tmp.replace(out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return counts


def _write(
    source: NvmlSource,
    f: _Sink,
    duration_s: float,
    period: float,
    slow_every: int,
    flush_every: int,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    wall_ns: Callable[[], int],
) -> RecordCounts:
    gpus = range(source.gpu_count())
    header = {"driver": source.driver_version(), "gpus": [source.static(i).to_dict() for i in gpus]}
    f.write((json.dumps({"header": header}) + "\n").encode())
    t0 = clock()
    slot = next_slow = 0
    lines = slow_lines = missed = 0
    while (now := clock()) - t0 < duration_s:
        row: dict[str, object] = {"t": round(now - t0, 4), "wall_ns": wall_ns()}
        readings = [dict(source.fast(i)) for i in gpus]
        if slot >= next_slow:
            for i, g in zip(gpus, readings, strict=True):
                g.update(source.slow(i))
            slow_lines += 1
            next_slow = (slot // slow_every + 1) * slow_every
        row["gpus"] = readings
        f.write((json.dumps(row) + "\n").encode())
        lines += 1
        if lines % flush_every == 0:
            f.flush()
        slot += 1
        # Absolute deadlines; a slot whose deadline has passed already is skipped, not crammed in.
        behind = int((clock() - t0) / period) - slot
        if behind > 0:
            missed += behind
            slot += behind
        sleep(max(0.0, t0 + slot * period - clock()))
    return RecordCounts(
        gpus=len(gpus),
        fast_samples=lines,
        slow_samples=slow_lines,
        missed=missed,
        duration_s=clock() - t0,
    )
