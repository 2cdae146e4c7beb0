"""The control matrix's eleventh round, on an H200 (tests/data/h200/matrix11, benchmarks/h200_matrix/run.sh,
2026-12-06): the shared-GPU, SLO-bound (pays) and own-batch scenarios x {control, advice-only}, one arm
after the other on one machine, with today's throughput judge live for the first time on an H200 (prompt
tokens at 0.5, the GPU's power gate). What it shows: every shared load seen by both judges within 5 s and
every episode over within 30 s of the load's end; no harm of any kind, no advice and no move without an
outside load; control's one trial (pays) judged on its A-B-A bracket, inconclusive in the noise; and where
neither arm of a pair acted, how far two identical arms drift apart (the noise every comparison needs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_h200_matrix2 as m2
import test_h200_matrix6 as m6
from test_h100_matrix9 import OWNCAP, WINDOWS
from test_h200_matrix4 import window

DATA = Path(__file__).parents[2] / "data" / "h200" / "matrix11"
LOADED = ("shared-control", "shared-advice", "pays-control", "pays-advice")


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = m6.FIG.load(DATA)
    return arms


def test_the_round_ran_on_an_h200_with_todays_throughput_judge() -> None:
    assert "NVIDIA H200" in (DATA / "shared-control" / "meta.json").read_text()
    for arm in LOADED + OWNCAP:
        assert m2.summary(arm, DATA)["control"]["throughput"]["prefill_weight"] == 0.5


@pytest.mark.parametrize("arm", LOADED)
def test_both_judges_see_the_shared_load_within_5_s_and_end_within_30_s_of_it(arm: str) -> None:
    """Clock harm 1.8-2.0 s after the load began, throughput harm 2.8-3.4 s (its power gate passed: the
    GPU's power 1.39-1.73x the 10 s before); each one episode, over 10.7 s (clock) and 6.1-6.8 s
    (throughput) after the load ended."""
    start, end = m2.load_times(arm, DATA)
    by_kind = m2.harm_by_judge(arm, DATA)
    assert set(by_kind) == {"clock", "throughput"}, arm
    for kind, episodes in by_kind.items():
        assert [k for _, k in episodes] == ["harm_enter", "harm_leave"], (arm, kind)
        (t_in, _), (t_out, _) = episodes
        assert 0 < t_in - start <= 5.0 and 0 < t_out - end < 30.0, (arm, kind)


@pytest.mark.parametrize("arm", OWNCAP)
def test_no_harm_no_advice_and_no_move_without_an_outside_load(arm: str) -> None:
    """Twice the trace's rate, ~480-550 W of 700: neither judge entered, live, in either arm (advice is a
    move with `dry_run` set)."""
    control = m2.summary(arm, DATA)["control"]
    assert control["batch_actions"] == 0 and control["throughput"]["episodes"] == 0
    kinds = [k for _, k, _ in m2.events(arm, DATA)]
    assert not [k for k in kinds if k.startswith("harm_") or k in m6.MOVES or k == "advice"]


def test_the_one_trial_was_judged_on_its_a_b_a_bracket_and_blocked_briefly() -> None:
    """pays-control tried 64 -> 48 under the load: 4,465 good tok/s at 48 against 3,296 before and 3,519
    after at 64, inside the noise of those short legs (±2,250), so inconclusive, 48 blocked 40 s; the
    advice-only arm advised the same move once and made none."""
    results = [f for _, k, f in m2.events("pays-control", DATA) if k == "action_result"]
    assert len(results) == 1
    (res,) = results
    assert res["decided_by"] == "aba_bracket" and res["verdict"] == "inconclusive" and res["kept"] == 0.0
    gain = res["objective_after"] - max(res["objective_before"], res["objective_again"])
    assert 0 < gain < res["noise_margin"]
    assert m2.summary("pays-advice", DATA)["control"]["batch_actions"] == 0
    advised = [f.get("dry_run") for _, k, f in m2.events("pays-advice", DATA) if k in m6.MOVES]
    assert advised == [1.0]


def test_where_neither_arm_acted_the_pair_differs_by_noise_alone(matrix: dict[str, Any]) -> None:
    """The shared pair took no action: tokens/s +12.5 % before the load, -0.8 % under it, -8.5 % after,
    two identical arms on one machine. Under the load, where the GPU is the limit, they agree within 5 %;
    outside it, the margin is over 5 %: what a per-window comparison of control must clear."""
    assert m2.summary("shared-control", DATA)["control"]["batch_actions"] == 0
    ratio = {
        name: window(matrix, "shared-control", span)["tokens_per_s"]
        / window(matrix, "shared-advice", span)["tokens_per_s"]
        for name, span in WINDOWS.items()
    }
    assert abs(ratio["under"] - 1) < 0.05
    assert max(abs(ratio["before"] - 1), abs(ratio["after"] - 1)) > 0.05


def test_control_serves_at_least_what_advice_only_serves_where_it_acted(matrix: dict[str, Any]) -> None:
    """pays: goodput +20.5 % under the load (the trial's 16 s at 48), tokens/s -5.0 %; after the load
    tokens/s +4.3 % and goodput +2.8 %: nothing the trial cost outlasted it."""
    under = [window(matrix, a, WINDOWS["under"]) for a in ("pays-control", "pays-advice")]
    after = [window(matrix, a, WINDOWS["after"]) for a in ("pays-control", "pays-advice")]
    assert under[0]["goodput_tps"] > under[1]["goodput_tps"]
    assert after[0]["tokens_per_s"] >= 0.95 * after[1]["tokens_per_s"]
