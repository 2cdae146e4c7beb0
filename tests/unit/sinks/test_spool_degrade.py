"""The spool when it runs out of room: bounded by max_bytes and min_free_bytes (essential lines only), a
full disk (nothing, counted, no torn line), recovery when space returns, and the events it raises.

A full disk is simulated by the one thing that must be: the low-level write (an injected os.write with
a quota that fails with ENOSPC after a partial write, as the kernel does). Everything else is real files.
"""

from __future__ import annotations

import asyncio
import errno
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from soakd.metric import FieldValue, Sample
from soakd.sinks import spool as spool_mod
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.spool import ESSENTIAL_MEASUREMENTS, Spool, iter_lines, iter_samples, list_segments
from soakd.sinks.writer import SampleWriter
from soakd.testing import ManualClock

T0 = 1_700_000_000_000_000_000


class Disk:
    """os.write on a disk with `room` bytes left (None: plenty): past it a write is cut short and the
    next one fails with `error`, like a filesystem that fills up mid-write."""

    def __init__(self, room: int | None = None, error: int = errno.ENOSPC) -> None:
        self.room = room
        self.error = error
        self.calls = 0

    def __call__(self, fd: int, data: memoryview) -> int:
        self.calls += 1
        if self.room is None:
            return os.write(fd, data)
        if self.room <= 0:
            raise OSError(self.error, os.strerror(self.error))
        n = os.write(fd, data[: self.room])
        self.room -= n
        return n


Events = list[tuple[str, dict[str, FieldValue]]]


def _recorder() -> tuple[Events, spool_mod.EventCallback]:
    events: Events = []

    def on_event(kind: str, fields: dict[str, FieldValue]) -> None:
        events.append((kind, dict(fields)))

    return events, on_event


def _batch(start: int, measurements: Sequence[str]) -> list[Sample]:
    return [Sample(m, {"i": start + k, "v": 0.5}, T0 + start + k) for k, m in enumerate(measurements)]


def _state(spool: Spool) -> str:
    # Read through a function: mypy would otherwise keep the attribute narrowed across writes.
    return spool.state


def _ids(lines: list[str]) -> list[int]:
    return [int(line.split("i=")[1].split("i")[0]) for line in lines]


def test_max_bytes_keeps_only_essential_lines_and_counts_the_rest(tmp_path: Path) -> None:
    events, on_event = _recorder()
    spool = Spool(tmp_path, 1 << 20, 1.0, ManualClock(), max_bytes=2000, on_event=on_event)
    mix = ["gpu", "requests", "host", "events", "engine"]
    offered: Counter[str] = Counter()
    i = 0
    while spool.state == "ok":
        spool.write(_batch(i, mix))
        offered.update(mix)
        i += len(mix)
    assert spool.total_bytes >= 2000
    assert _state(spool) == "essential"
    for _ in range(10):
        spool.write(_batch(i, mix))
        offered.update(mix)
        i += len(mix)
    spool.close()

    assert [k for k, _ in events] == ["spool_degraded"]
    assert events[0][1]["state"] == "essential" and events[0][1]["reason"] == "max_bytes"
    assert events[0][1]["max_bytes"] == 2000
    # The batch that crossed the bound was the last one written whole; the 11 after it lost their
    # periodic lines.
    assert spool.dropped == {"gpu": 11, "host": 11, "engine": 11}
    kept = Counter(s.measurement for s in iter_samples(tmp_path))
    # Nothing vanished: each measurement was either written or counted as dropped.
    assert kept + Counter(spool.dropped) == offered
    assert kept["requests"] == kept["events"] == offered["requests"]
    assert spool.lines_written == sum(kept.values())
    assert spool.total_bytes == sum(p.stat().st_size for p in list_segments(tmp_path))
    assert spool.series_fields()["dropped_gpu"] == 11
    assert spool.series_fields()["state"] == 1


def test_low_free_space_degrades_and_recovers_once_space_returns(tmp_path: Path) -> None:
    clock = ManualClock()
    events, on_event = _recorder()
    # More free space than any disk has: statvfs (real) always reports less.
    spool = Spool(tmp_path, 1 << 20, 1.0, clock, min_free_bytes=1 << 62, on_event=on_event)
    spool.write(_batch(0, ["gpu", "requests"]))
    assert _state(spool) == "essential"
    assert spool.free_bytes is not None and spool.free_bytes > 0
    assert events[0][1] | {"free_bytes": 0} == {
        "state": "essential",
        "was": "ok",
        "reason": "min_free_bytes",
        "bytes": 0,  # decided before the first line was written
        "free_bytes": 0,
        "max_bytes": 0,
        "min_free_bytes": 1 << 62,
    }
    assert events[0][1]["free_bytes"] == spool.free_bytes

    clock.now = 0.5
    spool.write(_batch(2, ["gpu", "requests"]))
    assert _state(spool) == "essential"
    spool.min_free_bytes = 0  # as if the operator had made room
    clock.now = 1.0
    spool.write(_batch(4, ["gpu", "requests"]))
    assert _state(spool) == "ok"
    spool.close()

    assert [k for k, _ in events] == ["spool_degraded", "spool_recovered"]
    recovered = events[1][1]
    assert recovered["dropped_total"] == 2 and recovered["dropped_gpu"] == 2
    assert recovered["degraded_s"] == 1.0 and recovered["was"] == "essential"
    assert [s.measurement for s in iter_samples(tmp_path)] == ["requests", "requests", "gpu", "requests"]
    assert spool.dropped == {"gpu": 2}


def test_free_space_is_read_once_a_second_or_per_mebibyte_not_per_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Path] = []
    real = spool_mod.fs_space

    def counting(directory: Path) -> tuple[int, int]:
        reads.append(directory)
        return real(directory)

    monkeypatch.setattr(spool_mod, "fs_space", counting)
    clock = ManualClock()
    spool = Spool(tmp_path, 64 << 20, 1.0, clock, min_free_bytes=1)
    for i in range(200):
        clock.now = i * 0.004  # 200 writes in 0.8 s
        spool.write(_batch(i, ["gpu"]))
    assert len(reads) == 1
    clock.now = 1.0
    spool.write(_batch(200, ["gpu"]))
    assert len(reads) == 2
    big = Sample("gpu", {"blob": "x" * (1 << 20)}, T0)
    spool.write([big])  # a mebibyte since the last read: read again at once
    spool.write(_batch(201, ["gpu"]))
    assert len(reads) == 3
    spool.close()


def test_a_full_disk_cuts_the_failed_write_back_and_recovers(tmp_path: Path) -> None:
    clock = ManualClock()
    disk = Disk()
    events, on_event = _recorder()
    spool = Spool(tmp_path, 1 << 20, 1.0, clock, write_fn=disk, on_event=on_event)
    assert spool.write(_batch(0, ["gpu", "requests"] * 5)) == 10
    segment = spool.current_segment
    before = segment.read_bytes()

    disk.room = 50  # less than the next batch: the kernel writes 50 bytes, then ENOSPC
    with capture_logs() as logs:
        assert spool.write(_batch(10, ["gpu", "requests"] * 3)) == 0
    assert _state(spool) == "full" and spool.reason == "ENOSPC"
    assert segment.read_bytes() == before  # the partial write is gone: no torn line
    assert spool.dropped == {"gpu": 3, "requests": 3}
    assert [e["log_level"] for e in logs if e["event"] == "spool_degraded"] == ["error"]

    calls = disk.calls
    assert spool.write(_batch(16, ["requests"])) == 0
    assert disk.calls == calls  # full: no write is tried before the next check
    clock.now = 1.0
    assert spool.write(_batch(17, ["requests"])) == 0
    assert disk.calls == calls + 1  # one try a second, still no room
    assert [k for k, _ in events] == ["spool_degraded"]  # a failed try changes nothing

    disk.room = None  # the operator deleted something
    clock.now = 2.0
    assert spool.write(_batch(18, ["gpu", "requests"])) == 2
    assert _state(spool) == "ok"
    spool.close()

    assert [k for k, _ in events] == ["spool_degraded", "spool_recovered"]
    assert events[0][1]["state"] == "full" and events[0][1]["reason"] == "ENOSPC"
    assert events[1][1]["dropped_total"] == 8
    assert events[1][1]["dropped_requests"] == 5
    assert events[1][1]["degraded_s"] == 2.0
    assert _ids(list(iter_lines(tmp_path))) == [*range(10), 18, 19]
    assert spool.lines_written + sum(spool.dropped.values()) == 20
    assert all(p.read_bytes().endswith(b"\n") for p in list_segments(tmp_path))


def test_a_full_spool_tries_again_only_when_statvfs_shows_room_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    space = (0, 0)  # (free to anyone, free to this process): what statvfs would say
    monkeypatch.setattr(spool_mod, "fs_space", lambda directory: space)
    clock = ManualClock()
    disk = Disk(room=0)
    spool = Spool(tmp_path, 1 << 20, 1.0, clock, write_fn=disk)
    spool.write(_batch(0, ["requests"]))
    assert _state(spool) == "full" and disk.calls == 1
    clock.now = 1.0
    spool.write(_batch(1, ["requests"]))
    assert disk.calls == 1  # no room: not even a try
    space = (0, 64 << 20)  # root's reserved blocks: room for this process, if not for others
    disk.room = None
    clock.now = 2.0
    assert spool.write(_batch(2, ["requests"])) == 1
    assert _state(spool) == "ok"
    spool.close()
    assert _ids(list(iter_lines(tmp_path))) == [2]


@pytest.mark.parametrize(
    ("error", "reason"), [(errno.EDQUOT, "EDQUOT"), (errno.EIO, "EIO: Input/output error")]
)
def test_other_write_errors_degrade_instead_of_raising(tmp_path: Path, error: int, reason: str) -> None:
    disk = Disk(room=0, error=error)
    spool = Spool(tmp_path, 1 << 20, 1.0, ManualClock(), write_fn=disk)
    assert spool.write(_batch(0, ["requests"])) == 0
    assert (_state(spool), spool.reason) == ("full", reason)
    assert spool.dropped == {"requests": 1}
    spool.close()


def test_a_failed_truncate_moves_on_to_a_new_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock()
    disk = Disk()
    spool = Spool(tmp_path, 1 << 20, 1.0, clock, write_fn=disk)
    spool.write(_batch(0, ["requests"] * 3))
    first = spool.current_segment

    def refuse(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "ftruncate", refuse)
    disk.room = 7  # a torn line that cannot be cut back off
    spool.write(_batch(3, ["requests"] * 2))
    monkeypatch.undo()
    assert _state(spool) == "full"
    assert not first.read_bytes().endswith(b"\n")

    disk.room = None
    clock.now = 1.0
    assert spool.write(_batch(5, ["requests"])) == 1
    assert spool.current_segment.name > first.name  # never appended after the torn bytes
    spool.close()
    assert _ids(list(iter_lines(tmp_path))) == [0, 1, 2, 5]
    assert spool.total_bytes == sum(p.stat().st_size for p in list_segments(tmp_path))


def test_a_failed_fsync_degrades_and_writing_resumes_in_a_new_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    spool = Spool(tmp_path, 200, 1.0, clock)
    spool.write(_batch(0, ["requests"] * 5))  # 5 x 40 bytes: a full segment
    first = spool.current_segment
    assert len(spool.segments()) == 1

    def fail(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with capture_logs() as logs:
        spool.flush()  # never raises
    monkeypatch.undo()
    assert _state(spool) == "full" and spool.reason.startswith("fsync EIO")
    assert "spool_fsync_failed" in [e["event"] for e in logs]
    clock.now = 1.0
    assert spool.write(_batch(5, ["requests"])) == 1
    assert _state(spool) == "ok"
    assert spool.current_segment.name > first.name
    spool.close()
    assert _ids(list(iter_lines(tmp_path))) == [0, 1, 2, 3, 4, 5]


def test_events_written_by_the_callback_go_through_the_same_spool(tmp_path: Path) -> None:
    clock = ManualClock()
    disk = Disk()
    spool = Spool(tmp_path, 1 << 20, 1.0, clock, write_fn=disk, max_bytes=1500)
    writer = SampleWriter(spool, {"run_id": "r"}, wall_ns=lambda: T0)
    # As the app wires it: the spool exists before the writer that records its events.
    spool.on_event = lambda kind, fields: writer.event(kind, f"spool {kind}", **fields)
    i = 0
    while spool.state == "ok":
        writer(_batch(i, ["gpu", "requests"]))
        i += 2
    disk.room = 0
    writer(_batch(i, ["requests"]))  # the event about the full disk cannot be written: counted
    assert _state(spool) == "full"
    assert spool.dropped["events"] == 1
    disk.room = None
    spool.max_bytes = 0
    clock.now = 1.0
    writer(_batch(i + 1, ["gpu"]))
    assert _state(spool) == "ok"
    spool.close()

    kinds = [(s.tags["kind"], s.fields.get("state")) for s in iter_samples(tmp_path, "events")]
    assert kinds == [("spool_degraded", "essential"), ("spool_recovered", "ok")]
    recovered = [s for s in iter_samples(tmp_path, "events")][-1]
    assert recovered.fields["dropped_events"] == 1
    assert recovered.fields["dropped_requests"] == 1
    assert recovered.tags["run_id"] == "r"


def test_a_callback_that_keeps_changing_the_state_cannot_recurse(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20, 1.0, ManualClock())
    calls: list[str] = []

    def flapping(kind: str, fields: dict[str, FieldValue]) -> None:
        calls.append(kind)
        # Each event flips the bound, so the event's own write changes the state again.
        spool.max_bytes = 0 if spool.max_bytes else 1
        spool.write(_batch(len(calls), ["gpu", "events"]))

    spool.write(_batch(0, ["gpu"]))
    spool.on_event = flapping
    spool.max_bytes = 1
    spool.write(_batch(1, ["gpu"]))
    assert len(calls) == spool_mod._MAX_EVENTS_PER_WRITE  # bounded, and no RecursionError
    spool.on_event = None
    spool.close()
    assert len(list(iter_lines(tmp_path))) == spool.lines_written


def test_a_failing_callback_does_not_break_the_write(tmp_path: Path) -> None:
    def broken(kind: str, fields: dict[str, FieldValue]) -> None:
        raise RuntimeError("listener bug")

    spool = Spool(tmp_path, 1 << 20, 1.0, ManualClock(), max_bytes=1, on_event=broken)
    with capture_logs() as logs:
        assert spool.write(_batch(0, ["requests"])) == 1
        assert spool.write(_batch(1, ["requests"])) == 1  # past max_bytes: essential
    assert _state(spool) == "essential"
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["spool_event_failed"]
    spool.close()


def test_essential_set() -> None:
    # The report's verdict reads `requests` back from the spool; the sinks' health must stay visible.
    assert {"requests", "events", "run", "sink", "spool"} <= ESSENTIAL_MEASUREMENTS
    assert not {"gpu", "host", "engine", "collector"} & ESSENTIAL_MEASUREMENTS


class MemoryWriter:
    def __init__(self) -> None:
        self.lines: list[str] = []

    async def write(self, lines: Sequence[str]) -> None:
        self.lines.extend(lines)

    async def ping(self) -> str:
        return "memory"

    async def aclose(self) -> None:
        return None


_MEASUREMENTS = ["gpu", "requests", "host", "events"]
_BATCHES = st.lists(st.lists(st.sampled_from(_MEASUREMENTS), min_size=1, max_size=12), max_size=4)
# One episode: writes, the disk fills up to `room` more bytes, writes, space returns after `gap`
# seconds, writes; the forwarder takes `ships` steps between episodes.
_EPISODES = st.lists(
    st.tuples(_BATCHES, st.integers(0, 300), _BATCHES, st.integers(0, 2), _BATCHES, st.integers(0, 3)),
    min_size=1,
    max_size=6,
)


# Fewer examples than the other properties: each one fsyncs every segment (and directory) it makes.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episodes=_EPISODES, segment_bytes=st.integers(150, 1500), max_bytes=st.sampled_from([0, 300, 900]))
def test_no_torn_duplicated_or_silently_lost_line_across_full_disks(
    episodes: list[tuple[list[list[str]], int, list[list[str]], int, list[list[str]], int]],
    segment_bytes: int,
    max_bytes: int,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        clock = ManualClock()
        disk = Disk()
        spool = Spool(directory, segment_bytes, 1.0, clock, write_fn=disk, max_bytes=max_bytes)
        writer = SampleWriter(spool, {}, wall_ns=lambda: T0)
        spool.on_event = lambda kind, fields: writer.event(kind, kind, **fields)
        sink = MemoryWriter()
        fwd = Forwarder(directory, sink, batch_lines=3)
        offered: Counter[str] = Counter()
        n = 0

        def write(batches: list[list[str]]) -> None:
            nonlocal n
            for measurements in batches:
                writer(_batch(n, measurements))
                offered.update(measurements)
                n += len(measurements)
                clock.now += 0.25

        for before, room, during, gap, after, ships in episodes:
            write(before)
            disk.room = room
            write(during)
            disk.room = None
            clock.now += gap
            write(after)
            for _ in range(ships):
                asyncio.run(fwd.step())
            # The forwarder's running backlog equals a count from scratch, whatever happened.
            assert fwd.backlog_lines() == len(list(iter_lines(directory))) - len(sink.lines)
        spool.close()

        for path in list_segments(directory):
            data = path.read_bytes()
            assert not data or data.endswith(b"\n")  # no torn line anywhere
        lines = list(iter_lines(directory))
        assert len(lines) == spool.lines_written
        ids = _ids([line for line in lines if not line.startswith("events")])
        assert ids == sorted(set(ids))  # in order, none twice
        written = Counter(line.split(" ", 1)[0].split(",", 1)[0] for line in lines)
        # Every offered line (the spool's own events included) is on disk or counted as dropped.
        assert Counter(writer.counts)["events"] >= offered["events"]
        assert written + Counter(spool.dropped) == Counter(writer.counts)
        asyncio.run(fwd.drain(5.0))
        assert sink.lines == lines
