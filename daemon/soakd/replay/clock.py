"""The clock the replay paces on, injectable so tests run in virtual time."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic time for pacing and wall time for timestamps."""

    def monotonic(self) -> float:
        """Seconds on a monotonic clock."""
        ...

    def wall_ns(self) -> int:
        """Nanoseconds since the Unix epoch (for sample timestamps)."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return at (or as soon as possible after) the monotonic time `deadline`."""
        ...


class SystemClock:
    """The real clock. Sleeps to an absolute deadline, so pacing never accumulates drift."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ns(self) -> int:
        return time.time_ns()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


class FakeClock:
    """Virtual time: `sleep_until` jumps the clock forward at once (still yielding to the loop).

    `wall_start_ns` fixes what wall time corresponds to monotonic 0.
    """

    def __init__(self, start: float = 0.0, wall_start_ns: int = 1_700_000_000_000_000_000) -> None:
        self.now = start
        self._wall0 = wall_start_ns - int(start * 1e9)

    def monotonic(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return self._wall0 + int(self.now * 1e9)

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep_until(self, deadline: float) -> None:
        self.now = max(self.now, deadline)
        await asyncio.sleep(0)
