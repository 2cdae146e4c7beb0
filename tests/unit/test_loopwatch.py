"""The loop watch on a real event loop: a blocked loop is measured as lag, a lasting one is an event."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from soakd.loopwatch import LoopWatch


def hold_the_loop(seconds: float) -> None:
    """What a busy front end does to the loop: nothing else runs meanwhile (on purpose, here)."""
    time.sleep(seconds)


def test_a_loop_held_up_is_saturated_then_ok_and_only_while_active() -> None:
    events: list[tuple[str, str, dict[str, Any]]] = []
    active = [False]
    points: list[dict[str, Any]] = []

    async def scenario() -> LoopWatch:
        watch = LoopWatch(
            lambda kind, msg, **f: events.append((kind, msg, f)),
            lambda: active[0],
            period_s=0.05,
            limit_s=0.1,
            enter_after_s=0.5,
            leave_after_s=0.5,
        )
        watch.ticker.start()
        now = [0]

        def collect() -> None:
            now[0] += 250_000_000  # the collector's interval, 0.25 s
            (sample,) = watch.collect(now[0])
            assert sample.measurement == "loop"
            points.append(dict(sample.fields))

        collect()
        await asyncio.sleep(0.3)
        collect()  # a free loop: a few ms at most
        for _ in range(3):  # held up, but not judged: an engine start holds the loop on purpose
            hold_the_loop(0.3)
            await asyncio.sleep(0.06)
            collect()
        assert not events
        active[0] = True
        for _ in range(3):  # held up for 3 x 0.25 s of judged time: over the 0.5 s it takes
            hold_the_loop(0.3)
            await asyncio.sleep(0.06)
            collect()
        assert [e[0] for e in events] == ["harness_saturated"]
        for _ in range(3):
            await asyncio.sleep(0.25)
            collect()
        watch.ticker.stop()
        return watch

    watch = asyncio.run(scenario())
    assert points[1]["lag_ms_max"] < 100 and points[1]["saturated"] == 0
    assert all(p["lag_ms_max"] >= 200 for p in points[2:8]), points
    # Entered after two judged bad intervals (0.5 s), left after two clean ones.
    assert [p["saturated"] for p in points] == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0]
    kinds = [e[0] for e in events]
    assert kinds == ["harness_saturated", "harness_ok"], kinds
    saturated = events[0]
    assert "latencies and pacing measured meanwhile include soakd's own delay" in saturated[1]
    assert saturated[2]["lag_ms_max"] >= 200
    s = watch.summary()
    assert s == {"saturated_s": 0.75, "episodes": 1, "worst_lag_ms": s["worst_lag_ms"], "state": "ok"}
