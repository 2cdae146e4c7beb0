"""The loop watch on a real event loop: a blocked loop is measured as lag, a lasting one is an event."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import soakd
from soakd.loopblame import StallBlame, owner_of
from soakd.loopwatch import LoopWatch
from soakd.ticker import Ticker


def hold_the_loop(seconds: float) -> None:
    """What a busy front end does to the loop: nothing else runs meanwhile (on purpose, here)."""
    time.sleep(seconds)


async def loop_lag_now() -> float:
    """How late this machine runs the loop's timers now: the worst of 0.3 s of 10 ms ticks (a free loop's
    lag, which a busy machine makes larger; the real-time thresholds below scale with it)."""
    lags: list[float] = []
    probe = Ticker("probe", 0.01, lambda: lags.append(probe.lag_s))
    probe.start()
    await asyncio.sleep(0.3)
    probe.stop()
    return max(lags, default=0.0) + 0.01 * probe.missed


def test_a_loop_held_up_is_saturated_then_ok_and_only_while_active() -> None:
    events: list[tuple[str, str, dict[str, Any]]] = []
    active = [False]
    points: list[dict[str, Any]] = []
    scales: list[float] = []

    async def scenario() -> LoopWatch:
        # 1 on an idle machine (its free loop runs under 10 ms late); beside other work the tick, the
        # limit and the holds grow with the lag measured, so a free loop still reads as free.
        scale = max(1.0, await loop_lag_now() / 0.01)
        scales.append(scale)
        mono = [100.0]
        watch = LoopWatch(
            lambda kind, msg, **f: events.append((kind, msg, f)),
            lambda: active[0],
            period_s=0.05 * scale,
            limit_s=0.1 * scale,
            enter_after_s=0.5,
            leave_after_s=0.5,
            clock=lambda: mono[0],
        )
        watch.ticker.start()

        def collect() -> None:
            mono[0] += 0.25  # the collector's interval, on the monotonic clock
            # The wall clock stepped back an hour (NTP): not a late loop, and the point keeps its time.
            (sample,) = watch.collect(1_000_000_000 if len(points) == 3 else 2_000_000_000 + len(points))
            assert sample.measurement == "loop"
            points.append(dict(sample.fields))

        collect()
        await asyncio.sleep(0.3 * scale)
        collect()  # a free loop: a few ms at most
        for _ in range(3):  # held up, but not judged: an engine start holds the loop on purpose
            hold_the_loop(0.3 * scale)
            await asyncio.sleep(0.06 * scale)
            collect()
        assert not events
        active[0] = True
        for _ in range(3):  # held up for 3 x 0.25 s of judged time: over the 0.5 s it takes
            hold_the_loop(0.3 * scale)
            await asyncio.sleep(0.06 * scale)
            collect()
        assert [e[0] for e in events] == ["harness_saturated"]
        for _ in range(3):
            await asyncio.sleep(0.25 * scale)
            collect()
        watch.ticker.stop()
        return watch

    watch = asyncio.run(scenario())
    watch.close()  # its stall watchdog's thread
    (scale,) = scales
    assert points[1]["lag_ms_max"] < 100 * scale and points[1]["saturated"] == 0, (scale, points)
    assert all(p["lag_ms_max"] >= 200 * scale for p in points[2:8]), points
    # Entered after two judged bad intervals (0.5 s), left after two clean ones; the late time is the
    # judged bad intervals themselves (not the episode's detection and clearing time).
    assert [p["saturated"] for p in points] == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0], (scale, points)
    assert [p["late_s"] for p in points] == [0, 0, 0, 0, 0, 0.25, 0.25, 0.25, 0, 0, 0], (scale, points)
    kinds = [e[0] for e in events]
    assert kinds == ["harness_saturated", "harness_ok"], kinds
    saturated = events[0]
    assert "latencies and pacing measured meanwhile include soakd's own delay" in saturated[1]
    assert saturated[2]["lag_ms_max"] >= 200 * scale
    s = watch.summary()
    stalls = s.pop("stall_s")
    assert s.pop("stall_places") == {}  # the test's own code: no owner, no place
    assert s == {"late_s": 0.75, "episodes": 1, "worst_lag_ms": s["worst_lag_ms"], "state": "ok"}
    # The holds were this test's own code: neither soakd's nor the engine's.
    assert isinstance(stalls, dict) and stalls["other"] > 0 and stalls["soakd"] == stalls["engine"] == 0
    assert abs(sum(p["stall_other_s"] for p in points) - stalls["other"]) < 0.01  # rounded per point


def test_saturated_is_not_said_while_not_judged_and_the_metric_sums_late_time() -> None:
    from soakd.judge.metrics import RunMetrics

    events: list[str] = []
    active = [True]
    mono = [0.0]
    watch = LoopWatch(
        lambda kind, msg, **f: events.append(kind),
        lambda: active[0],
        limit_s=0.1,
        enter_after_s=1.0,
        leave_after_s=30.0,
        clock=lambda: mono[0],
    )
    metrics = RunMetrics()
    flags = []
    for step in range(6):
        mono[0] += 1.0
        watch.ticker.lag_s = 0.5  # as a late loop leaves it
        watch._tick()
        active[0] = step < 3  # the replay ends (or a rebuild begins) after three seconds
        (sample,) = watch.collect(step * 10**9)
        metrics.add(sample)
        flags.append(sample.fields["saturated"])
    watch.close()
    assert events == ["harness_saturated"]
    assert flags == [0, 1, 1, 0, 0, 0]  # still saturated inside, but not judged: not said
    assert metrics.scalar("harness_saturated_s") == 2.0  # the judged late seconds (the first is priming)


def _held_in(path: str) -> Any:
    """A function that holds the loop, as if defined in the file at `path` (whose owner it takes)."""
    scope: dict[str, Any] = {"time": time}
    exec(compile("def hold(s):\n    time.sleep(s)\n", path, "exec"), scope)
    return scope["hold"]


def test_a_stall_is_charged_to_the_code_that_held_the_loop() -> None:
    """Who held the loop while it was stalled: a frame of vLLM's (or torch's) is the engine's, one of
    soakd's package is soakd's, anything else (this test) other; the innermost owned frame decides. A
    free loop is charged nothing."""
    root = Path(soakd.__file__).resolve().parent
    engine = _held_in("/opt/venv/lib/python3.11/site-packages/vllm/v1/engine/output_processor.py")
    ours = _held_in(str(root / "replay" / "runner.py"))
    blame = StallBlame(0.02, limit_s=0.02, sample_s=0.01)

    async def scenario() -> list[dict[str, float]]:
        beats = Ticker("beat", 0.02, blame.beat)
        beats.start()
        taken = []
        await asyncio.sleep(0.2)
        taken.append(blame.take())  # free
        for hold in (engine, ours, hold_the_loop):
            hold(0.4)
            await asyncio.sleep(0.05)
            taken.append(blame.take())
        beats.stop()
        return taken

    try:
        free, by_engine, by_soakd, by_other = asyncio.run(scenario())
    finally:
        blame.close()
    # A heartbeat that stopped (the ticker at the run's end) is no stall, however long ago it beat.
    stopped = StallBlame(0.01, beating=lambda: False, sample_s=0.01)
    stopped.beat()
    time.sleep(0.2)
    stopped.close()
    assert sum(stopped.total_s.values()) == 0
    assert sum(free.values()) == 0
    for taken, owner in ((by_engine, "engine"), (by_soakd, "soakd"), (by_other, "other")):
        # Most of each 0.4 s hold is charged, all of it to its owner (a busy machine may add a little
        # "other" around it: the loop waiting to be scheduled).
        assert taken[owner] > 0.2 and taken[owner] == max(taken.values()), (owner, taken)
        assert all(v == 0 for k, v in taken.items() if k not in (owner, "other")), (owner, taken)
    assert owner_of(None) == "other"
    # Each owned hold is named by its file and function; "other" has no place.
    places = blame.top()
    assert set(places) == {"engine vllm/v1/engine/output_processor.py:hold", "soakd replay/runner.py:hold"}
    assert all(v > 0.2 for v in places.values()), places
