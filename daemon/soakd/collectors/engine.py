"""Per-interval aggregation of the engine's per-step stats into `engine` and `spec_decode` samples."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from soakd.collectors.ceiling import CeilingTracker, DecodeSteps
from soakd.collectors.spec import AcceptanceDrift
from soakd.engine.stats import StepStats
from soakd.metric import FieldValue, Sample

if TYPE_CHECKING:
    from soakd.engine.base import EngineInfo

_MODES = ("NONE", "PIECEWISE", "FULL")
# Distinct tokens-per-step values kept for the run's histogram; a step is at most
# max_num_batched_tokens, so this only bounds a misconfigured engine.
_HIST_MAX_KEYS = 1 << 16


def quantile_of_counts(counts: dict[int, int], q: float) -> int:
    """The q-quantile (0-1, nearest rank) of values given as {value: count}."""
    total = sum(counts.values())
    if total == 0:
        raise ValueError("no values")
    rank = max(1, round(q * total + 0.5 - 1e-9)) if q > 0 else 1
    rank = min(rank, total)
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return max(counts)


def decode_steps(steps: Sequence[StepStats]) -> DecodeSteps:
    """The steps that decoded: one `record()` call is one engine step, and a step that produced output
    tokens ran a forward pass that read the weights once (one verify pass under speculation, however
    many tokens it accepted). Steps without output tokens (a prefill chunk that samples nothing, a
    stats-only call) are left out: see soakd.collectors.ceiling."""
    n = 0
    batch = 0.0
    tokens = 0
    for s in steps:
        if s.generation_tokens > 0:
            n += 1
            # `running` is counted after the step: the requests it finished were in its batch too.
            batch += max(s.running + s.finished, 1)
            tokens += s.generation_tokens
    return DecodeSteps(n, batch, tokens)


class EngineCollector:
    """Receives StepStats from the stat logger (`push`) and sums them per collection interval.

    CUDA-graph fields are written only when the engine can run graphs at all: on a build without
    them every step reports mode NONE, and a 0% hit rate would be a lie, not a measurement.
    """

    name = "engine"

    def __init__(
        self,
        config_id: str = "",
        cudagraphs: bool = False,
        active: bool = True,
        drift: AcceptanceDrift | None = None,
    ) -> None:
        self._steps: deque[StepStats] = deque()
        self.drift = drift
        self.tokens_per_step: Counter[int] = Counter()
        """Run-wide histogram of tokens scheduled per step (what graph capture sizes should cover)."""
        self.cg_mode_steps: Counter[str] = Counter()
        """Run-wide steps per CUDA-graph runtime mode."""
        self.config_id = config_id
        self.cudagraphs = cudagraphs
        self.active = active
        """While False, steps are discarded: engine start-up and warm-up are not the soak's traffic."""
        self._last_ns: int | None = None
        self.steps_total = 0
        self.spec_drafts_total = 0
        self.spec_accepted_total = 0
        self.prompt_computed_total: int | None = None
        """Prompt tokens computed since activation, prefix-cache hits left out; None until a step that
        counts its cached prompt tokens came (an engine that reports none, or a release without the
        count). Added up as steps arrive, not when collected, so the control loop reads it at its own
        tick. vLLM credits a prompt to the step that prefills its last chunk."""
        self._engine: EngineInfo | None = None
        self.ceiling: CeilingTracker | None = None
        """When set, each busy point also says the decode steps' memory traffic as % of the bandwidth."""

    def engine_started(self, info: EngineInfo) -> None:
        """After a (re)build every engine series carries the configuration's id; a draft setting that
        changed is judged anew against its own first window (other settings accept differently)."""
        last = self._engine
        self.config_id = info.config_id
        self.cudagraphs = info.cudagraphs
        if last is not None and last.speculative_tokens != info.speculative_tokens and self.drift is not None:
            self.drift.reset()
        self._engine = info

    def activate(self) -> None:
        """From now on steps are traffic; those before (start-up, warm-up) were dropped by `push`."""
        self.active = True

    def push(self, step: StepStats) -> None:
        """Called once per engine step, from one thread at a time (the prompt total is a read-modify-write;
        deque.append itself is atomic).

        While inactive the step is dropped at once, so nothing piles up when nobody collects."""
        if self.active:
            self._steps.append(step)
            if step.has_cached_count:
                # One writer (the event loop's thread, where steps arrive), so no lock: readers see an
                # old or a new total. Without a cached count the hits would count as work (on a
                # cache-heavy trace 20x the output tokens): the total stays None, output tokens alone.
                self.prompt_computed_total = (self.prompt_computed_total or 0) + max(
                    0, step.prompt_tokens - step.prompt_tokens_cached
                )

    def collect(self, now_ns: int) -> Sequence[Sample]:
        if not self.active:
            return []  # nothing was queued (push drops steps while inactive)
        steps: list[StepStats] = []
        while self._steps:
            steps.append(self._steps.popleft())
        last, self._last_ns = self._last_ns, now_ns
        tags = {"config": self.config_id} if self.config_id else {}
        fields = self._engine_fields(steps)
        spec = self._spec_fields(steps)
        if last is not None:
            # What the point's counts cover, so a dashboard computes rates as sum(x) / sum(interval_s).
            interval_s = (now_ns - last) / 1e9
            fields["interval_s"] = interval_s
            if self.ceiling is not None:
                fields.update(self.ceiling.interval(decode_steps(steps), interval_s))
            if spec:
                spec["interval_s"] = interval_s
                if self.drift is not None:
                    spec.update(
                        self.drift.update(
                            interval_s,
                            int(spec["accepted"]),
                            int(spec["draft_tokens"]),
                            int(spec["drafts"]),
                        )
                    )
        out = [Sample("engine", fields, now_ns, tags=dict(tags))]
        if spec:
            out.append(Sample("spec_decode", spec, now_ns, tags=dict(tags)))
        return out

    def _engine_fields(self, steps: list[StepStats]) -> dict[str, FieldValue]:
        self.steps_total += len(steps)
        n = len(steps)
        f: dict[str, FieldValue] = {"steps": n}
        sched = [s for s in steps if s.has_iteration or s.running or s.waiting]
        if sched:
            f["running_max"] = max(s.running for s in sched)
            f["running_mean"] = sum(s.running for s in sched) / len(sched)
            f["waiting_max"] = max(s.waiting for s in sched)
            f["kv_cache_usage_max"] = max(s.kv_cache_usage for s in sched)
            f["kv_cache_usage_mean"] = sum(s.kv_cache_usage for s in sched) / len(sched)
        # A count the engine's release does not report is left out, never written as 0 (engine/compat.py).
        if any(s.has_prefix for s in steps):
            queries = sum(s.prefix_queries for s in steps)
            hits = sum(s.prefix_hits for s in steps)
            f["prefix_queries"] = queries
            f["prefix_hits"] = hits
            if queries:
                f["prefix_hit_rate"] = hits / queries
        gen = sum(s.generation_tokens for s in steps)
        f["prompt_tokens"] = sum(s.prompt_tokens for s in steps)
        if any(s.has_cached_count for s in steps):
            f["prompt_tokens_cached"] = sum(s.prompt_tokens_cached for s in steps)
        f["generation_tokens"] = gen
        f["preempted"] = sum(s.preempted for s in steps)
        f["finished"] = sum(s.finished for s in steps)
        if n:
            f["tokens_per_step_mean"] = (gen + sum(s.prompt_tokens for s in steps)) / n
        f.update(self._batch_fields(steps))
        if self.cudagraphs:
            f.update(self._cudagraph_fields(steps))
        return f

    def _batch_fields(self, steps: list[StepStats]) -> dict[str, FieldValue]:
        """Tokens per step: the batch the engine really ran, and the histogram re-capture sizes need."""
        interval: Counter[int] = Counter()
        for s in steps:
            # The graph stat counts the tokens the model ran; without it, the iteration's tokens.
            tokens = s.cg_unpadded_tokens if s.cg_mode is not None else s.prompt_tokens + s.generation_tokens
            if tokens > 0:
                interval[tokens] += 1
        if not interval:
            return {}
        for value, count in interval.items():
            if value in self.tokens_per_step or len(self.tokens_per_step) < _HIST_MAX_KEYS:
                self.tokens_per_step[value] += count
        counts = dict(interval)
        return {
            "tokens_per_step_p50": quantile_of_counts(counts, 0.5),
            "tokens_per_step_p90": quantile_of_counts(counts, 0.9),
            "tokens_per_step_p99": quantile_of_counts(counts, 0.99),
            "tokens_per_step_max": max(counts),
        }

    def _cudagraph_fields(self, steps: list[StepStats]) -> dict[str, FieldValue]:
        f: dict[str, FieldValue] = {}
        cg = [s for s in steps if s.cg_mode is not None]
        f["cg_steps"] = len(cg)
        graph = [s for s in cg if s.cg_mode != "NONE"]
        f["cg_graph_steps"] = len(graph)
        for mode in _MODES:
            k = sum(1 for s in cg if s.cg_mode == mode)
            f[f"cg_steps_{mode.lower()}"] = k
            if k:
                self.cg_mode_steps[mode] += k
        padded = sum(s.cg_padded_tokens for s in graph)
        unpadded = sum(s.cg_unpadded_tokens for s in cg)
        graph_tokens = sum(s.cg_unpadded_tokens for s in graph)
        paddings = sum(s.cg_paddings for s in graph)
        f["cg_unpadded_tokens"] = unpadded
        f["cg_graph_tokens"] = graph_tokens
        f["cg_padded_tokens"] = padded
        f["cg_paddings"] = paddings
        if cg:
            f["cg_hit_rate"] = len(graph) / len(cg)
        if unpadded:
            f["cg_token_hit_rate"] = graph_tokens / unpadded
        if padded:
            f["cg_padding_waste"] = paddings / padded
        return f

    def cudagraph_summary(self) -> dict[str, object]:
        """Run totals for the summary; says "not applicable" outright where no graphs can run."""
        if not self.cudagraphs:
            return {
                "applicable": False,
                "reason": "the engine runs without CUDA graphs (CPU build or eager mode)",
            }
        total = sum(self.cg_mode_steps.values())
        graph = total - self.cg_mode_steps.get("NONE", 0)
        return {
            "applicable": True,
            "steps": total,
            "steps_by_mode": dict(self.cg_mode_steps),
            "hit_rate": graph / total if total else None,
        }

    def _spec_fields(self, steps: list[StepStats]) -> dict[str, FieldValue]:
        spec = [s for s in steps if s.has_spec]
        if not spec:
            return {}
        drafts = sum(s.spec_drafts for s in spec)
        draft_tokens = sum(s.spec_draft_tokens for s in spec)
        accepted = sum(s.spec_accepted for s in spec)
        self.spec_drafts_total += drafts
        self.spec_accepted_total += accepted
        f: dict[str, FieldValue] = {
            "steps": len(spec),
            "drafts": drafts,
            "draft_tokens": draft_tokens,
            "accepted": accepted,
        }
        if draft_tokens:
            f["acceptance_rate"] = accepted / draft_tokens
        if drafts:
            # Tokens produced per draft step: the accepted ones plus the one the target model adds.
            f["mean_acceptance_length"] = 1.0 + accepted / drafts
        # Requests drafting per step: how much of the batch speculation covers.
        f["drafts_per_step"] = drafts / len(spec)
        k = max(len(s.spec_accepted_per_pos) for s in spec)
        for i in range(k):
            acc = sum(s.spec_accepted_per_pos[i] for s in spec if i < len(s.spec_accepted_per_pos))
            drafted = sum(
                s.spec_draft_tokens_per_pos[i] for s in spec if i < len(s.spec_draft_tokens_per_pos)
            )
            f[f"accepted_pos{i}"] = acc
            f[f"draft_tokens_pos{i}"] = drafted
            if drafted:
                f[f"acceptance_rate_pos{i}"] = acc / drafted
        return f

    def close(self) -> None:
        self._steps.clear()
