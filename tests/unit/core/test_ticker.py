"""The fixed-rate ticker: calls on absolute deadlines, skips and counts missed slots, survives errors."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from soakd.ticker import Ticker


def test_calls_at_the_rate_skip_missed_slots_and_survive_errors() -> None:
    calls: list[float] = []

    def fn() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            time.sleep(0.06)  # six periods late: those slots are skipped, not crammed in afterwards
        if len(calls) == 5:
            raise RuntimeError("one bad sample")

    async def main() -> Ticker:
        t = Ticker("t", 0.01, fn)
        t.start()
        await asyncio.sleep(0.3)
        t.stop()
        n = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == n  # nothing after stop
        return t

    t = asyncio.run(main())
    assert t.errors == 1 and t.runs == len(calls)
    assert t.missed >= 4
    # 30 slots in 0.3 s: every one either ran or was counted missed (the loop may run one late).
    assert 28 <= t.runs + t.missed <= 32
    gaps = [b - a for a, b in itertools.pairwise(calls[3:])]
    assert max(gaps) < 0.06  # after the stall, back on the grid rather than a burst of catch-up calls


def test_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="period_s"):
        Ticker("t", 0.0, lambda: None)
