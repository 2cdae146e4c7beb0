"""Open-loop pacing: due times from trace time x speed, looping with a shift, the duration bound."""

from __future__ import annotations

import itertools

import pytest

from soakd.replay.pacer import loop_period, schedule
from soakd.traces.model import RequestSpec


def specs(times: list[float]) -> list[RequestSpec]:
    return [RequestSpec(i, t, 10, 5, 512) for i, t in enumerate(times)]


def test_due_times_follow_trace_divided_by_speed() -> None:
    trace = specs([0.0, 1.0, 2.5])
    out = list(schedule(trace, span_s=2.5, requests=3, speed=2.0, duration_s=100, loop=False))
    assert [s.due_s for s in out] == [0.0, 0.5, 1.25]
    assert all(s.loop == 0 for s in out)


def test_loops_shift_by_span_plus_mean_gap_until_duration() -> None:
    trace = specs([0.0, 1.0, 2.0])
    period = loop_period(2.0, 3)
    assert period == 3.0
    out = list(schedule(trace, span_s=2.0, requests=3, speed=1.0, duration_s=7.5, loop=True))
    assert [s.due_s for s in out] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [s.loop for s in out] == [0, 0, 0, 1, 1, 1, 2, 2]
    # strictly increasing: the seam between passes never fires two requests at once
    assert all(b.due_s > a.due_s for a, b in itertools.pairwise(out))


def test_no_loop_stops_after_one_pass() -> None:
    out = list(schedule(specs([0, 1]), span_s=1, requests=2, speed=1, duration_s=60, loop=False))
    assert len(out) == 2


def test_duration_cuts_first_pass() -> None:
    out = list(schedule(specs([0, 1, 2, 3]), span_s=3, requests=4, speed=1, duration_s=2.0, loop=True))
    assert [s.due_s for s in out] == [0, 1]


def test_trace_is_streamed_once_per_pass() -> None:
    passes = 0

    class Counting:
        def __iter__(self):  # type: ignore[no-untyped-def]
            nonlocal passes
            passes += 1
            yield from specs([0.0, 0.5])

    out = list(schedule(Counting(), span_s=0.5, requests=2, speed=1, duration_s=3.0, loop=True))
    assert len(out) == 6
    assert passes == 3


def test_single_request_trace_loops_each_second() -> None:
    out = list(schedule(specs([0.0]), span_s=0, requests=1, speed=1, duration_s=3, loop=True))
    assert [s.due_s for s in out] == [0, 1, 2]


def test_bad_speed() -> None:
    with pytest.raises(ValueError):
        list(schedule(specs([0]), span_s=0, requests=1, speed=0, duration_s=1, loop=False))
