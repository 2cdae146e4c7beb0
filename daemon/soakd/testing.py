"""Fakes for tests of soakd and of code built on it: clocks that tests move by hand, and an HTTP app
served on a free loopback port. (The replay's virtual-time clock, which wakes sleepers in order, is
soakd.replay.clock.FakeClock.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """`app` on 127.0.0.1 at a port the kernel picks; yields its base URL ("http://127.0.0.1:PORT"), and
    closes every connection when the block ends."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


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
