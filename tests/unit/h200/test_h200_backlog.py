"""The throughput judge on every recorded H200 arm of the control rounds (control_ab, control_pays and
matrix 1-4, the data the backlog's thresholds were chosen on; matrix 6 and 8, recorded after, held out), with
and without the requests in the engine: a backlog growing inside the engine (no queue for admission yet)
is read as capacity, so a shared load is seen before the batch fills. In round 4's fixed control arm the
load cut tokens/s from ~4.5k to 0.4k at once while the engine's requests rose 30 -> 64 over 3.5 s with
nobody waiting; the judge, which read capacity only with a queue, fired 5.5 s in."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import test_h200_control_ab as ab

from soakd.policies.throttle import ThroughputJudge

H200 = Path(__file__).parents[2] / "data" / "h200"
ROUNDS = ("control_ab", "control_pays", "matrix", "matrix2", "matrix3", "matrix4", "matrix6", "matrix8")
HELD_OUT = ("matrix6", "matrix8")  # recorded after the backlog's thresholds were chosen
ARMS = sorted(
    (p.parent.parent.name, p.parent.name)
    for r in ROUNDS
    for p in (H200 / r).glob("*/spool.lp.gz")
    if not p.parent.name.startswith("longctx-cal")  # the load over the whole replay: no load-free start
)
LOADED = [a for a in ARMS if (H200 / a[0] / a[1] / "times.json").exists()]
LOAD_FREE = [a for a in ARMS if a not in LOADED]


def in_flight(folder: Path) -> dict[int, int | None]:
    """Per second: the replay's pending requests (sent or waiting, not finished); None once it stopped
    dispatching (`ControlInputs.draining`)."""
    end = ab.dispatch_end(folder)
    out: dict[int, int | None] = {}
    with gzip.open(folder / "spool.lp.gz", "rt") as f:
        for line in f:
            if line.startswith("replay,"):
                rest, ts = line.rstrip("\n").rsplit(" ", 1)
                fields = dict(kv.split("=", 1) for kv in rest.split(" ", 1)[1].split(",") if "=" in kv)
                sec = int(ts) // 1_000_000_000
                out[sec] = int(fields["pending"].rstrip("i")) if sec < end else None
    return out


def judged(round_: str, arm: str, *, with_flight: bool) -> tuple[ThroughputJudge, list[tuple[float, bool]]]:
    folder = H200 / round_ / arm
    ticks, _ = ab.throughput_inputs(arm, folder.parent)
    flight = in_flight(folder) if with_flight else {}
    judge = ThroughputJudge()
    changes = []
    for t, tps, binding, limited in ticks:
        c = judge.update(t, tps, binding=binding, limited=limited, in_flight=flight.get(int(t)))
        if c is not None:
            changes.append((t, c))
    return judge, changes


def first_harm(round_: str, arm: str, *, with_flight: bool) -> float:
    start, end = load_times(round_, arm)
    _, changes = judged(round_, arm, with_flight=with_flight)
    began = [t for t, c in changes if c]
    ended = [t for t, c in changes if not c]
    assert began and ended and 0 <= ended[0] - end <= 15.0, (round_, arm)
    return began[0] - start


def load_times(round_: str, arm: str) -> tuple[float, float]:
    times = json.loads((H200 / round_ / arm / "times.json").read_text())
    return float(times["load_start"]), float(times["load_end"])


def test_every_recorded_arm_is_found() -> None:
    assert len(LOADED) == 28 and len(LOAD_FREE) == 10


@pytest.mark.parametrize(("round_", "arm"), LOADED)
def test_a_shared_load_is_seen_within_5_s_with_the_backlog_and_never_later_than_without(
    round_: str, arm: str
) -> None:
    """28 loaded arms: the harm begins 1.9-4.1 s after the load with the requests in the engine (2.2-5.0 s
    without them), and ends within 15 s of it either way. The 21 arms the thresholds were chosen on stay
    under 3.7 s; of the seven held out (rounds 6 and 8), two took 4.1 s both ways: the load came as the
    trace's requests in the engine were falling (round 6: ~80 to ~40), so the rise it caused (39 -> 48 ->
    61) stayed under the median of the 10 s before (65) until an admission queue formed anyway (4.9 s
    live, the tick's phase). Against the lowest of those 10 s instead of the median every arm is inside
    3.7 s, but the two load-free long-context arms read a backlog in 25 and 30 intervals (2 and 5 with
    the median): not taken."""
    with_flight = first_harm(round_, arm, with_flight=True)
    without = first_harm(round_, arm, with_flight=False)
    assert 0 <= with_flight <= (5.0 if round_ in HELD_OUT else 3.7), (round_, arm, with_flight)
    assert with_flight <= without, (round_, arm)


def test_the_backlog_is_what_brings_the_slowest_arms_inside_4_s() -> None:
    """Without the requests in the engine the slowest arms took 4.2-4.7 s (round 4's fixed arm 4.6 s on
    this per-second replay, 5.5 s live); with them, under 4 s (the rounds the thresholds were chosen on)."""
    slow = {a: first_harm(*a, with_flight=False) for a in LOADED if a[0] not in HELD_OUT}
    late = [a for a, s in slow.items() if s > 4.0]
    assert ("matrix4", "longctx-control") in late and len(late) >= 3
    for a in late:
        assert first_harm(*a, with_flight=True) < 4.0, a


@pytest.mark.parametrize(("round_", "arm"), LOAD_FREE)
def test_no_throughput_harm_in_a_load_free_arm(round_: str, arm: str) -> None:
    """Ten load-free arms (the engine alone at 16 and 64 requests, at the power cap in many seconds):
    no episode with the requests in the engine either."""
    judge, changes = judged(round_, arm, with_flight=True)
    assert changes == [] and judge.episodes == 0, (round_, arm)
