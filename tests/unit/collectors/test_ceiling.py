"""Decode memory traffic as % of the bandwidth ceiling: the tracker's arithmetic in engine steps, its
engine points, speculation, and the printout line for new and recorded summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soakd.collectors.ceiling import Bandwidth, CeilingTracker, DecodeSteps, ceiling_line
from soakd.collectors.engine import EngineCollector, decode_steps
from soakd.engine.stats import StepStats
from soakd.probe import ModelBytes, tokens_per_s_ceiling

MODEL = ModelBytes(model_dir="m", weight_bytes=1_000_000_000, kv_bytes_per_token=100_000)
# Qwen3-8B's shape as measured on the H200: 16.4 GB of bf16 weights, 36 layers x 8 KV heads x 128 x 2 B x K,V.
QWEN3_8B = ModelBytes(model_dir="q", weight_bytes=16_400_000_000, kv_bytes_per_token=36 * 2 * 8 * 128 * 2)
H200 = Bandwidth(4800.0, "theoretical")
DATA = Path(__file__).resolve().parents[2] / "data" / "h200"


def test_interval_share_is_steps_times_bytes_per_step_over_the_bandwidth() -> None:
    t = CeilingTracker(MODEL, Bandwidth(1000.0, "configured"))
    # Before any request finished: weights only, 1 GB a step. 500 steps in 1 s at 1000 GB/s: 50 %.
    f = t.interval(DecodeSteps(steps=500, batch_sum=2000.0, tokens=2000), 1.0)
    assert f["decode_bw_pct"] == pytest.approx(50.0) and f["decode_bytes_per_step"] == 1e9
    assert f["decode_steps_per_s"] == 500.0 and f["decode_tokens_per_step"] == 4.0
    assert f["decode_batch_mean"] == 4.0 and f["decode_tps"] == 2000.0
    # Back to back at the bandwidth: 1000 steps/s x 4 tokens.
    assert f["decode_ceiling_tps"] == pytest.approx(4000.0)
    t.observe_request(input_tokens=1000, output_tokens=400)  # decodes at 1200 tokens of context on average
    t.observe_request(input_tokens=500, output_tokens=0)  # failed before any token: says nothing
    assert t.context_tokens == 1200.0
    f = t.interval(DecodeSteps(steps=200, batch_sum=800.0, tokens=1500), 0.5)
    per_step = 1e9 + 4 * 1200 * 100_000
    assert f["decode_bytes_per_step"] == pytest.approx(per_step)
    assert f["decode_bw_pct"] == pytest.approx(100 * 200 * per_step / 0.5 / 1e12)
    # Where every sequence yields one token a step, the tokens/s ceiling is the probe's formula.
    f1 = CeilingTracker(MODEL, Bandwidth(1000.0, "configured")).interval(DecodeSteps(10, 40.0, 40), 1.0)
    assert f1["decode_ceiling_tps"] == pytest.approx(
        tokens_per_s_ceiling(MODEL.weight_bytes, None, 1000.0, 4)
    )
    assert t.interval(DecodeSteps(0, 0.0, 0), 1.0) == {}  # idle intervals are not judged
    s = t.summary()
    assert s["busy_s"] == 1.5 and s["decode_tps"] == pytest.approx(3500 / 1.5)
    assert s["decode_steps"] == 700 and s["tokens_per_step"] == pytest.approx(3500 / 700)
    # Time-weighted: all bytes read over what the bandwidth allowed in the same busy time.
    assert s["bw_pct"] == pytest.approx(100 * (500 * 1e9 + 200 * per_step) / 1.5 / 1e12)
    assert s["bw_pct_max"] == pytest.approx(max(50.0, 100 * 200 * per_step / 0.5 / 1e12))
    assert s["bw_pct_p50"] is not None and "gpm_dram_bw_pct" not in s


def test_speculation_at_3_9_tokens_a_step_stays_under_the_bandwidth() -> None:
    """The H200 soak: ngram k=3, ~3.9 tokens per sequence per step. Counted in tokens against a tokens
    ceiling it read 110 %; counted in the steps that read the weights it is a share that fits."""
    batch, steps_per_s, context = 32, 70, 1000
    t = CeilingTracker(QWEN3_8B, H200)
    t.observe_request(input_tokens=context - 1, output_tokens=2)  # 1000 tokens of context
    tokens = round(steps_per_s * batch * 3.9)
    f = t.interval(DecodeSteps(steps_per_s, float(batch * steps_per_s), tokens), 1.0)
    assert f["decode_tokens_per_step"] == pytest.approx(batch * 3.9, rel=1e-3)
    old_ceiling = tokens_per_s_ceiling(
        QWEN3_8B.weight_bytes, QWEN3_8B.kv_bytes_per_token, H200.gbs, batch, round(t.context_tokens)
    )
    old_pct = 100 * tokens / old_ceiling
    assert old_pct > 100  # what decode_ceiling_pct said
    pct = float(f["decode_bw_pct"])
    assert pct < 100 and pct == pytest.approx(old_pct / 3.9, rel=1e-2)
    # The tokens/s ceiling counts the same 3.9 tokens a step: throughput stays under it.
    assert float(f["decode_tps"]) < float(f["decode_ceiling_tps"])
    line = ceiling_line(t.summary())
    assert line is not None and "tok/step" in line and f"{pct:.1f} % of 4800 GB/s (theoretical" in line


def test_lower_batch_or_slower_steps_never_raise_the_share() -> None:
    def share(steps: int, batch: float, tokens_per_seq: float) -> tuple[float, float]:
        t = CeilingTracker(QWEN3_8B, H200)
        t.observe_request(input_tokens=2000, output_tokens=400)
        f = t.interval(DecodeSteps(steps, batch * steps, round(steps * batch * tokens_per_seq)), 1.0)
        return float(f["decode_bw_pct"]), float(f["decode_tps"])

    base_pct, base_tps = share(80, 32.0, 3.9)
    # The H200's downscale: a lower batch at the same step rate gives fewer tokens and reads less KV.
    low_pct, low_tps = share(80, 24.0, 3.9)
    assert low_tps < base_tps and low_pct < base_pct
    # At a fixed step cost, throughput falls with fewer steps or fewer accepted tokens; the share never rises.
    fewer_pct, fewer_tps = share(60, 32.0, 3.9)
    assert fewer_tps < base_tps and fewer_pct < base_pct
    worse_pct, worse_tps = share(80, 32.0, 1.5)
    assert worse_tps < base_tps and worse_pct == pytest.approx(base_pct)


def test_measured_dram_share_is_summed_over_the_same_busy_intervals() -> None:
    t = CeilingTracker(MODEL, Bandwidth(1000.0, "configured"))
    readings = iter([40.0, None, 20.0, 99.0])
    t.measured_dram_pct = lambda: next(readings)
    t.interval(DecodeSteps(300, 300.0, 300), 1.0)  # 30 %, GPM 40 %
    t.interval(DecodeSteps(300, 300.0, 300), 1.0)  # GPM gave nothing this time
    t.interval(DecodeSteps(100, 100.0, 100), 3.0)  # ~3.3 %, GPM 20 %
    t.interval(DecodeSteps(0, 0.0, 0), 1.0)  # idle: GPM not asked
    s = t.summary()
    assert s["gpm_dram_bw_pct"] == pytest.approx((40.0 * 1 + 20.0 * 3) / 4)
    assert s["gpm_dram_bw_pct_max"] == 40.0 and s["gpm_busy_s"] == 4.0
    line = ceiling_line(s)
    assert line is not None and "GPM measured DRAM 25.0 %" in line


def test_lines_for_no_ceiling_no_decoding_and_recorded_summaries() -> None:
    assert ceiling_line(None) is None
    assert ceiling_line({"available": False, "reason": "no GPU"}) == "  decode ceiling: not computed (no GPU)"
    assert ceiling_line(CeilingTracker(MODEL, Bandwidth(1.0, "configured")).summary()) == (
        "  decode ceiling: no decoding seen"
    )
    with pytest.raises(ValueError):
        CeilingTracker(MODEL, Bandwidth(0.0, "configured"))
    # Summaries recorded before steps were counted still read, and say what they counted.
    recorded = json.loads((DATA / "soak10m" / "summary.json").read_text())["decode_ceiling"]
    line = ceiling_line(recorded)
    assert line is not None and "0.3 % of the 3554641.3 tok/s bandwidth ceiling" in line
    assert "counted in tokens" in line


def test_decode_steps_are_the_steps_that_produced_tokens() -> None:
    steps = [
        StepStats(time_ns=1, running=4, has_iteration=True, generation_tokens=4),
        # Finished two: they were in the batch, `running` is counted after the step.
        StepStats(time_ns=2, running=2, finished=2, has_iteration=True, generation_tokens=4),
        StepStats(time_ns=3, running=3),  # a prefill chunk that sampled nothing: not a decode step
        StepStats(time_ns=4, running=0, has_iteration=True, prompt_tokens=100),  # no output either
    ]
    assert decode_steps(steps) == DecodeSteps(steps=2, batch_sum=8.0, tokens=8)


def test_engine_points_carry_the_decode_fields() -> None:
    col = EngineCollector()
    col.ceiling = CeilingTracker(MODEL, Bandwidth(1000.0, "configured"))
    col.collect(0)  # the first point has no interval yet
    for _ in range(10):
        col.push(StepStats(time_ns=1, running=2, has_iteration=True, generation_tokens=2))
    col.push(StepStats(time_ns=1, running=2))  # prefill-only: counted in `steps`, not in `decode_steps`
    (p,) = col.collect(2_000_000_000)
    assert p.fields["steps"] == 11 and p.fields["decode_steps"] == 10
    assert p.fields["decode_tps"] == 10.0 and p.fields["decode_steps_per_s"] == 5.0
    # 5 steps/s x 1 GB over 1000 GB/s; back to back the same steps give 1000 x 2 tokens a second.
    assert p.fields["decode_bw_pct"] == pytest.approx(0.5)
    assert p.fields["decode_ceiling_tps"] == pytest.approx(2000.0)
    assert "decode_ceiling_pct" not in p.fields
    (idle,) = col.collect(3_000_000_000)
    assert "decode_bw_pct" not in idle.fields
