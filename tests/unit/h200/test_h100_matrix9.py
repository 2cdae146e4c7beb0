"""The control matrix's ninth round, on an H100 80GB HBM3 (tests/data/h100/matrix9, benchmarks/h200_matrix/
run.sh, 2026-12-05): the shared-GPU and own-batch scenarios x {control, advice-only} on today's policy (the
backlog judge, the way back in one step), one arm after the other on one machine. No H200 was lent; the
pays scenario's TPOT limit was measured on an H200, so it was not run here. What it shows: the shared
load is seen by both judges live and both episodes end within 30 s of it; control took no action (its one
trial was skipped: the queue's head would have crossed the TTFT limit), so it served what advice-only did;
twice the trace's rate does not reach this card's power cap, and the throughput judge recorded harm there
in the control arm alone (not acted on: act_on_throughput is off in these scenarios)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_h200_matrix2 as m2
import test_h200_matrix6 as m6
from test_h200_matrix4 import window

DATA = Path(__file__).parents[2] / "data" / "h100" / "matrix9"
SHARED = ("shared-control", "shared-advice")
OWNCAP = ("owncap-control", "owncap-advice")
WINDOWS = {"before": (0.0, 20.0), "under": (20.0, 65.0), "after": (65.0, 100.0)}


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = m6.FIG.load(DATA)
    return arms


def test_the_round_ran_on_an_h100() -> None:
    assert "H100 80GB HBM3" in (DATA / "shared-control" / "meta.json").read_text()


@pytest.mark.parametrize("arm", SHARED)
def test_both_judges_see_the_shared_load_live_and_end_with_it(arm: str) -> None:
    """Clock harm 1.7-1.8 s after the load began, throughput harm 3.3-3.5 s; the clock's episode ended
    10.8 s after the load did, the throughput judge's first 6.3-6.5 s after."""
    start, end = m2.load_times(arm, DATA)
    by_kind = m2.harm_by_judge(arm, DATA)
    for kind, episodes in by_kind.items():
        assert episodes[:2] and [k for _, k in episodes[:2]] == ["harm_enter", "harm_leave"], (arm, kind)
        (t_in, _), (t_out, _) = episodes[:2]
        assert 0 < t_in - start <= 5.0 and 0 < t_out - end < 30.0, (arm, kind)
    assert [k for _, k in by_kind["clock"]] == ["harm_enter", "harm_leave"]


def test_control_took_no_action_where_a_trial_would_measure_the_backlog() -> None:
    control = m2.summary("shared-control", DATA)["control"]
    assert (control["batch_actions"], control["trials_skipped"]) == (0, 1)
    assert not [k for _, k, _ in m2.events("shared-control", DATA) if k in m6.MOVES]


@pytest.mark.parametrize("pair", [SHARED, OWNCAP])
def test_control_serves_what_advice_only_serves_in_every_window(
    matrix: dict[str, Any], pair: tuple[str, str]
) -> None:
    """tokens/s within 5 % of advice-only's in each window (on the load's own windows shared +0.3 / +0.3 /
    -0.9 %, owncap +0.5 / -1.0 / -2.6 %; on these fixed ones up to -3.2 %): with no action taken the two
    arms differ only in run-to-run noise."""
    ctl, adv = pair
    for span in WINDOWS.values():
        ratio = window(matrix, ctl, span)["tokens_per_s"] / window(matrix, adv, span)["tokens_per_s"]
        assert abs(ratio - 1) < 0.05, (pair, span)


@pytest.mark.parametrize("arm", OWNCAP)
def test_twice_the_rate_does_not_reach_this_cards_power_cap(arm: str) -> None:
    """No clock harm and no move without an outside load; the H100's power stayed near 500 W of 700."""
    kinds = [(k, f.get("harm_kind")) for _, k, f in m2.events(arm, DATA)]
    assert not [k for k, hk in kinds if k.startswith("harm_") and hk != "throughput"]
    assert m2.summary(arm, DATA)["control"]["batch_actions"] == 0


def test_the_throughput_judge_recorded_harm_without_an_outside_load_in_one_arm() -> None:
    """A finding, kept as recorded: in owncap-control the throughput judge entered harm twice (24 % and
    28 % under its reference while requests waited), in owncap-advice never. Recorded only (not acted on).
    The first one's cause: a surge of long prompts on an engine at its own power cap (7.3-8.5k prompt
    tok/s against ~3k), not an outside load; the judge now counts prompt tokens computed
    (test_h200_prefill_weight.py). The second is not reproduced by a replay and stays open."""
    ctl = m2.summary("owncap-control", DATA)["control"]
    adv = m2.summary("owncap-advice", DATA)["control"]
    assert (ctl["throughput_harm_episodes"], adv["throughput_harm_episodes"]) == (2, 0)
    acted = [f.get("acted_on") for _, k, f in m2.events("owncap-control", DATA) if k == "harm_enter"]
    assert acted == [0.0, 0.0]
