"""The control matrix's sixth round on an H200 (tests/data/h200/matrix6, benchmarks/h200_matrix/run.sh
`longctx`, 2026-12-04): round 5's long-context arm with the whole 230 s trace and a 120 s matmul load from
20 s in, now with its counterparts: control twice (`longctx-control` on one machine, `longctx-control2`
on another), advice-only twice (`longctx-advice`, `longctx-advice2`) and a load-free arm (`longctx-free`),
all with the backlog-reading throughput judge live. Goodput on TPOT <= 26.46 ms only (round 4's
calibration), throughput harm acted on, the policy's default times."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_h200_matrix2 as m2
from test_h200_matrix4 import window

from soakd.testing import load_script

DATA = Path(__file__).parents[2] / "data" / "h200" / "matrix6"
FIG = load_script(
    Path(__file__).parents[3] / "benchmarks" / "h200_matrix" / "figures.py", "h200_matrix_figures"
)
LIMIT_MS = 26.46
CONTROL = ("longctx-control", "longctx-control2")
ADVICE = ("longctx-advice", "longctx-advice2")
LOADED = CONTROL + ADVICE
PAIRS = tuple(zip(CONTROL, ADVICE, strict=True))
UNDER = (20.0, 140.0)  # seconds of the replay under the load in every loaded arm
AFTER = (140.0, 230.0)
MOVES = {"downscale", "upscale", "revert"}


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = FIG.load(DATA)
    return arms


def deficit(matrix: dict[str, Any], span: tuple[float, float], key: str = "tokens_per_s") -> list[float]:
    """Control's shortfall against advice-only in each pair over `span` (a share of advice-only's)."""
    return [1 - window(matrix, c, span)[key] / window(matrix, a, span)[key] for c, a in PAIRS]


def results(arm: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = m2.summary(arm, DATA)["control"]["results"]
    return out


def arm_config(data: Path, arm: str, *, advice: bool, loaded: bool) -> dict[str, Any]:
    """An arm of this round's shape (the whole 230 s trace, the TPOT limit, throughput harm acted on, a
    120 s load when loaded), asserted; its config returned."""
    cfg: dict[str, Any] = json.loads((data / arm / "meta.json").read_text())["config"]
    assert cfg["run"]["duration"] == 230.0 and cfg["criteria"]["tpot_p99_ms"] == LIMIT_MS
    assert cfg["control"]["harm"]["act_on_throughput"] is True
    assert cfg["control"]["dry_run"] is advice
    assert (data / arm / "times.json").exists() is loaded
    if loaded:
        start, end = m2.load_times(arm, data)
        assert abs(end - start - 120.0) < 1.0
    return cfg


@pytest.mark.parametrize("arm", [*LOADED, "longctx-free"])
def test_the_arms_differ_only_in_the_policy_and_the_load(arm: str) -> None:
    arm_config(DATA, arm, advice=arm in ADVICE, loaded=arm in LOADED)


@pytest.mark.parametrize("arm", LOADED)
def test_both_judges_follow_the_load_in_and_out_live(arm: str) -> None:
    """The backlog-reading throughput judge live: harm 3.5-4.9 s after the load began (round 4's arms,
    without it: 3.4-5.5 s), inside the issue's 5 s in all four arms; the clock judge 4.5-4.7 s. Both over
    6.2-10.7 s after the load ended, inside the 30 s, each in one episode."""
    start, end = m2.load_times(arm, DATA)
    for kind, (t_in, t_out) in m2.one_episode_per_judge(arm, DATA).items():
        assert 0 < t_in - start <= 5.0, (arm, kind)
        assert 0 < t_out - end < 30.0, (arm, kind)
    judged = m2.summary(arm, DATA)["control"]["throughput"]
    assert judged["episodes"] == 1 and judged["reference_kind"] == "capacity"


def test_without_the_load_no_harm_no_action_no_advice_and_the_run_passes() -> None:
    """The long-context trace alone at 64: TPOT p99 13.3 ms against the 26.46 ms limit, every request
    done; no harm from either judge, no move, no advice, though the judge read a backlog in two
    intervals (never enough for harm: it needs the loss as well) and had its capacity reference."""
    arm = "longctx-free"
    assert not [k for _, k, _ in m2.events(arm, DATA) if k.startswith("harm_") or k in MOVES]
    control = m2.summary(arm, DATA)["control"]
    assert (control["batch_actions"], control["advice"], control["throughput_harm_episodes"]) == (0, 0, 0)
    assert control["throughput"]["reference_kind"] == "capacity"
    assert control["levels"].keys() == {"64"} and control["levels"]["64"]["harm_s"] == 0.0
    verdict = json.loads((DATA / arm / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS"
    assert m2.summary(arm, DATA)["requests"]["tpot"]["p99_ms"] < LIMIT_MS / 1.5


@pytest.mark.parametrize("arm", CONTROL)
def test_each_control_arm_keeps_48_then_finds_its_road_back_to_64(arm: str) -> None:
    """Both control arms made the same six moves: 64 -> 48 tried 22-24 s into the load and kept on the
    A-B-A (B 1,959 and 1,975 good tok/s against 376 / 0 and 405 / 0 at 64, noise ±376 and ±340); 48 -> 36
    tried 4-9 s before the load's end, the harm ending during it (inconclusive, 36 kept); then 36 -> 48
    and 48 -> 64, each measured and up, 64 back 41-42 s after the harm ended."""
    assert m2.steps(results(arm)) == [
        ("downscale", 64, 48, "aba_bracket", True),
        ("downscale", 48, 36, "harm_ended", True),
        ("upscale", 36, 48, "measured", True),
        ("upscale", 48, 64, "measured", True),
    ]
    first, ended, up1, up2 = results(arm)
    assert (
        first["verdict"] == "gain"
        and first["after"] - max(first["before"], first["again"]) > 3 * first["noise"]
    )
    assert up1["after"] > up1["before"] and up2["after"] > up2["before"]
    start, end = m2.load_times(arm, DATA)
    assert 0 < first["action_t_s"] - start < 30 and ended["action_t_s"] < end < ended["t_s"]
    assert 30 < up2["action_t_s"] - ended["t_s"] < 60
    control = m2.summary(arm, DATA)["control"]
    assert control["ceiling"] == 64 and control["reverted"] == 0


def test_control_beats_advice_only_under_the_load_far_beyond_the_noise(matrix: dict[str, Any]) -> None:
    """20-140 s of each replay, under the load: goodput 1,165 and 1,155 good tok/s with control against 82
    and 93 advice-only (14x and 12x; the repeats of each policy 10 and 11 good tok/s apart), TPOT p50 25.3
    ms against 28.7-29.1. The price: tokens/s 3.3 and 4.9 % below advice-only (the advice-only arms 0.5 %
    apart)."""
    under = {arm: window(matrix, arm, UNDER) for arm in LOADED}
    noise = max(abs(under[x]["goodput_tps"] - under[y]["goodput_tps"]) for x, y in (ADVICE, CONTROL))
    for c, a in PAIRS:
        assert under[c]["goodput_tps"] > 10 * under[a]["goodput_tps"]
        assert under[c]["goodput_tps"] - under[a]["goodput_tps"] > 20 * noise
        assert under[c]["tpot_p50_ms"] < LIMIT_MS < under[a]["tpot_p50_ms"]
    assert all(0 < d < 0.07 for d in deficit(matrix, UNDER))
    assert m2.spread(under[ADVICE[0]]["tokens_per_s"], under[ADVICE[1]]["tokens_per_s"]) < 0.02


def test_the_road_back_is_what_control_costs_after_the_load(matrix: dict[str, Any]) -> None:
    """After the load (140-230 s) control served 16 and 10 % fewer tokens (and 17 and 9 % less goodput)
    than advice-only, far beyond the noise (the advice-only arms 0.2 % apart): every arm still had a
    queue (admission wait p99 50 s advice-only, 87-88 s control), and control's ceiling was 36, then 48,
    for the 41-42 s of its road back: 17-23 % below advice-only over 140-195 s; once 64 was back
    (195-230 s) 0.7 and 5.6 % below. The unserved backlog shows in the verdicts: 298 and 395 requests
    aborted at the drain against 111 and 118."""
    after = deficit(matrix, AFTER)
    assert all(d > 0.08 for d in after)
    assert all(d > 0.15 for d in deficit(matrix, (140.0, 195.0)))
    assert all(abs(d) < 0.07 for d in deficit(matrix, (195.0, 230.0)))
    noise = m2.spread(*(window(matrix, a, AFTER)["tokens_per_s"] for a in ADVICE))
    assert noise < min(after) / 4
    aborted = {arm: m2.summary(arm, DATA)["requests"]["errors"].get("aborted", 0) for arm in LOADED}
    assert min(aborted[c] for c in CONTROL) > 2 * max(aborted[a] for a in ADVICE)
