"""soakd's scheduler class on both vLLM shapes it supports: the live admission attribute is found by
name (0.32 `max_num_active_reqs`, 0.26 `max_num_running_reqs`), never set below the running count (0.26
asserts running <= it), and the status file says what is enforced, not what was asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from soakd.engine.live_limit import read_status, status_path, write_limit, write_status
from soakd.engine.sched import SoakdScheduler, _LiveLimit, live_attr


def bare(tmp_path: Path, attrs: dict[str, int], running: int) -> SoakdScheduler:
    """A SoakdScheduler without vLLM's engine behind it: only what _soakd_apply reads."""
    sched = object.__new__(SoakdScheduler)
    for name, value in attrs.items():
        setattr(sched, name, value)
    sched.running = [object()] * running  # type: ignore[assignment]
    limit_file = tmp_path / "active-seqs"
    sched._soakd_live = _LiveLimit(str(limit_file))
    sched._soakd_status = status_path(limit_file)
    sched._soakd_attr = live_attr(sched)
    sched._soakd_start = None if sched._soakd_attr is None else attrs[sched._soakd_attr]
    sched._soakd_applied = sched._soakd_start
    return sched


def apply(sched: SoakdScheduler, limit: int | None, tmp_path: Path) -> None:
    write_limit(tmp_path / "active-seqs", limit)
    sched._soakd_live._next = 0.0  # look at the file now, not 0.2 s later
    sched._soakd_live._mtime_ns = -1
    sched._soakd_apply()


@pytest.mark.parametrize(
    ("attrs", "attr"),
    [
        ({"max_num_running_reqs": 8}, "max_num_running_reqs"),  # vLLM 0.26
        ({"max_num_running_reqs": 8, "max_num_active_reqs": 8}, "max_num_active_reqs"),  # 0.32
    ],
)
def test_live_limit_on_each_vllm_shape(tmp_path: Path, attrs: dict[str, int], attr: str) -> None:
    sched = bare(tmp_path, attrs, running=5)
    assert sched._soakd_attr == attr
    apply(sched, 2, tmp_path)
    # Five run: the attribute stays at 5 (admission stops), and nothing says 2 is enforced yet.
    assert getattr(sched, attr) == 5
    assert read_status(status_path(tmp_path / "active-seqs")) is None
    sched.running = [object()]  # type: ignore[assignment]
    sched._soakd_apply()
    assert getattr(sched, attr) == 2
    status = read_status(status_path(tmp_path / "active-seqs"))
    assert status is not None and status.attr == attr and status.applied == 2 and status.start == 8
    apply(sched, 50, tmp_path)  # never above the start
    assert getattr(sched, attr) == 8
    status = read_status(status_path(tmp_path / "active-seqs"))
    assert status is not None and status.applied == 8
    if attr == "max_num_active_reqs":
        assert sched.max_num_running_reqs == 8  # the runner's size is never touched


def test_a_vllm_without_the_attribute_reports_the_live_limit_off(tmp_path: Path) -> None:
    sched = bare(tmp_path, {}, running=0)
    assert sched._soakd_attr is None
    sched._soakd_report()
    status = read_status(status_path(tmp_path / "active-seqs"))
    assert status is not None and not status.live and status.applied is None
    apply(sched, 2, tmp_path)  # nothing to move, nothing raised
    assert not hasattr(sched, "max_num_running_reqs")


def test_status_of_a_previous_engine_is_not_taken(tmp_path: Path) -> None:
    from soakd.engine.live_limit import EngineLimitStatus

    path = status_path(tmp_path / "active-seqs")
    write_status(path, EngineLimitStatus("max_num_running_reqs", 8, 8, 0, 1, t=100.0))
    assert read_status(path, since=99.0) is not None
    assert read_status(path, since=101.0) is None
    path.write_text("{not json")
    assert read_status(path) is None
