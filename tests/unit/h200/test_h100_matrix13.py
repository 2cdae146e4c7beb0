"""The control matrix's thirteenth round, on an H100 (tests/data/h100/matrix13, benchmarks/h200_matrix/run.sh
`longctx`, 2026-12-07): round 12's long-context scenario (the whole 230 s trace, a 120 s matmul load from
20 s in, goodput on TPOT <= 26.46 ms) with the policy that goes back up in the tick the harm ends, live:
control, then advice-only, on one machine. What it shows: the upscale came 0.4 s after the harm ended
(round 12's recorded one: 11 s), and what control still costs after the load is not that wait but the
first half-minute back at 64 (the admitted long prompts' prefill), even by 180 s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_h200_matrix2 as m2
import test_h200_matrix6 as m6
from test_h200_matrix4 import window

DATA = Path(__file__).parents[2] / "data" / "h100" / "matrix13"
ROUND12 = Path(__file__).parents[2] / "data" / "h100" / "matrix12"
CONTROL = "longctx-control"
ADVICE = "longctx-advice"
LOADED = (CONTROL, ADVICE)
UNDER = (20.0, 140.0)
AFTER = (140.0, 230.0)  # both replays ran past 235 s


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = m6.FIG.load(DATA)
    return arms


def share(matrix: dict[str, Any], span: tuple[float, float], key: str = "tokens_per_s") -> float:
    """Control's figure over `span` against advice-only's, as a change (+0.05: 5 % above)."""
    return window(matrix, CONTROL, span)[key] / window(matrix, ADVICE, span)[key] - 1


@pytest.mark.parametrize("arm", LOADED)
def test_the_arms_are_round_12s_on_an_h100_and_differ_only_in_the_policy(arm: str) -> None:
    assert "NVIDIA H100" in (DATA / arm / "meta.json").read_text()
    cfg = m6.arm_config(DATA, arm, advice=arm == ADVICE, loaded=True)
    old = json.loads((ROUND12 / arm / "meta.json").read_text())["config"]
    assert cfg["criteria"] == old["criteria"] and cfg["control"] == old["control"]
    # The engine's settings since grew a key (which reader reads the sender's streams): not this engine's.
    assert {k: v for k, v in cfg["engine"].items() if k != "sender_reader"} == old["engine"]


@pytest.mark.parametrize("arm", LOADED)
def test_both_judges_follow_the_load_in_and_out_live(arm: str) -> None:
    """Throughput harm 2.9-3.0 s after the load began, the clock judge 3.1-12.4 s; over 6.9-7.0 s
    (throughput) and 10.6-10.8 s (clock) after the load ended, one episode each."""
    m2.judges_follow_the_load(arm, DATA)


def test_under_the_load_a_smaller_batch_pays_again(matrix: dict[str, Any]) -> None:
    """20-140 s: goodput 928 good tok/s with control against 130 (7.1x; round 12: 7.7x), TPOT p50 26.8 ms
    against 29.7; the price 7.0 % of tokens/s (round 12: 4.7 %)."""
    under = {arm: window(matrix, arm, UNDER) for arm in LOADED}
    assert under[CONTROL]["goodput_tps"] > 6 * under[ADVICE]["goodput_tps"]
    assert under[CONTROL]["tpot_p50_ms"] < 0.95 * under[ADVICE]["tpot_p50_ms"]
    assert -0.08 < share(matrix, UNDER) < -0.03


def test_the_way_back_comes_in_the_tick_the_harm_ends_live() -> None:
    """64 -> 48 kept on the A-B-A under the load (1,636 good tok/s at 48 against 475 and 0 at 64, noise
    ±501); 48 -> 36 tried 7 s before the load ended, cut short by the harm's end 10.6 s after the load;
    the upscale to 64 in the next tick, 0.4 s later (round 12, recorded: 11 s later, after a settle)."""
    rs = m2.summary(CONTROL, DATA)["control"]["results"]
    assert m2.steps(rs) == [
        ("downscale", 64, 48, "aba_bracket", True),
        ("downscale", 48, 36, "harm_ended", False),
        ("upscale", 36, 64, "measured", True),
    ]
    first, ended, up = rs
    assert first["after"] - max(first["before"], first["again"]) > 2 * first["noise"]
    assert ended["verdict"] == "inconclusive" and ended["blocked_s"] == 0
    _, end = m2.load_times(CONTROL, DATA)
    harm_over = m2.harm_over(CONTROL, DATA)
    assert ended["action_t_s"] < end < harm_over <= ended["t_s"] <= harm_over + 1.0
    (t_up,) = [t for t, k, _ in m2.events(CONTROL, DATA) if k == "upscale"]
    assert 0 <= t_up - harm_over <= 1.0
    assert up["after"] > 0 and m2.summary(CONTROL, DATA)["control"]["ceiling"] == 64
    # Round 12's control arm, recorded with the policy before: the same trials, the upscale ~11 s late.
    harm_over12 = m2.harm_over(CONTROL, ROUND12)
    (t_up12,) = [t for t, k, _ in m2.events(CONTROL, ROUND12) if k == "upscale"]
    assert t_up12 - harm_over12 > 10.0


def test_after_the_load_the_cost_is_the_first_half_minute_back_at_64(matrix: dict[str, Any]) -> None:
    """After the load (140-230 s) control served 4.7 % fewer tokens than advice-only (round 12, with its
    11 s wait at 36: 5.3 %): 14.8 % fewer in 140-151 s (at 36 until the harm ended), 9.4 % fewer in
    151-180 s though at 64 again (the long prompts admitted at once being prefilled), +0.4 % from 180 s
    on. The wait removed, the back-up's own cost is most of what is left; one advice arm, so this round
    has no noise figure of its own (round 12's two advice arms: 0.1 % apart over 140-230 s)."""
    assert -0.07 < share(matrix, AFTER) < -0.02
    assert share(matrix, (140.0, 151.0)) < -0.10
    assert share(matrix, (151.0, 180.0)) < -0.05
    assert abs(share(matrix, (180.0, 230.0))) < 0.02
