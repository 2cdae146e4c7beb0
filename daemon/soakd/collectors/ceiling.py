"""Decode throughput as a share of the memory-bandwidth ceiling, per interval and over the run.

`soakd probe` gives the ceiling for a fixed batch and context; during a soak both move. Each interval
the ceiling is taken at that interval's mean running batch and the mean context a decoding sequence
holds (prompt plus half its output, averaged over the requests finished so far; weights only until
the first finishes):

    ceiling tokens/s = batch * bandwidth / (weights + batch * kv_bytes_per_token * context)

A run near 100 % has little left to tune; one far below points at scheduling, kernels or clocks. With
speculative decoding a step can yield several tokens per weight read, so more than 100 % is possible.
"""

from __future__ import annotations

from dataclasses import dataclass

from soakd.metric import FieldValue
from soakd.probe import ModelBytes
from soakd.report.criteria import Quantiles


@dataclass(frozen=True, slots=True)
class Bandwidth:
    gbs: float
    source: str
    """"configured" (telemetry.ceiling_bandwidth_gbs), "theoretical" (NVML bus width x memory clock)."""


class CeilingTracker:
    """Fed each finished request (`observe_request`) and each interval's engine totals (`interval`)."""

    def __init__(self, model: ModelBytes, bandwidth: Bandwidth) -> None:
        if bandwidth.gbs <= 0:
            raise ValueError("bandwidth must be positive")
        self.model = model
        self.bandwidth = bandwidth
        self._ctx_sum = 0.0
        self._ctx_n = 0
        self._tokens = 0
        self._busy_s = 0.0
        self._ceiling_token_s = 0.0  # sum over busy intervals of ceiling tokens/s x interval
        self._pcts = Quantiles()

    def observe_request(self, input_tokens: int, output_tokens: int) -> None:
        if output_tokens > 0:
            self._ctx_sum += input_tokens + output_tokens / 2
            self._ctx_n += 1

    @property
    def context_tokens(self) -> float:
        """Mean context of a decoding sequence so far (0 before any request finished)."""
        return self._ctx_sum / self._ctx_n if self._ctx_n else 0.0

    def ceiling_tps(self, batch: float) -> float:
        batch = max(batch, 1.0)
        kv = (self.model.kv_bytes_per_token or 0) * self.context_tokens * batch
        return batch * self.bandwidth.gbs * 1e9 / (self.model.weight_bytes + kv)

    def interval(
        self, generation_tokens: int, running_mean: float | None, interval_s: float
    ) -> dict[str, FieldValue]:
        """The `engine` point's ceiling fields for one interval; empty when nothing was generated."""
        if generation_tokens <= 0 or interval_s <= 0:
            return {}
        ceiling = self.ceiling_tps(running_mean or 1.0)
        tps = generation_tokens / interval_s
        pct = 100.0 * tps / ceiling
        self._tokens += generation_tokens
        self._busy_s += interval_s
        self._ceiling_token_s += ceiling * interval_s
        self._pcts.add(pct)
        return {
            "decode_tps": tps,
            "decode_ceiling_tps": ceiling,
            "decode_ceiling_pct": pct,
            "decode_context_tokens": self.context_tokens,
        }

    def summary(self) -> dict[str, object]:
        return {
            "available": True,
            "bandwidth_gbs": self.bandwidth.gbs,
            "bandwidth_source": self.bandwidth.source,
            "weight_bytes": self.model.weight_bytes,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "busy_s": round(self._busy_s, 3),
            "decode_tps": self._tokens / self._busy_s if self._busy_s else None,
            "ceiling_tps": self._ceiling_token_s / self._busy_s if self._busy_s else None,
            # Tokens over what the ceiling allowed in the same busy time: a time-weighted share.
            "pct_of_ceiling": 100.0 * self._tokens / self._ceiling_token_s if self._ceiling_token_s else None,
            "pct_p50": self._pcts.percentile(50),
            "pct_max": self._pcts.max,
            "context_tokens": self.context_tokens,
        }


def ceiling_line(summary: dict[str, object] | None) -> str | None:
    """One line for the run's printout and the report, or None when there is nothing to say."""
    if not summary:
        return None
    if not summary.get("available"):
        return f"  decode ceiling: not computed ({summary.get('reason', 'unknown')})"
    pct = summary.get("pct_of_ceiling")
    if not isinstance(pct, float):
        return "  decode ceiling: no decoding seen"
    return (
        f"  decode: {summary['decode_tps']:.1f} tok/s while busy = {pct:.1f} % of the "
        f"{summary['ceiling_tps']:.1f} tok/s bandwidth ceiling ({summary['bandwidth_gbs']:g} GB/s, "
        f"{summary['bandwidth_source']})"
    )
