"""A fixed-rate callback on the event loop: absolute deadlines, missed slots skipped and counted.

The GPU's fast tier runs at 10 Hz for eight hours. An APScheduler interval job costs ~0.65 % of one
core at 10 Hz before it does any work (a coroutine, a job lookup and a thread-safe wakeup per run,
measured on a 2-core VM); a plain `loop.call_at` timer costs ~0.2 %. Deadlines are `start + k *
period`, so the rate does not drift with the callback's own time, and a slot whose deadline passed
while the callback (or the loop) was busy is skipped, not crammed in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class Ticker:
    """Calls `fn()` every `period_s` on the running loop from `start()` until `stop()`."""

    def __init__(self, name: str, period_s: float, fn: Callable[[], None]) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be positive")
        self.name = name
        self.period_s = period_s
        self._fn = fn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._t0 = 0.0
        self._slot = 0
        self.runs = 0
        self.missed = 0
        """Slots skipped because their deadline had passed."""
        self.errors = 0
        """Calls that raised (logged the first time and every 1000th, then counted)."""
        self.lag_s = 0.0
        """How late the loop ran the current call (seconds after its deadline); read by `fn`."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._slot = 0
        self._handle = self._loop.call_at(self._t0, self._tick)

    def _tick(self) -> None:
        loop = self._loop
        assert loop is not None
        self.lag_s = max(0.0, loop.time() - (self._t0 + self._slot * self.period_s))
        try:
            self._fn()
        # One failed sample must not end eight hours of sampling; it is counted and said.
        except Exception as err:  # noqa: BLE001
            self.errors += 1
            if self.errors == 1 or self.errors % 1000 == 0:
                log.warning("ticker_call_failed", ticker=self.name, errors=self.errors, error=repr(err)[:200])
        self.runs += 1
        self._slot += 1
        behind = int((loop.time() - self._t0) / self.period_s) - self._slot
        if behind > 0:
            self.missed += behind
            self._slot += behind
        self._handle = loop.call_at(self._t0 + self._slot * self.period_s, self._tick)

    @property
    def running(self) -> bool:
        """Started and not stopped."""
        return self._handle is not None

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
