"""Says when soakd's own event loop falls behind, so that a run's latencies are not trusted blindly.

With `engine.kind = "vllm-local"`, vLLM's front end runs on soakd's event loop. On an H200 at ~11k
tokens/s it held soakd's one core at 100 %: outputs arrived coalesced, admission lagged the trace by
seconds and the GPU's fast tier skipped a fifth of its samples, while TTFT and TPOT still looked like
numbers. A 4 Hz timer measures how late the loop runs it; the `loop` series carries the lag each
interval, and lag over `limit` for `enter_after` seconds is a `harness_saturated` event (cleared by
`harness_ok` after `leave_after` clean seconds). Judged only while `active()` says so: an in-process
engine start holds the loop on purpose. `late_s` (each point's judged seconds over the limit, summed by
the run metric `harness_saturated_s`) counts the late time itself, not the episode's state. The ticker
is also the heartbeat of soakd.loopblame: stall seconds by whose code held the loop (soakd's, the
in-process engine's, other) on each point (`stall_<owner>_s`) and in the summary.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from soakd.loopblame import OWNERS, StallBlame
from soakd.metric import FieldValue, Sample
from soakd.ticker import Ticker

EventFn = Callable[..., None]


class LoopWatch:
    """A collector (`loop`) and the ticker that feeds it."""

    name = "loop"

    def __init__(
        self,
        on_event: EventFn,
        active: Callable[[], bool],
        *,
        period_s: float = 0.25,
        limit_s: float = 0.25,
        enter_after_s: float = 5.0,
        leave_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ticker = Ticker("loop", period_s, self._tick)
        # Real time (its watchdog thread waits in it); no stall once the ticker stopped (the run's end).
        self.blame = StallBlame(period_s, beating=lambda: self.ticker.running)
        self._event = on_event
        self._active = active
        self._limit_s = limit_s
        self._enter_after = enter_after_s
        self._leave_after = leave_after_s
        self._max = 0.0
        self._sum = 0.0
        self._n = 0
        self._missed = 0
        self._bad_s = 0.0  # consecutive judged seconds over the limit, while not saturated
        self._good_s = 0.0  # consecutive judged seconds within it, while saturated
        self._clock = clock
        self._last_t: float | None = None  # monotonic: a wall-clock step is not a late loop
        self.saturated = False
        self.late_s = 0.0
        """Judged seconds with the loop over its limit (or skipping ticks), over the run."""
        self.episodes = 0
        self.worst_lag_s = 0.0

    def _tick(self) -> None:
        self.blame.beat()
        lag = self.ticker.lag_s
        self._max = max(self._max, lag)
        self._sum += lag
        self._n += 1

    def collect(self, now_ns: int) -> list[Sample]:
        now = self._clock()
        interval = 0.0 if self._last_t is None else max(0.0, now - self._last_t)
        self._last_t = now
        # Slots the ticker skipped were at least a period late each: the loop could not run it at all.
        missed = self.ticker.missed - self._missed
        self._missed = self.ticker.missed
        worst = max(self._max, self.ticker.period_s if missed else 0.0)
        fields: dict[str, FieldValue] = {
            "lag_ms_max": 1000.0 * worst,
            "lag_ms_mean": 1000.0 * self._sum / self._n if self._n else 0.0,
            "ticks": self._n,
            "missed": missed,
        }
        self._max, self._sum, self._n = 0.0, 0.0, 0
        for owner, seconds in self.blame.take().items():
            fields[f"stall_{owner}_s"] = round(seconds, 3)
        active = self._active()
        late = 0.0
        if active and interval > 0:
            late = self._judge(worst, missed, interval)
        else:
            self._bad_s = self._good_s = 0.0
        fields["late_s"] = late
        # Not judged (an engine starting, the replay over): not said to be saturated either.
        fields["saturated"] = int(self.saturated and active)
        return [Sample("loop", fields, now_ns)]

    def _judge(self, worst: float, missed: int, interval: float) -> float:
        """Update the episode state; return the seconds of this interval the loop was late."""
        self.worst_lag_s = max(self.worst_lag_s, worst)
        bad = worst > self._limit_s or missed > 0
        late = interval if bad else 0.0
        self.late_s += late
        if self.saturated:
            self._good_s = 0.0 if bad else self._good_s + interval
            if self._good_s >= self._leave_after:
                self.saturated = False
                self._bad_s = 0.0
                self._event(
                    "harness_ok",
                    f"soakd's event loop kept up for {self._good_s:.0f} s",
                    lag_ms_max=1000.0 * worst,
                )
            return late
        self._bad_s = self._bad_s + interval if bad else 0.0
        if self._bad_s >= self._enter_after:
            self.saturated = True
            self.episodes += 1
            self._good_s = 0.0
            self._event(
                "harness_saturated",
                f"soakd's event loop ran late for {self._bad_s:.0f} s (lag up to {1000.0 * worst:.0f} ms): "
                "latencies and pacing measured meanwhile include soakd's own delay",
                lag_ms_max=1000.0 * worst,
                missed_ticks=missed,
                **{f"stall_{owner}_s": round(self.blame.total_s[owner], 3) for owner in OWNERS},
            )
        return late

    def summary(self) -> dict[str, object]:
        return {
            "late_s": round(self.late_s, 3),
            "episodes": self.episodes,
            "worst_lag_ms": round(1000.0 * self.worst_lag_s, 1),
            "state": "saturated" if self.saturated else "ok",
            # Whose code held the loop while it was stalled, over the run (soakd.loopblame).
            "stall_s": {owner: round(self.blame.total_s[owner], 3) for owner in OWNERS},
            # ... and in which of their functions, the longest first.
            "stall_places": self.blame.top(),
        }

    def close(self) -> None:
        self.blame.close()
