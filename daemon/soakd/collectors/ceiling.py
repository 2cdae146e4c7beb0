"""The memory traffic decode steps cause, as a share of the bandwidth ceiling, per interval and over the run.

A decode step reads the weights once and each running sequence's KV cache, however many tokens it
yields: with speculation one step verifies k drafts and emits up to k + 1 tokens. So the share is
counted in steps, not tokens:

    bytes per step = weights + batch * kv_bytes_per_token * context
    decode_bw_pct  = 100 * decode steps/s * bytes per step / bandwidth

`batch` is the sequences in each decode step (running after the step plus those it finished), and
`context` the mean context a decoding sequence holds (prompt plus half its output, averaged over the
requests finished so far; weights only until the first finishes). At a fixed step cost the share
follows the step rate alone, so it cannot rise when the engine slows down, and it does not pass 100 %
because a step happens to yield several tokens. Tokens per step and steps/s are reported beside it.

`decode_ceiling_tps` is what the same steps would yield if they ran back to back at the bandwidth
limit (bandwidth / bytes per step x tokens per step): a tokens/s figure at this interval's batch,
context and acceptance, never a share. Runs recorded before this counted tokens against a tokens
ceiling (`decode_ceiling_pct`, `pct_of_ceiling`); `ceiling_line` still reads their summaries.

Not counted: steps that produce no token (a prefill chunk that samples nothing) read the weights too,
but their time is compute-bound prefill, not decode; they stay in the engine point's `steps`, so
`steps - decode_steps` gives them, and the share is a lower bound of the bytes read by that much. A
draft model's own weight reads (EAGLE, a draft LM) are left out as well; ngram drafting reads none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from soakd.judge.requests import Quantiles
from soakd.metric import FieldValue
from soakd.probe import ModelBytes


@dataclass(frozen=True, slots=True)
class Bandwidth:
    gbs: float
    source: str
    """"configured" (telemetry.ceiling_bandwidth_gbs), "theoretical" (NVML bus width x memory clock)."""


@dataclass(frozen=True, slots=True)
class DecodeSteps:
    """One interval's decode steps, as the engine collector counts them from the per-step stats."""

    steps: int
    """Steps that produced output tokens (each read the weights once)."""
    batch_sum: float
    """Sum over those steps of the sequences each one ran."""
    tokens: int
    """Output tokens of those steps."""


class _Share:
    """Time-weighted mean, p50 and max of a per-interval percentage."""

    __slots__ = ("pcts", "seconds", "weighted")

    def __init__(self) -> None:
        self.weighted = 0.0
        self.seconds = 0.0
        self.pcts = Quantiles()

    def add(self, pct: float, interval_s: float) -> None:
        self.weighted += pct * interval_s
        self.seconds += interval_s
        self.pcts.add(pct)

    def summary(self, prefix: str) -> dict[str, object]:
        return {
            prefix: self.weighted / self.seconds if self.seconds else None,
            f"{prefix}_p50": self.pcts.percentile(50),
            f"{prefix}_max": self.pcts.max,
        }


class CeilingTracker:
    """Fed each finished request (`observe_request`) and each interval's decode steps (`interval`)."""

    def __init__(self, model: ModelBytes, bandwidth: Bandwidth) -> None:
        if bandwidth.gbs <= 0:
            raise ValueError("bandwidth must be positive")
        self.model = model
        self.bandwidth = bandwidth
        self.measured_dram_pct: Callable[[], float | None] | None = None
        """NVML GPM's DRAM bandwidth share of the latest slow read (mean over GPUs), when the GPU has
        GPM: summed over the same busy intervals, so the run compares measured with computed."""
        self._ctx_sum = 0.0
        self._ctx_n = 0
        self._tokens = 0
        self._steps = 0
        self._bytes = 0.0
        self._busy_s = 0.0
        self._share = _Share()
        self._measured = _Share()

    def observe_request(self, input_tokens: int, output_tokens: int) -> None:
        if output_tokens > 0:
            self._ctx_sum += input_tokens + output_tokens / 2
            self._ctx_n += 1

    @property
    def context_tokens(self) -> float:
        """Mean context of a decoding sequence so far (0 before any request finished)."""
        return self._ctx_sum / self._ctx_n if self._ctx_n else 0.0

    def bytes_per_step(self, batch: float) -> float:
        """Weights once plus `batch` sequences' KV at the current mean context."""
        kv = (self.model.kv_bytes_per_token or 0) * self.context_tokens * max(batch, 1.0)
        return self.model.weight_bytes + kv

    def interval(self, decode: DecodeSteps, interval_s: float) -> dict[str, FieldValue]:
        """The `engine` point's decode fields for one interval; empty when no step decoded."""
        if decode.steps <= 0 or interval_s <= 0:
            return {}
        batch = decode.batch_sum / decode.steps
        per_step = self.bytes_per_step(batch)
        traffic = decode.steps * per_step
        bw = self.bandwidth.gbs * 1e9
        pct = 100.0 * traffic / interval_s / bw
        tokens_per_step = decode.tokens / decode.steps
        self._tokens += decode.tokens
        self._steps += decode.steps
        self._bytes += traffic
        self._busy_s += interval_s
        self._share.add(pct, interval_s)
        fields: dict[str, FieldValue] = {
            "decode_steps": decode.steps,
            # Prefixed: the point's tokens_per_step_* count scheduled tokens (prompts too) of every step.
            "decode_steps_per_s": decode.steps / interval_s,
            "decode_tokens_per_step": tokens_per_step,
            "decode_batch_mean": batch,
            "decode_bytes_per_step": per_step,
            "decode_bw_pct": pct,
            "decode_tps": decode.tokens / interval_s,
            "decode_ceiling_tps": bw / per_step * tokens_per_step,
            "decode_context_tokens": self.context_tokens,
        }
        measured = self.measured_dram_pct() if self.measured_dram_pct is not None else None
        if measured is not None:
            self._measured.add(measured, interval_s)
        return fields

    def summary(self) -> dict[str, object]:
        busy = self._busy_s
        bw = self.bandwidth.gbs * 1e9
        out: dict[str, object] = {
            "available": True,
            "basis": "engine steps",
            "bandwidth_gbs": self.bandwidth.gbs,
            "bandwidth_source": self.bandwidth.source,
            "weight_bytes": self.model.weight_bytes,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "busy_s": round(busy, 3),
            "decode_steps": self._steps,
            "steps_per_s": self._steps / busy if busy else None,
            "tokens_per_step": self._tokens / self._steps if self._steps else None,
            "bytes_per_step": self._bytes / self._steps if self._steps else None,
            "decode_tps": self._tokens / busy if busy else None,
            # Tokens/s the run's steps would have yielded back to back at the bandwidth limit.
            "ceiling_tps": self._tokens * bw / self._bytes if self._bytes else None,
            # bw_pct: all bytes read over what the bandwidth allowed in the same busy time.
            **self._share.summary("bw_pct"),
            "context_tokens": self.context_tokens,
        }
        if self._measured.seconds:
            out.update(self._measured.summary("gpm_dram_bw_pct"))
            out["gpm_busy_s"] = round(self._measured.seconds, 3)
        return out


def ceiling_line(summary: dict[str, object] | None) -> str | None:
    """One line for the run's printout and the report, or None when there is nothing to say."""
    if not summary:
        return None
    if not summary.get("available"):
        return f"  decode ceiling: not computed ({summary.get('reason', 'unknown')})"
    if "bw_pct" not in summary:
        return _recorded_line(summary)
    pct = summary.get("bw_pct")
    if not isinstance(pct, float):
        return "  decode ceiling: no decoding seen"
    measured = summary.get("gpm_dram_bw_pct")
    gpm = f"; GPM measured DRAM {measured:.1f} %" if isinstance(measured, float) else ""
    return (
        f"  decode: {summary['decode_tps']:.1f} tok/s while busy, {summary['steps_per_s']:.1f} steps/s x "
        f"{summary['tokens_per_step']:.2f} tok/step; weight+KV reads {pct:.1f} % of "
        f"{summary['bandwidth_gbs']:g} GB/s ({summary['bandwidth_source']}; "
        f"p50 {summary['bw_pct_p50']:.1f} %, max {summary['bw_pct_max']:.1f} %){gpm}"
    )


def _recorded_line(summary: dict[str, object]) -> str:
    """A summary written before steps were counted: tokens over a tokens ceiling, said as such."""
    pct = summary.get("pct_of_ceiling")
    if not isinstance(pct, float):
        return "  decode ceiling: no decoding seen"
    return (
        f"  decode: {summary['decode_tps']:.1f} tok/s while busy = {pct:.1f} % of the "
        f"{summary['ceiling_tps']:.1f} tok/s bandwidth ceiling ({summary['bandwidth_gbs']:g} GB/s, "
        f"{summary['bandwidth_source']}; counted in tokens, so speculation can pass 100 %)"
    )
