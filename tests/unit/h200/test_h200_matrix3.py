"""The control matrix's third round on an H200 (tests/data/h200/matrix3, benchmarks/h200_matrix/run.sh,
2026-12-03): the SLO-bound case with room for the policy's default times. Four arms on the same engine as
the earlier rounds (a Qwen3-8B shape with dummy weights at 64 requests, goodput on TPOT <= 12.79 ms,
throughput harm acted on), the matmul load from 20 s to 170 s of a 200 s replay, dwell 10 s and legs of
settle 10 s + eval 20 s (twice the second round's): control, advice-only, and each again for the noise.
The question it was run for: with legs twice as long, does the second round's trial (B beat both A legs
by less than the noise) become a smaller batch kept where it pays?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_h200_matrix2 as m2
from test_h200_control_ab import aba_legs, replay_ticks

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.control import Slo
from soakd.policies.downscale import judge_aba
from soakd.testing import load_script, recorded_gpu

DATA = Path(__file__).parents[2] / "data" / "h200" / "matrix3"
FIG = load_script(
    Path(__file__).parents[3] / "benchmarks" / "h200_matrix" / "figures.py", "h200_matrix_figures"
)
ARMS = ("payslong-control", "payslong-advice", "payslong-control2", "payslong-advice2")
CONTROL = ("payslong-control", "payslong-control2")
ADVICE = ("payslong-advice", "payslong-advice2")


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = FIG.load(DATA)
    return arms


def events(arm: str) -> list[tuple[float, str, dict[str, Any]]]:
    return m2.events(arm, DATA)


def summary(arm: str) -> dict[str, Any]:
    return m2.summary(arm, DATA)


def load_times(arm: str) -> tuple[float, float]:
    return m2.load_times(arm, DATA)


def goodput(matrix: dict[str, Any], arm: str, k: int) -> float:
    a = matrix[arm]
    return float(a["arm"].window(*a["spans"][k])["goodput_tps"])


@pytest.mark.parametrize("arm", ARMS)
def test_both_judges_see_the_150_s_load_and_its_end(arm: str) -> None:
    """Clock harm 1.8-2.0 s after the load began, over 10.6-14.1 s after it ended (on the loss); the
    throughput judge 3.8-4.2 s after it began, over 6.1-7.0 s after it ended: inside the issue's 5 s and
    30 s in all four arms, over a load three times as long as the second round's."""
    start, end = load_times(arm)
    for kind in ("clock", "throughput"):
        episode = [
            (t, k)
            for t, k, f in events(arm)
            if k.startswith("harm_") and (f.get("harm_kind") == "throughput") == (kind == "throughput")
        ]
        assert [k for _, k in episode] == ["harm_enter", "harm_leave"], (arm, kind)
        (t_in, _), (t_out, _) = episode
        assert 0 < t_in - start <= 5.0 and 0 < t_out - end < 30.0, (arm, kind)


def test_legs_twice_as_long_find_no_gain_for_the_smaller_batch() -> None:
    """Both control arms tried 64 -> 48 about 21 s into the load and judged it on 20 s legs: B lay between
    the two A legs both times (4,345 between 4,144 and 4,551; 3,993 between 3,464 and 4,442 good tok/s)
    with a noise margin of +-1,445 and +-1,337, two thirds of the second round's +-2,105 on 10 s legs (as
    the square root of the legs' length says). The second round's "B beat both A legs" did not come back:
    on this load a 48-request batch shows no gain an A-B-A can see, so none is kept. The verdicts replay
    from the recorded figures through today's judge."""
    for arm in CONTROL:
        first = summary(arm)["control"]["results"][0]
        assert first["decided_by"] == "aba_bracket" and first["verdict"] == "inconclusive"
        assert not first["kept"] and (first["from"], first["to"]) == (64, 48)
        lo, hi = sorted((first["before"], first["again"]))
        assert lo < first["after"] < hi
        assert 1_000 < first["noise"] < 0.75 * 2_105
        # The replayed verdict: with the recorded legs' noise B is inside the bracket whatever its margin.
        assert first["after"] - hi < 0 < first["after"] - lo


def spread(x: float, y: float) -> float:
    return abs(x - y) / max(x, y)


def test_control_is_within_the_noise_of_advice_only_in_every_window(matrix: dict[str, Any]) -> None:
    """Goodput per window (before, under, after the load), control against advice-only: -2.1 / +10.0 /
    -7.7 % and -7.8 / -6.2 / -25.0 %. The noise beside it, per window: the largest spread between arms
    that made no move in that window (before: all four, 7.8 %; under: the two advice-only arms, 14.0 %;
    after: those and the first control arm, back at 64 since 72 s, 24.9 %). Every control arm lies
    within it; control2's after window (a trial started 10 s after the load ended, while clock harm was
    ending, held 48 for 12 s there) at its edge. Nothing strictly better: on this load no smaller batch
    pays measurably."""
    for k in range(3):
        lo, hi = matrix[ARMS[0]]["spans"][k]
        still = [
            arm
            for arm in ARMS
            if not any(
                k_ in ("downscale", "upscale", "revert")
                and not f.get("dry_run")
                and lo <= t - load_times(arm)[0] + 20 <= hi  # the load began 20 s into the replay
                for t, k_, f in events(arm)
            )
        ]
        assert set(ADVICE) <= set(still), k
        noise = max(spread(goodput(matrix, x, k), goodput(matrix, y, k)) for x in still for y in still)
        assert noise < 0.3
        for c in CONTROL:
            for a in ADVICE:
                assert spread(goodput(matrix, c, k), goodput(matrix, a, k)) <= noise + 0.005, (c, a, k)


def test_a_trial_begun_as_the_harm_ended_would_not_start_today() -> None:
    """control2, live: the block on 48 (80 s) ran out 10 s after the load ended, while the clock loss was
    between half the threshold and the threshold (the episode still open); a trial began at once, the
    harm ended 0.8 s later, and the verdict said so (`harm_ended`, 48 kept, upscaled 11 s later). The
    recorded 10 Hz clock replayed through today's watch: at that second the harm is in its tail
    (`harm_fading`), where no trial starts now; at the first trial's second it was not."""
    _, end = load_times("payslong-control2")
    moves = [(t, k) for t, k, f in events("payslong-control2") if k in ("downscale", "upscale")]
    assert [k for _, k in moves] == ["downscale", "downscale", "upscale"]
    first, late = moves[0][0], moves[1][0]
    assert 5.0 < late - end < 15.0
    results = summary("payslong-control2")["control"]["results"]
    assert results[1]["decided_by"] == "harm_ended" and results[1]["kept"]
    watch = GpuThrottleWatch({0: 1980.0}, lambda *_a, **_f: None)
    seen: dict[str, tuple[str, bool]] = {}
    for _, wall, fast, slow in recorded_gpu(DATA / "payslong-control2" / "nvml.jsonl.gz"):
        watch.observe(0, wall, fast, slow)
        for name, at in (("first", first), ("late", late)):
            if name not in seen and wall >= at:
                seen[name] = (watch.harm(), watch.harm_fading())
    assert seen["first"] == ("power", False)
    assert seen["late"] == ("power", True)


def null_trials(effect: float) -> list[Any]:
    """A-B-A legs at the policy's default times (A 20 s, settle 10 s, B 20 s, settle 10 s, A' 20 s) cut
    from the two advice-only arms inside the load, where nothing moved; `effect` scales B's tokens."""
    out = []
    for arm in ADVICE:
        ticks = [t for t in replay_ticks(arm, Slo(tpot_s=0.01279), data=DATA) if t.binding]
        start, end = load_times(arm)
        for k in range(len(ticks) - 80):
            t0, t1 = ticks[k].t_s, ticks[k + 79].t_s
            if t1 - t0 > 85 or not start + 5 <= t0 < t1 <= end:
                continue
            out.append(aba_legs(ticks, k, effect))
    return out


def test_what_20_s_legs_can_see_on_this_load() -> None:
    """132 null trials at the default times inside the load: none read as a goodput gain. A real effect
    on B: +30 % goodput is a gain in 39 %, +50 % in 74 %, -30 % never; tokens see +15 % in 84 % (4 % of
    the null trials read as a tokens gain). The two live trials measured B at +0 % and +1 % of their
    brackets' midpoints: whatever 48 requests gain on this load is far below what the judge can see,
    and the measured effect is about nothing."""
    null = null_trials(1.0)
    assert len(null) == 132

    def share(trials: list[Any], objective: str, verdict: str) -> float:
        got = [judge_aba(objective, 0.03, *legs) for legs in trials]
        return sum(1 for v in got if v is not None and v.verdict == verdict) / len(trials)

    assert share(null, "goodput", "gain") == 0.0
    assert share(null, "tokens", "gain") <= 0.05
    assert 0.25 <= share(null_trials(1.3), "goodput", "gain") <= 0.55
    assert share(null_trials(1.5), "goodput", "gain") >= 0.6
    assert share(null_trials(0.7), "goodput", "gain") == 0.0
    assert share(null_trials(1.15), "tokens", "gain") >= 0.75
    for arm in CONTROL:
        first = summary(arm)["control"]["results"][0]
        mid = (first["before"] + first["again"]) / 2
        assert abs(first["after"] / mid - 1) < 0.05
