"""The spool: size-bounded segments of complete lines, batched fsyncs, reopen, reading back."""

from __future__ import annotations

from pathlib import Path

import pytest

from soakd.metric import Sample
from soakd.sinks.spool import Spool, iter_lines, iter_samples
from soakd.testing import ManualClock


def _samples(n: int, start: int = 0, pad: int = 0) -> list[Sample]:
    return [
        Sample(
            "engine",
            {"i": i, "rate": i / 7, "note": "x" * pad + f' #{i}, "q"'},
            1_700_000_000_000_000_000 + i,
            {"gpu": str(i % 2)},
        )
        for i in range(start, start + n)
    ]


def test_rotation_by_size_keeps_lines_whole(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    total = 0
    for batch in range(20):
        total += spool.write(_samples(25, start=batch * 25, pad=batch * 7))
    spool.close()

    segments = spool.segments()
    assert len(segments) > 5
    assert spool.segments_created == len(segments)
    assert [p.name for p in segments][:2] == ["seg-00000001.lp", "seg-00000002.lp"]
    for seg in segments:
        data = seg.read_bytes()
        assert len(data) <= 4096
        assert data.endswith(b"\n")  # a segment ends on a whole line
    lines = list(iter_lines(tmp_path))
    assert total == 500 == spool.lines_written == len(lines)
    assert spool.bytes_written == sum(p.stat().st_size for p in segments)
    # Every line parses back to the sample that was written, in order.
    back = list(iter_samples(tmp_path))
    assert [s.fields["i"] for s in back] == list(range(500))
    assert back[3] == _samples(1, start=3, pad=0)[0]


def test_oversized_line_gets_its_own_segment(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    spool.write(_samples(2))
    spool.write(_samples(1, start=2, pad=10_000))
    spool.write(_samples(2, start=3))
    spool.close()
    sizes = [p.stat().st_size for p in spool.segments()]
    assert len(sizes) == 3
    assert sizes[1] > 4096
    assert sizes[0] <= 4096 and sizes[2] <= 4096
    assert [s.fields["i"] for s in iter_samples(tmp_path)] == [0, 1, 2, 3, 4]


def test_samples_without_values_are_skipped(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    written = spool.write([Sample("gpu", {"power_w": float("nan")}, 1), *_samples(3)])
    spool.close()
    assert written == 3
    assert len(list(iter_lines(tmp_path))) == 3


def test_fsync_is_batched_by_interval(tmp_path: Path) -> None:
    clock = ManualClock()
    spool = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0, clock=clock)
    for i in range(1000):
        clock.now = i * 0.01  # a write every 10 ms for 10 s
        spool.write(_samples(1, start=i))
    assert spool.lines_written == 1000
    # About one fsync per second of writes, not one per write.
    assert 9 <= spool.fsyncs <= 11
    spool.close()
    assert 9 <= spool.fsyncs <= 12


def test_data_reaches_the_file_on_every_write(tmp_path: Path) -> None:
    # No fsync due yet, but a reader (the forwarder) already sees the whole batch.
    clock = ManualClock()
    spool = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=60.0, clock=clock)
    spool.write(_samples(10))
    assert spool.fsyncs == 0
    assert len(list(iter_lines(tmp_path))) == 10
    spool.flush()
    assert spool.fsyncs == 1
    spool.flush()
    assert spool.fsyncs == 1  # nothing new to make durable
    spool.close()


def test_reopen_continues_in_a_new_segment(tmp_path: Path) -> None:
    first = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    first.write(_samples(100))
    first.close()
    before = {p.name: p.read_bytes() for p in first.segments()}
    last_name = max(before)

    second = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    assert second.current_segment.name > last_name
    second.write(_samples(5, start=100))
    second.close()

    # Old segments are untouched; everything reads back in order.
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data
    assert [s.fields["i"] for s in iter_samples(tmp_path)] == list(range(105))


def test_closed_spool_refuses_writes(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    spool.close()
    spool.close()
    with pytest.raises(ValueError, match="closed"):
        spool.write(_samples(1))


def test_iter_lines_skips_a_torn_last_line(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    spool.write(_samples(3))
    spool.close()
    with spool.current_segment.open("ab") as f:
        f.write(b'engine,gpu=0 i=99i,note="half')  # a crash in the middle of a line
    assert len(list(iter_lines(tmp_path))) == 3
    assert [s.fields["i"] for s in iter_samples(tmp_path)] == [0, 1, 2]
    # The next daemon run starts a new segment; the torn tail stays skipped.
    again = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    again.write(_samples(2, start=3))
    again.close()
    assert [s.fields["i"] for s in iter_samples(tmp_path)] == [0, 1, 2, 3, 4]


def test_iter_samples_filters_by_measurement(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    spool.write(
        [
            Sample("gpu", {"power_w": 1.5}, 1),
            Sample("gpu_extra", {"x": 1}, 2),
            Sample("my events", {"kind": "start"}, 3),
            Sample("gpu", {"power_w": 2.5}, 4),
        ]
    )
    spool.close()
    assert [s.fields["power_w"] for s in iter_samples(tmp_path, "gpu")] == [1.5, 2.5]
    assert [s.time_ns for s in iter_samples(tmp_path, "my events")] == [3]
    assert list(iter_samples(tmp_path / "absent")) == []


async def test_background_fsync_leaves_the_disk_wait_to_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import os
    import threading

    clock = ManualClock()
    spool = Spool(tmp_path, 1 << 20, fsync_interval_s=1.0, clock=clock)
    spool.background_fsync = True
    threads: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        threads.append(threading.get_ident())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    clock.now = 5.0  # the interval has passed: an inline spool would fsync within write()
    spool.write(_samples(3))
    assert spool.fsyncs == 0 and threads == []
    sync = asyncio.ensure_future(spool.sync_off_loop())
    await asyncio.sleep(0)
    spool.write(_samples(2, start=3))  # written while the fsync runs: still to be synced
    await sync
    assert spool.fsyncs == 1 and threads and threading.get_ident() not in threads
    await spool.sync_off_loop()  # the lines written meanwhile
    assert spool.fsyncs == 2
    await spool.sync_off_loop()  # nothing new: no fsync
    assert spool.fsyncs == 2
    spool.close()
    assert len(list(iter_samples(tmp_path))) == 5


async def test_a_failed_background_fsync_degrades_the_spool_as_an_inline_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    spool = Spool(tmp_path, 1 << 20, fsync_interval_s=1.0)
    spool.background_fsync = True
    spool.write(_samples(1))

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", broken)
    await spool.sync_off_loop()
    assert spool.state == "full" and "fsync" in spool.reason
