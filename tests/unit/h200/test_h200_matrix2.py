"""The control matrix's second round on an H200 (tests/data/h200/matrix2, benchmarks/h200_matrix/run.sh,
2026-12-03): the policy of the first round's fixes, live. Eight arms on the same engine as the first round
(a Qwen3-8B shape with dummy weights at 64 requests, the matmul load from 20 s to 65 s of a 95 s replay):
shared x {control, advice-only, advice-only again}, pays x {control, advice-only, load-free}, and a second
A/A of soakd's scheduler class (load-free, with and without it). What it must show, live this time: the
throughput judge sees every load within 5 s and nothing without one; clock harm ends within 30 s of the
load; no trial where the queue is about to cross the TTFT limit; no action without a load; the class costs
nothing measurable beside the noise of repeats; where a smaller batch pays, control serves more goodput."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_h200_control_ab import throughput_inputs

from soakd.policies.throttle import ThroughputJudge
from soakd.testing import load_script

DATA = Path(__file__).parents[2] / "data" / "h200" / "matrix2"
ROUND1 = Path(__file__).parents[2] / "data" / "h200" / "matrix"
FIG = load_script(
    Path(__file__).parents[3] / "benchmarks" / "h200_matrix" / "figures.py", "h200_matrix_figures"
)
LOADED = ("shared-control", "shared-advice", "shared-advice2", "pays-control", "pays-advice")
LOAD_FREE = ("pays-free", "shared-free2")
MOVES = {"downscale", "upscale", "revert"}


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = FIG.load(DATA)
    return arms


@pytest.fixture(scope="module")
def round1() -> dict[str, Any]:
    arms: dict[str, Any] = FIG.load(ROUND1)
    return arms


def events(arm: str, data: Path = DATA) -> list[tuple[float, str, dict[str, Any]]]:
    """(wall s, kind, fields) of every event in the arm's spool."""
    lines = FIG.FIG.lines(data / arm / "spool.lp.gz")
    return [(ts / 1e9, tags.get("kind", ""), fields) for name, tags, fields, ts in lines if name == "events"]


def summary(arm: str, data: Path = DATA) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((data / arm / "summary.json").read_text())
    return out


def harm_by_judge(arm: str, data: Path = DATA) -> dict[str, list[tuple[float, str]]]:
    """(wall s, harm_enter or harm_leave) of the clock judge's and the throughput judge's harm events."""
    by_kind: dict[str, list[tuple[float, str]]] = {"clock": [], "throughput": []}
    for t, k, f in events(arm, data):
        if k.startswith("harm_"):
            by_kind["throughput" if f.get("harm_kind") == "throughput" else "clock"].append((t, k))
    return by_kind


def one_episode_per_judge(arm: str, data: Path = DATA) -> dict[str, tuple[float, float]]:
    """(enter, leave) wall s of the clock judge's and the throughput judge's harm, each asserted to be one
    episode that ended."""
    out: dict[str, tuple[float, float]] = {}
    for kind, episode in harm_by_judge(arm, data).items():
        assert [k for _, k in episode] == ["harm_enter", "harm_leave"], (arm, kind)
        out[kind] = (episode[0][0], episode[1][0])
    return out


def harm_over(arm: str, data: Path = DATA) -> float:
    """When the later of the two judges' one episode each ended."""
    return max(t_out for _, t_out in one_episode_per_judge(arm, data).values())


def steps(results: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each recorded trial as (kind, from, to, decided_by, kept)."""
    return [(r["kind"], r["from"], r["to"], r["decided_by"], r["kept"]) for r in results]


def judges_follow_the_load(arm: str, data: Path = DATA) -> None:
    """Asserted: one episode of each judge; throughput harm within 5 s of the load's start, clock harm
    after it; both over within 30 s of its end."""
    start, end = load_times(arm, data)
    episodes = one_episode_per_judge(arm, data)
    t_in, t_out = episodes["throughput"]
    assert 0 < t_in - start <= 5.0 and 0 < t_out - end < 30.0, arm
    t_in, t_out = episodes["clock"]
    assert t_in - start > 0 and 0 < t_out - end < 30.0, arm


def load_free_arm_is_quiet(arm: str, data: Path = DATA) -> None:
    """Asserted: no harm from either judge, no move, no advice, a PASS, no request failed."""
    assert not [k for _, k, _ in events(arm, data) if k.startswith("harm_") or k in MOVES]
    control = summary(arm, data)["control"]
    assert (control["batch_actions"], control["advice"], control["throughput_harm_episodes"]) == (0, 0, 0)
    assert json.loads((data / arm / "verdict.json").read_text())["verdict"] == "PASS"
    assert summary(arm, data)["requests"]["errors"] == {}


def load_times(arm: str, data: Path = DATA) -> tuple[float, float]:
    times = json.loads((data / arm / "times.json").read_text())
    return float(times["load_start"]), float(times["load_end"])


def window(arms: dict[str, Any], name: str, k: int) -> dict[str, Any]:
    a = arms[name]
    out: dict[str, Any] = a["arm"].window(*a["spans"][k])
    return out


def spread(x: float, y: float) -> float:
    """The relative difference of two runs of one policy: the noise a comparison is read against."""
    return abs(x - y) / max(x, y)


@pytest.mark.parametrize("arm", LOADED)
def test_the_throughput_judge_sees_every_load_live_within_5_s(arm: str) -> None:
    """Live: throughput harm 4.0-4.8 s after each load began (32-44 % below a capacity reference formed
    before it), over 6.2-7.0 s after the load ended: the first round's judge saw none of these loads.
    The recorded seconds replayed through today's judge agree within a few seconds."""
    start, end = load_times(arm)
    episode = [
        (t, k) for t, k, f in events(arm) if k.startswith("harm_") and f.get("harm_kind") == "throughput"
    ]
    assert [k for _, k in episode] == ["harm_enter", "harm_leave"], arm
    (t_in, _), (t_out, _) = episode
    assert 0 <= t_in - start <= 5.0 and 0 <= t_out - end <= 15.0
    judged = summary(arm)["control"]["throughput"]
    assert judged["episodes"] == 1 and judged["reference_kind"] == "capacity" and judged["reference_tps"] > 0
    ticks, _ = throughput_inputs(arm, DATA)
    judge = ThroughputJudge()
    changes = [t for t, tps, b, lim in ticks if judge.update(t, tps, binding=b, limited=lim) is not None]
    assert len(changes) == 2 and 0 <= changes[0] - start <= 5.0


@pytest.mark.parametrize("arm", LOAD_FREE)
def test_no_harm_no_action_and_a_reference_without_a_load(arm: str) -> None:
    """Load-free with control on (pays at the trace's rate, the shared scenario's A/A arm): no harm of
    either kind, no action and no advice, and the summary says the throughput judge had a reference (a
    "0 loss" that is a measurement, not ignorance)."""
    kinds = {k for _, k, _ in events(arm)}
    assert not (MOVES | {"harm_enter", "trial_skipped"}) & kinds, arm
    control = summary(arm)["control"]
    assert control["batch_actions"] == 0 and control["advice"] == 0 and control["trials_skipped"] == 0
    assert control["throughput"]["episodes"] == 0 and control["throughput"]["reference_kind"] == "capacity"
    assert control["levels"]["64"]["harm_s"] == 0.0


@pytest.mark.parametrize("arm", LOADED)
def test_clock_harm_ends_within_30_s_of_the_load_live(arm: str) -> None:
    """Live: clock harm 1.7-2.0 s after the load began (16-18 % below 1,980 MHz at the 700 W cap), over
    10.6-10.9 s after it ended, on the loss itself (the engine alone ran within 1 % of its clock)."""
    start, end = load_times(arm)
    episode = [
        (t, k, f) for t, k, f in events(arm) if k.startswith("harm_") and f.get("harm_kind") != "throughput"
    ]
    assert [k for _, k, _ in episode] == ["harm_enter", "harm_leave"], arm
    (t_in, _, _), (t_out, _, leave) = episode
    assert 0 < t_in - start < 3.0 and 0 < t_out - end < 30.0 and leave["ended_by"] == "loss"


def test_no_trial_live_where_the_queue_would_cross_the_ttft_limit(matrix: dict[str, Any]) -> None:
    """The first round's control arm tried 64 -> 48 under the shared load and its stall pushed the queue
    past the 10 s TTFT limit (goodput after the load 19 against 7,562 good tok/s). Live now: control skips
    that trial (the head had waited 4.6 s, projected to 12.8 s within the trial) and never moves; both
    advice-only arms say the same (4.8-7.0 s, projected 16.6-24.3 s). With all three at 64 throughout,
    the "after" window is the noise of three runs of one policy: goodput 0 / 5,517 / 66 good tok/s (the
    backlog's wait sits at the TTFT limit: a few seconds either way decide it), tokens/s 8,984 / 11,926 /
    10,575."""
    for arm in ("shared-control", "shared-advice", "shared-advice2"):
        skipped = [f for _, k, f in events(arm) if k == "trial_skipped"]
        assert len(skipped) == 1, arm
        (f,) = skipped
        assert float(f["ev_wait_s"]) < 10.0 <= float(f["ev_wait_reach_s"]) and f["to_limit"] == 48.0
    control = summary("shared-control")["control"]
    assert control["trials_skipped"] == 1 and control["batch_actions"] == 0
    assert not MOVES & {k for _, k, _ in events("shared-control")}
    assert set(control["levels"]) == {"64"}
    after = [window(matrix, a, 2) for a in ("shared-control", "shared-advice", "shared-advice2")]
    # The same policy in force in all three: control's after lies inside what the two advice runs span
    # apart, so the comparison is read against that noise and nothing else.
    good = [w["goodput_tps"] for w in after]
    assert spread(good[1], good[2]) > 0.9 and min(good[1:]) - good[0] < abs(good[1] - good[2])


def test_the_scheduler_class_costs_nothing_measurable_in_a_repeat(
    matrix: dict[str, Any], round1: dict[str, Any]
) -> None:
    """The second A/A (95 s, load-free): with the class 9,871 tok/s, without 9,209 (+7.2 %), TPOT p50 5.41
    against 6.18 ms; the first was -0.6 % (5.08 against 5.34 ms). Neither pair shows a cost: the class's
    arm had the lower TPOT both times, and the two pairs' differences lie within what one arm without
    the class moved between the rounds (before and under the load's span: +5.9 % and -7.5 %)."""
    meta = {a: json.loads((DATA / a / "meta.json").read_text()) for a in ("shared-free2", "shared-noclass2")}
    assert meta["shared-free2"]["engine"]["live_active_seqs"] is True
    assert meta["shared-noclass2"]["engine"]["live_active_seqs"] is False
    pairs = ((matrix, "shared-free2", "shared-noclass2"), (round1, "shared-free", "shared-noclass"))
    diffs = []
    for arms, with_class, without in pairs:
        a, b = (arms[n]["arm"] for n in (with_class, without))
        x, y = a.window(0.0, a.end), b.window(0.0, b.end)
        diffs.append(x["tokens_per_s"] / y["tokens_per_s"] - 1)
        assert x["tpot_p50_ms"] < y["tpot_p50_ms"]
    repeat = [
        spread(
            window(matrix, "shared-noclass2", k)["tokens_per_s"],
            window(round1, "shared-noclass", k)["tokens_per_s"],
        )
        for k in (0, 1)
    ]
    assert min(diffs) > -0.02 and max(abs(d) for d in diffs) <= max(repeat)


def test_where_a_smaller_batch_pays_control_serves_more_goodput(
    matrix: dict[str, Any], round1: dict[str, Any]
) -> None:
    """pays (goodput on TPOT <= 12.79 ms): control's goodput against advice-only's +2.0 / +18.7 / +13.9 %
    before, under and after the load (the first round: +4.1 / +25.8 / -1.7 %); under the load, where 48
    requests bring TPOT under the limit, the gain is beyond what advice-only moved between the rounds
    (2.9 %) in both rounds. What it is not: a kept level. The trial (A 3,184, B 4,722, A' 2,002 good
    tok/s, noise +-2,105 on 10 s legs) was inconclusive and reverted; the gain is its B leg's."""
    noise = spread(*(window(arms, "pays-advice", 1)["goodput_tps"] for arms in (matrix, round1)))
    for arms in (matrix, round1):
        c, d = (window(arms, f"pays-{p}", 1)["goodput_tps"] for p in ("control", "advice"))
        assert c > d * (1 + 2 * noise)
    for k in range(3):
        c, d = (window(matrix, f"pays-{p}", k)["goodput_tps"] for p in ("control", "advice"))
        assert c >= d
    (result,) = summary("pays-control")["control"]["results"]
    assert result["verdict"] == "inconclusive" and not result["kept"]
    assert result["after"] > max(result["before"], result["again"])  # B beat both A legs, not the noise
    assert result["after"] - max(result["before"], result["again"]) < result["noise"]
