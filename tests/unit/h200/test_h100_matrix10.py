"""The control matrix's tenth round, on an H100 80GB HBM3 (tests/data/h100/matrix10, benchmarks/h200_matrix/
run.sh, 2026-12-05): the own-batch scenario (twice the trace's rate, no outside load) as control and as
advice-only, repeated on today's policy with the throughput judge counting prompt tokens live. The run was
cut short after these two arms (the machine was taken back; the shared-load arms were lost). What it
shows: no action and no clock harm in either arm, and the throughput judge recorded one episode in the
control arm, live at 84 s (replayed at 83 s): the engine's steps slowed with the GPU's power down, which
the judge now reads as no harm (test_h200_prefill_weight.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_h200_matrix2 as m2
import test_h200_matrix6 as m6
from test_h200_matrix4 import window

DATA = Path(__file__).parents[2] / "data" / "h100" / "matrix10"
ARMS = ("owncap-control", "owncap-advice")


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = m6.FIG.load(DATA)
    return arms


def test_the_round_ran_on_an_h100_with_the_prefill_weight_live() -> None:
    assert "H100 80GB HBM3" in (DATA / "owncap-control" / "meta.json").read_text()
    for arm in ARMS:
        assert m2.summary(arm, DATA)["control"]["throughput"]["prefill_weight"] == 0.5


@pytest.mark.parametrize("arm", ARMS)
def test_no_action_no_advice_and_no_clock_harm_without_an_outside_load(arm: str) -> None:
    control = m2.summary(arm, DATA)["control"]
    assert control["batch_actions"] == 0
    kinds = [(k, f.get("harm_kind")) for _, k, f in m2.events(arm, DATA)]
    assert not [k for k, hk in kinds if k.startswith("harm_") and hk != "throughput"]
    assert not [k for k, _ in kinds if k in m6.MOVES or k == "advice"]


def test_the_live_judge_recorded_one_episode_without_an_outside_load(matrix: dict[str, Any]) -> None:
    """Kept as recorded: 20 % under a reference of 11,803 tok/s (prompt tokens at 0.5), 84-95 s in, not
    acted on (act_on_throughput is off here); none in the advice-only arm."""
    ctl = m2.summary("owncap-control", DATA)["control"]
    adv = m2.summary("owncap-advice", DATA)["control"]
    assert (ctl["throughput"]["episodes"], adv["throughput"]["episodes"]) == (1, 0)
    entered = [(t, f) for t, k, f in matrix["owncap-control"]["arm"].events if k == "harm_enter"]
    assert len(entered) == 1 and entered[0][1].get("acted_on") == 0.0
    assert 80 <= entered[0][0] <= 90


def test_with_no_action_the_arms_differ_by_run_to_run_noise_alone(matrix: dict[str, Any]) -> None:
    """tokens/s under and after the scenario's load window within 5 % of each other (+3.2 and -2.7 %),
    but the first 20 s 18 % apart (7,473 against 6,316): the noise a before-window carries between two
    identical arms on one machine, the margin any per-window comparison of control needs."""
    ratios = {
        name: window(matrix, "owncap-control", span)["tokens_per_s"]
        / window(matrix, "owncap-advice", span)["tokens_per_s"]
        for name, span in {"before": (0.0, 20.0), "under": (20.0, 65.0), "after": (65.0, 100.0)}.items()
    }
    assert abs(ratios["under"] - 1) < 0.05 and abs(ratios["after"] - 1) < 0.05
    assert ratios["before"] > 1.1
