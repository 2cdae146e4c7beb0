"""The fixed-rate ticker: calls on absolute deadlines, skips and counts missed slots, survives errors."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from soakd.ticker import Ticker


def test_calls_at_the_rate_skip_missed_slots_and_survive_errors() -> None:
    period = 0.01
    calls: list[tuple[float, float]] = []  # (when fn ran, how late the ticker said it was)
    ticker: list[Ticker] = []

    def fn() -> None:
        calls.append((time.monotonic(), ticker[0].lag_s))
        if len(calls) == 3:
            time.sleep(0.06)  # six periods late: those slots are skipped, not crammed in afterwards
        if len(calls) == 5:
            raise RuntimeError("one bad sample")

    async def main() -> tuple[Ticker, float, float]:
        t = Ticker("t", period, fn)
        ticker.append(t)
        t_start = time.monotonic()
        t.start()
        await asyncio.sleep(0.3)
        t.stop()
        t_stop = time.monotonic()
        n = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == n  # nothing after stop
        return t, t_start, t_stop

    t, t_start, t_stop = asyncio.run(main())
    assert t.errors == 1 and t.runs == len(calls)
    assert t.missed >= 4
    # Every slot up to the last call either ran or was counted missed, and none after the stop: bounds
    # from the times measured here (a busy machine's loop runs late and longer, never off the grid).
    ran = [when for when, _ in calls]
    assert int((ran[-1] - ran[0]) / period) <= t.runs + t.missed <= (t_stop - t_start) / period + 1
    # Back on the grid after the stall rather than a burst of catch-up calls: each call has a slot of its
    # own (its deadline, when it ran less how late it was, a period after the one before).
    deadlines = [when - lag for when, lag in calls]
    assert all(b - a > period / 2 for a, b in itertools.pairwise(deadlines)), deadlines


def test_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="period_s"):
        Ticker("t", 0.0, lambda: None)
