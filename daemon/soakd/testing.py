"""Fakes for tests of soakd and of code built on it: clocks that tests move by hand. (The replay's
virtual-time clock, which wakes sleepers in order, is soakd.replay.clock.FakeClock.)"""

from __future__ import annotations

import asyncio


class ManualClock:
    """A monotonic clock (call it) that moves only when told: `now` is set, or `sleep` advances it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class ManualTime(ManualClock):
    """A ManualClock with the asyncio sleep a component awaits: backoffs and timeouts pass at once,
    and every sleep still yields to the event loop, as a real one does."""

    async def sleep(self, seconds: float) -> None:  # type: ignore[override]
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)
