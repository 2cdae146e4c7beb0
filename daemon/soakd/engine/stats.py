"""soakd's own typed per-step engine stats, converted from vLLM's (unstable) stats classes.

vLLM documents SchedulerStats and IterationStats as not stable interfaces, so every read of them is
here, defensive about fields that differ between releases (0.26 on the GPU machine, 0.32 on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from soakd.engine.base import SpecSteps


@dataclass(slots=True)
class StepStats:
    """What one engine step (one `record()` call) did. Counts are for this step alone."""

    time_ns: int
    """Wall time the step's stats reached soakd, ns since the epoch."""
    engine_idx: int = 0
    """Data-parallel engine index."""
    running: int = 0
    """Requests running after the step."""
    waiting: int = 0
    """Requests waiting after the step."""
    kv_cache_usage: float = 0.0
    """Fraction of KV-cache blocks in use (0-1)."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache this step."""
    prefix_hits: int = 0
    """Of those, tokens found in the cache."""
    prompt_tokens: int = 0
    """Prompt tokens prefilled this step (computed + cached)."""
    prompt_tokens_cached: int = 0
    """Prompt tokens served from the local prefix cache this step."""
    generation_tokens: int = 0
    """Output tokens produced this step."""
    preempted: int = 0
    """Requests preempted this step."""
    finished: int = 0
    """Requests that finished this step."""
    has_iteration: bool = False
    """True when the step carried iteration stats (tokens, finished requests)."""
    spec_drafts: int = 0
    """Speculative drafts proposed (one per request per step)."""
    spec_draft_tokens: int = 0
    """Draft tokens proposed."""
    spec_accepted: int = 0
    """Draft tokens accepted."""
    spec_accepted_per_pos: tuple[int, ...] = ()
    """Accepted tokens per draft position."""
    spec_draft_tokens_per_pos: tuple[int, ...] = ()
    """Draft tokens per draft position (ngram may propose fewer than k)."""
    has_spec: bool = False
    """True when the step carried speculative-decoding stats."""
    cg_mode: str | None = None
    """CUDA-graph runtime mode of the step ("NONE", "PIECEWISE", "FULL"); None: not reported."""
    cg_unpadded_tokens: int = 0
    """Tokens the step really ran."""
    cg_padded_tokens: int = 0
    """Tokens after padding to the captured graph size."""
    cg_paddings: int = 0
    """Padding tokens added."""
    has_prefix: bool = False
    """True when the step carried prefix-cache stats (a release without them reports no lookups)."""
    has_cached_count: bool = False
    """True when the step's prompt tokens came with the count served from the cache."""


def _int(obj: object, name: str) -> int:
    value = getattr(obj, name, 0)
    return int(value) if isinstance(value, int | float) else 0


def _ints(obj: object, name: str) -> tuple[int, ...]:
    value = getattr(obj, name, None)
    if value is None:
        return ()
    return tuple(int(v) for v in value)


def step_from_vllm(
    scheduler_stats: object | None, iteration_stats: object | None, time_ns: int, engine_idx: int
) -> StepStats:
    """Convert one `StatLoggerBase.record()` call's arguments into a StepStats."""
    step = StepStats(time_ns=time_ns, engine_idx=engine_idx)
    if scheduler_stats is not None:
        step.running = _int(scheduler_stats, "num_running_reqs")
        step.waiting = _int(scheduler_stats, "num_waiting_reqs")
        usage = getattr(scheduler_stats, "kv_cache_usage", 0.0)
        step.kv_cache_usage = float(usage) if isinstance(usage, int | float) else 0.0
        pcs = getattr(scheduler_stats, "prefix_cache_stats", None)
        if pcs is not None:
            step.has_prefix = True
            step.prefix_queries = _int(pcs, "queries")
            step.prefix_hits = _int(pcs, "hits")
        sd = getattr(scheduler_stats, "spec_decoding_stats", None)
        if sd is not None:
            step.has_spec = True
            step.spec_drafts = _int(sd, "num_drafts")
            step.spec_draft_tokens = _int(sd, "num_draft_tokens")
            step.spec_accepted = _int(sd, "num_accepted_tokens")
            step.spec_accepted_per_pos = _ints(sd, "num_accepted_tokens_per_pos")
            step.spec_draft_tokens_per_pos = _ints(sd, "num_draft_tokens_per_pos")
            if not step.spec_draft_tokens_per_pos and step.spec_accepted_per_pos:
                # Releases without per-position draft counts: divide by drafts, as vLLM's own log does
                # (exact when every draft has k tokens; a lower bound of the rate otherwise).
                step.spec_draft_tokens_per_pos = (step.spec_drafts,) * len(step.spec_accepted_per_pos)
        cg = getattr(scheduler_stats, "cudagraph_stats", None)
        if cg is not None:
            mode = getattr(cg, "runtime_mode", None)
            # The mode arrives as a str or an enum depending on the release; keep its bare name.
            step.cg_mode = str(getattr(mode, "name", mode)).rsplit(".", 1)[-1]
            step.cg_unpadded_tokens = _int(cg, "num_unpadded_tokens")
            step.cg_padded_tokens = _int(cg, "num_padded_tokens")
            step.cg_paddings = _int(cg, "num_paddings")
    if iteration_stats is not None:
        step.has_iteration = True
        step.generation_tokens = _int(iteration_stats, "num_generation_tokens")
        step.preempted = _int(iteration_stats, "num_preempted_reqs")
        pts = getattr(iteration_stats, "prompt_token_stats", None)
        if pts is not None:
            step.has_cached_count = True
            step.prompt_tokens = _int(pts, "total")
            step.prompt_tokens_cached = _int(pts, "local_cache_hit")
        else:
            step.prompt_tokens = _int(iteration_stats, "num_prompt_tokens")
        finished = getattr(iteration_stats, "finished_requests", None)
        step.finished = len(finished) if finished is not None else 0
    return step


_WIRE_FIELDS: tuple[str, ...] = tuple(f for f in StepStats.__dataclass_fields__ if f != "engine_idx")


def step_to_wire(step: StepStats) -> list[object]:
    """A StepStats as a JSON-able list (field order fixed by `_WIRE_FIELDS`; compact and fast)."""
    return [step.engine_idx, *(getattr(step, f) for f in _WIRE_FIELDS)]


def step_from_wire(values: list[object]) -> StepStats:
    """The inverse of `step_to_wire`; raises ValueError on a list of the wrong shape."""
    if not isinstance(values, list) or len(values) != len(_WIRE_FIELDS) + 1:
        raise ValueError("step stats of the wrong shape")
    step = StepStats(time_ns=0, engine_idx=int(values[0]))  # type: ignore[call-overload]
    for name, value in zip(_WIRE_FIELDS, values[1:], strict=True):
        if name in ("spec_accepted_per_pos", "spec_draft_tokens_per_pos"):
            setattr(step, name, tuple(int(v) for v in value))  # type: ignore[attr-defined]
        else:
            setattr(step, name, value)
    return step


@dataclass(slots=True)
class RecordCost:
    """Time soakd's stat logger spends in record(), per engine step (its overhead on the engine loop)."""

    n: int = 0
    total_ns: int = 0
    max_ns: int = 0

    def add(self, ns: int) -> None:
        self.n += 1
        self.total_ns += ns
        self.max_ns = max(self.max_ns, ns)

    def summary(self) -> dict[str, object]:
        return {
            "steps": self.n,
            "record_us_mean": self.total_ns / self.n / 1e3 if self.n else None,
            "record_us_max": self.max_ns / 1e3 if self.n else None,
        }


def copy_spec_steps(metrics: object, out: SpecSteps) -> None:
    """Per-step acceptance from vLLM's per-request metrics (an object or its dict form) into `out`."""
    get = metrics.get if isinstance(metrics, dict) else lambda k, d=None: getattr(metrics, k, d)
    accepted = get("per_step_accepted", None)
    drafted = get("per_step_drafted", None)
    # The "summary" level has no per-step lists (None over HTTP, empty in-process): nothing to copy.
    if accepted and drafted and len(accepted) == len(drafted):
        out.accepted[:] = [int(a) for a in accepted]
        out.drafted[:] = [int(d) for d in drafted]
