"""The concurrency ceiling: how many requests may be in the engine at once (the batch-downscale lever)."""

from __future__ import annotations

import asyncio


class AdmissionGate:
    """A semaphore whose limit can be lowered and raised while requests are in flight.

    Lowering never cancels running requests: it only stops new ones until enough have finished.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("admission limit must be >= 1")
        self._limit = limit
        self._in_flight = 0
        self._cond = asyncio.Condition()
        self.peak_in_flight = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def set_limit(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("admission limit must be >= 1")
        async with self._cond:
            self._limit = limit
            self._cond.notify_all()

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self._in_flight < self._limit)
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)

    async def release(self) -> None:
        async with self._cond:
            if self._in_flight <= 0:
                raise RuntimeError("release() without acquire()")
            self._in_flight -= 1
            self._cond.notify()
