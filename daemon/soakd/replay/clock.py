"""The clock the replay paces on, injectable so tests run in virtual time."""

from __future__ import annotations

import asyncio
import heapq
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
    """Virtual time for tests: sleepers wake in deadline order, and time jumps to the next deadline
    once every runnable task has had its turn, so a minute of pacing takes milliseconds.

    `wall_start_ns` fixes which wall time corresponds to monotonic 0.
    """

    # Loop iterations granted to woken tasks before time jumps again; enough for a request to pass
    # the admission gate and reach its next sleep.
    _SETTLE_ROUNDS = 50

    def __init__(self, start: float = 0.0, wall_start_ns: int = 1_700_000_000_000_000_000) -> None:
        self.now = start
        self._wall0 = wall_start_ns - int(start * 1e9)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._ticker: asyncio.Task[None] | None = None

    def monotonic(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return self._wall0 + int(self.now * 1e9)

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= self.now:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._sleepers, (deadline, self._seq, fut))
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())
        await fut

    async def _tick(self) -> None:
        while self._sleepers:
            for _ in range(self._SETTLE_ROUNDS):
                await asyncio.sleep(0)
            deadline, _, fut = heapq.heappop(self._sleepers)
            if fut.done():
                continue  # its sleeper was cancelled
            self.now = max(self.now, deadline)
            fut.set_result(None)
