"""Acceptance by output position and by turn, and drift against the run's first window."""

from __future__ import annotations

from typing import Any

from soakd.collectors.engine import EngineCollector, quantile_of_counts
from soakd.collectors.spec import AcceptanceDrift, DriftSettings, SpecProfile
from soakd.engine.stats import StepStats


def test_profile_buckets_verify_steps_by_the_output_position_they_verify() -> None:
    p = SpecProfile(config_id="c1")
    # 3 drafts per step; every step accepts 3 until position ~64, then none: 4 tokens per step.
    accepted = [3] * 16 + [0] * 10
    drafted = [3] * 26
    p.add(accepted, drafted, turn=0)
    (sample,) = p.collect(1)
    f = sample.fields
    # Positions 1, 5, ..., 61 (16 steps) are in the first bucket, the rest from 65 on.
    assert f["accepted_out0"] == 48 and f["drafted_out0"] == 48 and f["rate_out0"] == 1.0
    assert f["accepted_out64"] == 0 and f["drafted_out64"] == 30 and f["rate_out64"] == 0.0
    assert f["rate_turn0"] == 48 / 78 and f["requests"] == 1
    assert sample.tags == {"config": "c1"}
    assert p.collect(2) == []  # nothing new: nothing written


def test_profile_by_turn_and_run_totals() -> None:
    p = SpecProfile()
    for turn in range(10):
        p.add([2] * 5, [3] * 5, turn=turn)  # 10 accepted of 15 each
    p.add([], [], turn=3)  # a request without speculative steps is not counted
    summary = p.summary()
    turns = {row["from"]: row for row in summary["by_turn"]}  # type: ignore[attr-defined]
    assert sorted(turns) == [0, 1, 2, 3, 4, 6, 8]  # 4-5, 6-7 and 8-11 share buckets
    assert turns[4]["drafted"] == 30 and turns[8]["rate"] == 10 / 15
    assert summary["requests"] == 10


def _drift(events: list[tuple[str, dict[str, Any]]]) -> AcceptanceDrift:
    def on_event(kind: str, message: str, **fields: Any) -> None:
        events.append((kind, fields))

    return AcceptanceDrift(
        DriftSettings(baseline_s=10, window_s=5, threshold=0.2, min_draft_tokens=50), on_event
    )


def test_drift_against_the_first_window_raises_and_clears_an_event() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    d = _drift(events)
    for _ in range(10):  # baseline: 80 % acceptance, 3 draft tokens per draft
        assert d.update(1.0, 24, 30, 10) == {}
    assert d.baseline_done
    f = d.update(1.0, 24, 30, 10)
    assert f["baseline_acceptance_rate"] == 0.8 and "acceptance_drift" not in f  # 30 < min tokens
    for _ in range(2):
        f = d.update(1.0, 24, 30, 10)
    assert abs(float(f["acceptance_drift"])) < 1e-9 and events == []
    for _ in range(5):  # acceptance falls to 40 %: a 50 % relative drop
        f = d.update(1.0, 12, 30, 10)
    assert abs(float(f["acceptance_drift"]) + 0.5) < 1e-9
    assert abs(float(f["window_acceptance_length"]) - 2.2) < 1e-9
    assert [k for k, _ in events] == ["spec_drift"]
    for _ in range(5):  # and back
        d.update(1.0, 24, 30, 10)
    assert [k for k, _ in events] == ["spec_drift", "spec_drift_cleared"]
    assert d.summary()["worst_drift"] is not None and d.summary()["drift_events"] == 1


def test_a_baseline_needs_enough_draft_tokens() -> None:
    d = _drift([])
    for _ in range(20):
        d.update(1.0, 1, 2, 1)  # 20 s but only 40 draft tokens
    assert not d.baseline_done


def test_engine_collector_counts_graph_steps_by_mode_and_tokens_per_step() -> None:
    c = EngineCollector(config_id="x", cudagraphs=True)
    steps = [
        StepStats(
            time_ns=1,
            has_iteration=True,
            cg_mode="FULL",
            cg_unpadded_tokens=3,
            cg_padded_tokens=4,
            cg_paddings=1,
        ),
        StepStats(
            time_ns=1, has_iteration=True, cg_mode="PIECEWISE", cg_unpadded_tokens=8, cg_padded_tokens=8
        ),
        StepStats(
            time_ns=1, has_iteration=True, cg_mode="NONE", cg_unpadded_tokens=600, cg_padded_tokens=600
        ),
    ]
    for s in steps:
        c.push(s)
    (engine,) = c.collect(10)
    f = engine.fields
    assert (f["cg_steps_full"], f["cg_steps_piecewise"], f["cg_steps_none"]) == (1, 1, 1)
    assert f["cg_hit_rate"] == 2 / 3 and f["cg_token_hit_rate"] == 11 / 611
    assert f["cg_padding_waste"] == 1 / 12
    assert f["tokens_per_step_max"] == 600 and f["tokens_per_step_p50"] == 8
    assert dict(c.tokens_per_step) == {3: 1, 8: 1, 600: 1}
    assert c.cudagraph_summary()["hit_rate"] == 2 / 3


def test_without_graphs_the_summary_says_not_applicable_and_writes_no_graph_fields() -> None:
    c = EngineCollector(cudagraphs=False)
    c.push(StepStats(time_ns=1, has_iteration=True, generation_tokens=4, prompt_tokens=10))
    (engine,) = c.collect(10)
    assert not any(k.startswith("cg_") for k in engine.fields)
    assert engine.fields["tokens_per_step_p99"] == 14
    summary = c.cudagraph_summary()
    assert summary["applicable"] is False and "hit_rate" not in summary


def test_quantile_of_counts() -> None:
    counts = {1: 50, 2: 40, 100: 10}
    assert quantile_of_counts(counts, 0.5) == 1
    assert quantile_of_counts(counts, 0.9) == 2
    assert quantile_of_counts(counts, 0.91) == 100
    assert quantile_of_counts(counts, 1.0) == 100
