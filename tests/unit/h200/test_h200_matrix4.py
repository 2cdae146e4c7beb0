"""The control matrix's fourth round on an H200 (tests/data/h200/matrix4, benchmarks/h200_matrix/run.sh
`longctx`, 2026-12-03): where a smaller batch pays. The same engine as the earlier rounds (a Qwen3-8B
shape with dummy weights at 64 requests) on long contexts (longctx_trace.py: ~6k-token prompts from 16
shared documents, 200-400 output tokens, 12 req/s), so a decode step's time grows with the batch; goodput
on TPOT <= 26.46 ms, the midpoint of the TPOT medians that a ceiling of 64 and of 48 measured under the
matmul load (the calibration arms `cal64`, `cal48`); throughput harm acted on; the policy's default
times. `longctx-control0` is the control arm run with the policy as it was (no trial ever started);
`longctx-control` the same arm after the fix, in a second device call with a shorter replay (130 s, the
load 20-115 s) so that it fitted the time left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_h200_matrix2 as m2

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.policies.throttle import ThroughputSettings
from soakd.testing import load_script, recorded_gpu

DATA = Path(__file__).parents[2] / "data" / "h200" / "matrix4"
FIG = load_script(
    Path(__file__).parents[3] / "benchmarks" / "h200_matrix" / "figures.py", "h200_matrix_figures"
)
LIMIT_MS = 26.46
LOADED = ("longctx-control", "longctx-control0", "longctx-advice")
UNDER = (20.0, 115.0)  # seconds of the replay under the load in every loaded arm


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = FIG.load(DATA)
    return arms


def tpot(arm: str) -> dict[str, float]:
    out: dict[str, float] = m2.summary(arm, DATA)["requests"]["tpot"]
    return out


def window(matrix: dict[str, Any], arm: str, span: tuple[float, float]) -> dict[str, float]:
    out: dict[str, float] = matrix[arm]["arm"].window(*span)
    return out


def test_a_48_batch_meets_the_tpot_limit_a_64_batch_misses_under_the_load() -> None:
    """The calibration, both ceilings held under the load all along: TPOT p50 24.06 ms at 48 against
    28.86 at 64 (-17 %: each decode step reads every running sequence's ~6k-token context); at 48 nine
    requests in ten meet the limit (p90 26.09 ms), at 64 fewer than half. What a smaller batch gives up
    on tokens/s is small beside that."""
    at48, at64 = tpot("longctx-cal48"), tpot("longctx-cal64")
    assert at48["p50_ms"] < 0.85 * at64["p50_ms"]
    assert round((at48["p50_ms"] + at64["p50_ms"]) / 2, 2) == LIMIT_MS  # run.sh's midpoint
    assert at48["p90_ms"] < LIMIT_MS < at64["p50_ms"]


def test_yesterdays_policy_never_tried_because_the_clock_loss_sat_at_its_threshold() -> None:
    """longctx-control0: harm from 4 s into the load to 10 s after it (both judges), the ceiling binding,
    and no trial in 150 s. The recorded 10 Hz clock replayed through today's watch: the loss hovered at
    the 10 % threshold, so the harm was "in its tail" (under the level that starts it) in a third or more
    of the seconds, and every 20 s A leg held such a second: the rule that keeps trials out of a harm's
    tail kept them out of the whole load. Over the same seconds the throughput judge read a loss of
    36-64 % with requests waiting (harm now, its cause present): counted, as today's rule counts it,
    the first clean A leg ends 32 s into the load (the clock harm began 14 s in here; in the arm run
    with today's rule, 4 s in, and its trial began at 24 s)."""
    assert not [k for _, k, _ in m2.events("longctx-control0", DATA) if k in ("downscale", "revert")]
    start, end = m2.load_times("longctx-control0", DATA)
    watch = GpuThrottleWatch({0: 1980.0}, lambda *_a, **_f: None)
    fading: dict[int, bool] = {}
    harm: dict[int, bool] = {}
    for _, wall, fast, slow in recorded_gpu(DATA / "longctx-control0" / "nvml.jsonl.gz"):
        watch.observe(0, wall, fast, slow)
        second = int(wall - start)
        if 0 <= second < int(end - start):
            harm[second] = bool(watch.harm())
            fading[second] = fading.get(second, False) or watch.harm_fading()
    began = min(s for s, h in harm.items() if h)
    held = [s for s in sorted(harm) if s >= began]
    assert all(harm[s] for s in held) and began <= 20
    assert sum(fading[s] for s in held) >= len(held) / 3

    def clean_from(ok: dict[int, bool]) -> int | None:
        """The first second that ends 20 s of harm with no tail second in them."""
        for s in held:
            if s - 20 >= began and all(ok.get(x, False) for x in range(s - 19, s + 1)):
                return s
        return None

    assert clean_from({s: not fading[s] for s in held}) is None
    loss = ThroughputSettings().loss
    now = {
        int(ts / 1e9 - start): f.get("throughput_harm") == 1 and float(f.get("throughput_loss", 0)) >= loss
        for name, _tags, f, ts in FIG.FIG.lines(DATA / "longctx-control0" / "spool.lp.gz")
        if name == "control"
    }
    today = clean_from({s: not fading[s] or now.get(s, False) for s in held})
    assert today is not None and today <= 35


def test_todays_trial_keeps_48_where_it_pays() -> None:
    """longctx-control: the trial of 64 -> 48 began 24 s into the load and judged B at 1,974 good tok/s
    against 399 and 24 at 64 before and after it (noise +-347): B above the bracket by 4.4x the noise
    margin; 48 kept 58 s after the trial began, until the replay's end."""
    start, _ = m2.load_times("longctx-control", DATA)
    moves = [
        (t - start, k, f)
        for t, k, f in m2.events("longctx-control", DATA)
        if k in ("downscale", "upscale", "revert")
    ]
    assert [k for _, k, _ in moves] == ["downscale", "revert", "downscale"]
    assert 15 < moves[0][0] < 35 and moves[0][2]["to_limit"] == 48
    (result,) = m2.summary("longctx-control", DATA)["control"]["results"]
    assert (result["verdict"], result["decided_by"], result["kept"]) == ("gain", "aba_bracket", True)
    hi = max(result["before"], result["again"])
    assert result["after"] - hi > 4 * result["noise"] and result["after"] >= 1.03 * hi
    assert m2.summary("longctx-control", DATA)["control"]["ceiling"] == 48


def test_control_beats_advice_only_under_the_load_far_beyond_the_noise(matrix: dict[str, Any]) -> None:
    """20-115 s of each replay, under the load in every arm: goodput 1,035 good tok/s with control
    against 184 advice-only and 139 with yesterday's policy, which moved nothing (5.6x; the noise of two
    arms that made no move: 25 %). The price: tokens/s 3 % below advice-only (2,093 against 2,157; the
    unmoved arms 0.2 % apart, the windows before the load, where nothing moved anywhere, 11 %)."""
    under = {arm: window(matrix, arm, UNDER) for arm in LOADED}
    before = {arm: window(matrix, arm, (0.0, 20.0)) for arm in LOADED}
    noise = m2.spread(under["longctx-advice"]["goodput_tps"], under["longctx-control0"]["goodput_tps"])
    assert noise < 0.3
    for other in ("longctx-advice", "longctx-control0"):
        assert under["longctx-control"]["goodput_tps"] > 5 * under[other]["goodput_tps"]
        assert m2.spread(under["longctx-control"]["tokens_per_s"], under[other]["tokens_per_s"]) < 0.05
    assert (
        m2.spread(under["longctx-advice"]["tokens_per_s"], under["longctx-control0"]["tokens_per_s"]) < 0.01
    )
    tokens_before = [w["tokens_per_s"] for w in before.values()]
    assert m2.spread(max(tokens_before), min(tokens_before)) < 0.15
    # TPOT under the load: the kept 48 below the limit, 64 above it.
    assert under["longctx-control"]["tpot_p50_ms"] < LIMIT_MS < under["longctx-advice"]["tpot_p50_ms"]


@pytest.mark.parametrize("arm", LOADED)
def test_both_judges_follow_the_load_in(arm: str) -> None:
    """Clock harm 4.3-14.2 s after the load began (a loss that sat at its threshold), the throughput judge
    3.4-5.5 s; both over 6.3-10.7 s after the load ended: inside the issue's 30 s everywhere, and the
    throughput judge inside its 5 s in two of three arms (5.5 s in the last)."""
    start, end = m2.load_times(arm, DATA)
    for kind, (t_in, t_out) in m2.one_episode_per_judge(arm, DATA).items():
        assert 0 < t_in - start <= (15.0 if kind == "clock" else 6.0), (arm, kind)
        assert 0 < t_out - end < 30.0, (arm, kind)
