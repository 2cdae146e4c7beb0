"""The clock the replay paces on, injectable so tests run in virtual time."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import threading
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

    async def sleep_until(self, deadline: float, precise: bool = True) -> None:
        """Return at (or as soon as possible after) the monotonic time `deadline`.

        `precise=False`: a millisecond or so late is fine (a wake-up ahead of the real deadline).
        """
        ...


class _Alarm:
    """One thread that wakes event-loop futures at precise monotonic deadlines.

    asyncio's selector rounds its timeout up to whole milliseconds (epoll_wait takes milliseconds), so
    a replay paced by `asyncio.sleep` alone is up to ~1 ms late on every request. A thread's timed
    condition wait has microsecond resolution; the thread wakes the loop through its self-pipe
    (`call_soon_threadsafe`), which epoll sees at once. Only the last couple of milliseconds before a
    deadline go through here; longer waits stay plain `asyncio.sleep`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None

    def wait_until(self, deadline: float) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (deadline, self._seq, loop, fut))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="soakd-pacer", daemon=True)
                self._thread.start()
            self._cond.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline = self._heap[0][0]
                delay = deadline - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue  # re-check: an earlier deadline may have arrived meanwhile
                _, _, loop, fut = heapq.heappop(self._heap)
            with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile
                loop.call_soon_threadsafe(_wake, fut)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # a cancelled sleeper
        fut.set_result(None)


_ALARM = _Alarm()
# The share of a wait left to the alarm thread: more than the selector's 1 ms rounding plus a timer tick.
_FINE_S = 0.002


class SystemClock:
    """The real clock. Sleeps to an absolute deadline, so pacing never accumulates drift, and wakes
    within tens of microseconds of it (see _Alarm) instead of asyncio's millisecond granularity."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ns(self) -> int:
        return time.time_ns()

    async def sleep_until(self, deadline: float, precise: bool = True) -> None:
        delay = deadline - time.monotonic()
        if delay <= 0:
            # Behind schedule: still yield, or a replay far behind (a high speed, a slow host) never
            # lets the duration timer, a signal handler or the collectors run.
            await asyncio.sleep(0)
            return
        if not precise:
            await asyncio.sleep(delay)
            return
        if delay > _FINE_S:
            await asyncio.sleep(delay - _FINE_S)
        if deadline > time.monotonic():
            await _ALARM.wait_until(deadline)


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

    async def sleep_until(self, deadline: float, precise: bool = True) -> None:
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
