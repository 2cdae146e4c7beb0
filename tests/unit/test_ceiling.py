"""Decode throughput as % of the bandwidth ceiling: the tracker's arithmetic and its engine points."""

from __future__ import annotations

import pytest

from soakd.collectors.ceiling import Bandwidth, CeilingTracker, ceiling_line
from soakd.collectors.engine import EngineCollector
from soakd.engine.stats import StepStats
from soakd.probe import ModelBytes, tokens_per_s_ceiling

MODEL = ModelBytes(model_dir="m", weight_bytes=1_000_000_000, kv_bytes_per_token=100_000)


def test_interval_ceiling_follows_batch_and_the_context_of_finished_requests() -> None:
    t = CeilingTracker(MODEL, Bandwidth(1000.0, "configured"))
    # Before any request finished: weights only. 1000 GB/s over 1 GB = 1000 steps/s; batch 4 -> 4000 tok/s.
    f = t.interval(generation_tokens=2000, running_mean=4.0, interval_s=1.0)
    assert f["decode_ceiling_tps"] == pytest.approx(4000.0) and f["decode_ceiling_pct"] == pytest.approx(50.0)
    t.observe_request(input_tokens=1000, output_tokens=400)  # decodes at 1200 tokens of context on average
    t.observe_request(input_tokens=500, output_tokens=0)  # failed before any token: says nothing
    assert t.context_tokens == 1200.0
    f = t.interval(generation_tokens=1500, running_mean=4.0, interval_s=0.5)
    want = tokens_per_s_ceiling(
        MODEL.weight_bytes, MODEL.kv_bytes_per_token, 1000.0, batch=4, context_tokens=1200
    )
    assert f["decode_ceiling_tps"] == pytest.approx(
        want
    )  # the probe's formula, at the run's batch and context
    assert f["decode_tps"] == 3000.0 and f["decode_ceiling_pct"] == pytest.approx(100 * 3000 / want)
    assert t.interval(0, 4.0, 1.0) == {}  # idle intervals are not judged
    s = t.summary()
    assert s["busy_s"] == 1.5 and s["decode_tps"] == pytest.approx(3500 / 1.5)
    # Time-weighted: all tokens over what the ceiling allowed in the same busy time.
    assert s["pct_of_ceiling"] == pytest.approx(100 * 3500 / (4000 * 1.0 + want * 0.5))
    assert s["pct_max"] == pytest.approx(100 * 3000 / want)


def test_speculation_can_pass_the_ceiling_and_the_line_says_so() -> None:
    t = CeilingTracker(MODEL, Bandwidth(500.0, "theoretical"))
    t.interval(generation_tokens=1000, running_mean=None, interval_s=1.0)  # batch unknown: 1
    s = t.summary()
    assert s["pct_of_ceiling"] == pytest.approx(200.0)
    line = ceiling_line(s)
    assert line is not None and "200.0 % of the 500.0 tok/s" in line and "theoretical" in line
    assert ceiling_line({"available": False, "reason": "no GPU"}) == "  decode ceiling: not computed (no GPU)"
    assert ceiling_line(CeilingTracker(MODEL, Bandwidth(1.0, "configured")).summary()) == (
        "  decode ceiling: no decoding seen"
    )
    with pytest.raises(ValueError):
        CeilingTracker(MODEL, Bandwidth(0.0, "configured"))


def test_engine_points_carry_the_ceiling_fields() -> None:
    col = EngineCollector()
    col.ceiling = CeilingTracker(MODEL, Bandwidth(1000.0, "configured"))
    col.collect(0)  # the first point has no interval yet
    for _ in range(10):
        col.push(StepStats(time_ns=1, running=2, has_iteration=True, generation_tokens=2))
    (p,) = col.collect(2_000_000_000)
    assert p.fields["decode_tps"] == 10.0 and p.fields["decode_ceiling_tps"] == pytest.approx(2000.0)
    assert p.fields["decode_ceiling_pct"] == pytest.approx(0.5)
    (idle,) = col.collect(3_000_000_000)
    assert "decode_ceiling_pct" not in idle.fields
