"""The spool's files on disk: modes whatever the umask, and a segment torn by a killed daemon."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from soakd.errors import SinkRejected
from soakd.metric import Sample
from soakd.sinks.forwarder import REJECTED_FILE, Forwarder
from soakd.sinks.spool import Spool, iter_lines, torn_tail_bytes


def _samples(start: int, n: int, pad: int = 0) -> list[Sample]:
    return [
        Sample("requests", {"i": i, "note": "x" * pad}, 1_000 + i, {"gpu": "0"})
        for i in range(start, start + n)
    ]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o000, 0o077])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


class Refusing:
    """Refuses the first batch (HTTP 400), accepts the rest."""

    def __init__(self) -> None:
        self.calls = 0

    async def write(self, lines: Sequence[str]) -> None:
        self.calls += 1
        if self.calls == 1:
            raise SinkRejected("HTTP 400: field type conflict")

    async def ping(self) -> str:
        return "x"

    async def aclose(self) -> None:
        return None


async def test_spool_and_forwarder_files_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    directory = tmp_path / "run" / "spool"
    spool = Spool(directory, segment_bytes=4096, fsync_interval_s=1.0)
    spool.write(_samples(0, 100, pad=40))  # several segments
    fwd = Forwarder(directory, Refusing(), batch_lines=10)
    assert await fwd.drain(5.0)
    spool.close()

    assert _mode(directory) == 0o700
    segments = spool.segments()
    assert len(segments) > 1
    assert {_mode(p) for p in segments} == {0o600}
    # forwarder.json is its .tmp renamed: one inode, one mode.
    assert _mode(directory / "forwarder.json") == 0o600
    assert _mode(directory / REJECTED_FILE) == 0o600
    assert not list(directory.glob("*.tmp"))
    assert len((directory / REJECTED_FILE).read_text().splitlines()) == 10


def test_an_existing_spool_directory_is_made_private(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    Spool(directory, 4096, 1.0).close()
    assert _mode(directory) == 0o700


async def test_state_files_left_with_wide_modes_are_rewritten_private(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 4096, 1.0)
    spool.write(_samples(0, 3))
    tmp = tmp_path / "forwarder.json.tmp"
    tmp.write_text("stale")
    tmp.chmod(0o666)
    rejected = tmp_path / REJECTED_FILE
    rejected.write_text("")
    rejected.chmod(0o644)
    fwd = Forwarder(tmp_path, Refusing(), batch_lines=2)
    assert await fwd.drain(5.0)
    spool.close()
    assert _mode(tmp_path / "forwarder.json") == 0o600
    assert _mode(rejected) == 0o600


async def test_a_torn_segment_is_kept_up_to_its_last_whole_line(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    spool.write(_samples(0, 50))
    spool.close()
    segment = spool.current_segment
    whole = segment.read_bytes()
    # The daemon was killed in the middle of a write: the file ends 17 bytes into line 50.
    line_50 = Sample("requests", {"i": 50, "note": ""}, 1_050, {"gpu": "0"}).to_line()
    assert line_50 is not None
    with segment.open("ab") as f:
        f.write((line_50 + "\n").encode()[:17])
    os.truncate(segment, len(whole) + 17)
    assert torn_tail_bytes(segment) == 17

    with capture_logs() as logs:
        restarted = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    torn = [e for e in logs if e["event"] == "spool_torn_tail"]
    assert torn == [
        {
            "event": "spool_torn_tail",
            "log_level": "warning",
            "segment": segment.name,
            "bytes": 17,
            "kept_bytes": len(whole),
        }
    ]
    assert restarted.total_bytes == len(whole) + 17
    restarted.write(_samples(51, 5))
    restarted.close()
    assert segment.read_bytes()[: len(whole)] == whole  # the whole lines are untouched

    lines = list(iter_lines(tmp_path))
    expected = [s.to_line() for s in _samples(0, 50) + _samples(51, 5)]
    assert lines == expected

    shipped: list[str] = []

    class Keep:
        async def write(self, batch: Sequence[str]) -> None:
            shipped.extend(batch)

        async def ping(self) -> str:
            return "x"

        async def aclose(self) -> None:
            return None

    fwd = Forwarder(tmp_path, Keep(), batch_lines=7)
    assert await fwd.drain(5.0)
    assert shipped == expected
    assert fwd.backlog_lines() == 0 and fwd.backlog_bytes() == 0


def test_a_whole_segment_reopens_without_a_warning(tmp_path: Path) -> None:
    Spool(tmp_path, 1 << 20, 1.0).close()  # an empty segment
    spool = Spool(tmp_path, 1 << 20, 1.0)
    spool.write(_samples(0, 3))
    spool.close()
    with capture_logs() as logs:
        Spool(tmp_path, 1 << 20, 1.0).close()
    assert not [e for e in logs if e["event"] == "spool_torn_tail"]


def test_torn_tail_longer_than_one_read(tmp_path: Path) -> None:
    path = tmp_path / "seg-00000001.lp"
    path.write_bytes(b"a 1\n" + b"x" * 200_000)
    assert torn_tail_bytes(path) == 200_000
    path.write_bytes(b"y" * 70_000)
    assert torn_tail_bytes(path) == 70_000
    path.write_bytes(b"")
    assert torn_tail_bytes(path) == 0
