"""Engine stats: conversion from vLLM's stats objects and per-interval aggregation."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from soakd.collectors.engine import EngineCollector
from soakd.config import load
from soakd.engine.stats import StepStats, step_from_vllm
from soakd.engine.vllm_local import config_id, engine_kwargs


# Stand-ins shaped like vLLM 0.32's SchedulerStats / IterationStats (the real ones are exercised by the
# integration test against a real engine).
@dataclass
class _Prefix:
    queries: int = 0
    hits: int = 0


@dataclass
class _Spec:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass
class _Mode:
    name: str


@dataclass
class _CG:
    runtime_mode: object
    num_unpadded_tokens: int
    num_padded_tokens: int
    num_paddings: int


@dataclass
class _Sched:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: _Prefix = field(default_factory=_Prefix)
    spec_decoding_stats: _Spec | None = None
    cudagraph_stats: _CG | None = None


@dataclass
class _Prompt:
    total: int = 0
    local_cache_hit: int = 0


@dataclass
class _Iter:
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0
    prompt_token_stats: _Prompt = field(default_factory=_Prompt)
    finished_requests: list[object] = field(default_factory=list)


def test_conversion_reads_every_field() -> None:
    sched = _Sched(
        3,
        2,
        0.25,
        _Prefix(100, 64),
        _Spec(2, 6, 4, [2, 1, 1], [2, 2, 2]),
        _CG(_Mode("CUDAGraphMode.FULL"), 5, 8, 3),
    )
    it = _Iter(7, 1, _Prompt(120, 64), [object(), object()])
    s = step_from_vllm(sched, it, 11, 0)
    assert (s.running, s.waiting, s.kv_cache_usage) == (3, 2, 0.25)
    assert (s.prefix_queries, s.prefix_hits) == (100, 64)
    assert (s.spec_drafts, s.spec_draft_tokens, s.spec_accepted) == (2, 6, 4)
    assert s.spec_accepted_per_pos == (2, 1, 1) and s.spec_draft_tokens_per_pos == (2, 2, 2)
    assert s.cg_mode == "FULL" and (s.cg_unpadded_tokens, s.cg_padded_tokens, s.cg_paddings) == (5, 8, 3)
    assert (s.generation_tokens, s.preempted, s.prompt_tokens, s.prompt_tokens_cached, s.finished) == (
        7,
        1,
        120,
        64,
        2,
    )
    assert s.has_spec and s.has_iteration


def test_conversion_tolerates_missing_parts() -> None:
    s = step_from_vllm(None, None, 5, 1)
    assert s == StepStats(time_ns=5, engine_idx=1)
    s = step_from_vllm(_Sched(cudagraph_stats=_CG("NONE", 4, 4, 0)), None, 5, 0)
    assert s.cg_mode == "NONE" and not s.has_spec


def step(**kw: object) -> StepStats:
    return StepStats(time_ns=1, **kw)  # type: ignore[arg-type]


def test_interval_aggregation_and_acceptance_per_position() -> None:
    c = EngineCollector(config_id="abc")
    c.push(
        step(
            running=2,
            has_iteration=True,
            generation_tokens=8,
            prompt_tokens=100,
            has_prefix=True,
            prefix_queries=100,
            prefix_hits=50,
            has_spec=True,
            spec_drafts=2,
            spec_draft_tokens=6,
            spec_accepted=3,
            spec_accepted_per_pos=(2, 1, 0),
            spec_draft_tokens_per_pos=(2, 2, 2),
        )
    )
    c.push(
        step(
            running=4,
            has_iteration=True,
            generation_tokens=4,
            has_spec=True,
            spec_drafts=1,
            spec_draft_tokens=2,
            spec_accepted=2,
            spec_accepted_per_pos=(1, 1),
            spec_draft_tokens_per_pos=(1, 1),
        )
    )
    engine, spec = c.collect(99)
    assert engine.measurement == "engine" and engine.tags == {"config": "abc"} and engine.time_ns == 99
    f = engine.fields
    assert f["steps"] == 2 and f["running_max"] == 4 and f["running_mean"] == 3.0
    assert f["prefix_hit_rate"] == 0.5 and f["generation_tokens"] == 12
    assert "cg_hit_rate" not in f  # no CUDA graphs: not applicable, never a fake 0%
    assert "prompt_tokens_cached" not in f  # the steps carried no cached count: left out, not 0
    s = spec.fields
    assert (s["drafts"], s["draft_tokens"], s["accepted"]) == (3, 8, 5)
    assert s["acceptance_rate"] == pytest.approx(5 / 8)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)
    assert (s["accepted_pos0"], s["draft_tokens_pos0"], s["acceptance_rate_pos0"]) == (3, 3, 1.0)
    assert s["acceptance_rate_pos2"] == 0.0 and s["draft_tokens_pos2"] == 2
    # the next interval starts empty
    (empty,) = c.collect(100)
    assert empty.fields["steps"] == 0
    assert c.steps_total == 2 and c.spec_accepted_total == 5


def test_cuda_graph_hit_rate_when_the_engine_has_graphs() -> None:
    c = EngineCollector(cudagraphs=True)
    c.push(step(cg_mode="FULL", cg_unpadded_tokens=5, cg_padded_tokens=8, cg_paddings=3))
    c.push(step(cg_mode="PIECEWISE", cg_unpadded_tokens=16, cg_padded_tokens=16))
    c.push(step(cg_mode="NONE", cg_unpadded_tokens=600, cg_padded_tokens=600))
    (engine,) = c.collect(1)
    f = engine.fields
    assert f["cg_steps"] == 3 and f["cg_graph_steps"] == 2
    assert f["cg_hit_rate"] == pytest.approx(2 / 3)
    assert f["cg_padding_waste"] == pytest.approx(3 / 24)


def test_engine_kwargs_follow_config() -> None:
    cfg = load(None, {"engine.speculative.method": "mtp", "engine.extra_args": {"attention_backend": "X"}})
    kw = engine_kwargs(cfg.engine, "/m")
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert kw["attention_backend"] == "X" and kw["model"] == "/m" and kw["cudagraph_metrics"] is True
    off = engine_kwargs(load(None, {"engine.speculative.enabled": False}).engine, "/m")
    assert "speculative_config" not in off
    assert config_id(kw) == config_id(dict(kw)) != config_id(off)


def test_steps_before_activation_are_discarded() -> None:
    c = EngineCollector(active=False)
    c.push(step(generation_tokens=5, has_iteration=True))
    assert c.collect(1) == []
    c.push(step(generation_tokens=7, has_iteration=True))  # queued before activation: dropped too
    c.activate()
    c.push(step(generation_tokens=3, has_iteration=True))
    (engine,) = c.collect(2)
    assert engine.fields["generation_tokens"] == 3 and c.steps_total == 1


def test_releases_without_per_position_draft_counts_fall_back_to_drafts() -> None:
    @dataclass
    class OldSpec:
        num_drafts: int = 4
        num_draft_tokens: int = 12
        num_accepted_tokens: int = 6
        num_accepted_tokens_per_pos: list[int] = field(default_factory=lambda: [3, 2, 1])

    s = step_from_vllm(_Sched(spec_decoding_stats=OldSpec()), None, 1, 0)  # type: ignore[arg-type]
    assert s.spec_draft_tokens_per_pos == (4, 4, 4)


def test_counts_a_release_does_not_report_are_left_out_not_zero() -> None:
    """A vLLM without prefix-cache stats or cached prompt-token counts (engine/compat.py: degraded or
    off) gives steps without them: the interval has no such field, rather than a 0 that reads as a
    measured 0% hit rate; from stats objects that carry them, the fields are back."""

    class Sched:
        num_running_reqs = 1
        num_waiting_reqs = 0
        kv_cache_usage = 0.1

    class Iter:
        num_generation_tokens = 3
        num_prompt_tokens = 40
        finished_requests = ()

    bare = step_from_vllm(Sched(), Iter(), 1, 0)
    c = EngineCollector(config_id="x")
    c.push(bare)
    (engine, *_) = c.collect(5)
    assert engine.fields["prompt_tokens"] == 40
    absent = {"prefix_queries", "prefix_hits", "prefix_hit_rate", "prompt_tokens_cached"}
    assert not absent & set(engine.fields)

    class Pcs:
        queries, hits = 40, 10

    class Pts:
        total, local_cache_hit = 40, 10

    Sched.prefix_cache_stats = Pcs()  # type: ignore[attr-defined]
    Iter.prompt_token_stats = Pts()  # type: ignore[attr-defined]
    c.push(step_from_vllm(Sched(), Iter(), 2, 0))
    (engine, *_) = c.collect(6)
    f = engine.fields
    assert (f["prefix_queries"], f["prefix_hits"], f["prompt_tokens_cached"]) == (40, 10, 10)
    assert f["prefix_hit_rate"] == 0.25


def test_prompt_tokens_computed_are_a_running_total_from_the_first_step_with_counts() -> None:
    """What the throughput judge reads at its own tick: prompt tokens computed (prefix-cache hits left
    out), summed as steps arrive, None until a step that counts its cached tokens came; warm-up is not
    counted."""
    c = EngineCollector(active=False)
    c.push(StepStats(time_ns=1, has_iteration=True, prompt_tokens=500))
    c.activate()
    assert c.prompt_computed_total is None
    c.push(StepStats(time_ns=2, running=3))  # no iteration stats: nothing to count
    assert c.prompt_computed_total is None
    c.push(
        StepStats(
            time_ns=3, has_iteration=True, has_cached_count=True, prompt_tokens=300, prompt_tokens_cached=100
        )
    )
    # A step without a cached count (a release that does not report it) adds nothing: its hits would
    # count as work.
    c.push(StepStats(time_ns=4, has_iteration=True, generation_tokens=8, prompt_tokens=700))
    assert c.prompt_computed_total == 200
    c.collect(10)
    assert c.prompt_computed_total == 200  # a total, not the interval's
