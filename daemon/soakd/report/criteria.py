"""Summarise a run's request records and judge them against the criteria of config.toml."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from soakd.config import CriteriaConfig
from soakd.metric import Sample


def _pct(values: npt.NDArray[np.float64], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


@dataclass(slots=True)
class LatencyStats:
    """Percentiles of one latency, in milliseconds."""

    count: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        ms = np.asarray(seconds, dtype=float) * 1000.0
        return cls(
            count=len(ms),
            p50_ms=_pct(ms, 50),
            p90_ms=_pct(ms, 90),
            p99_ms=_pct(ms, 99),
            max_ms=float(ms.max()) if len(ms) else None,
        )


@dataclass(slots=True)
class RequestSummary:
    """What the request records of a run add up to."""

    scheduled: int = 0
    completed: int = 0
    failed: int = 0
    shed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    first_ns: int | None = None
    last_ns: int | None = None
    ttft: LatencyStats | None = None
    tpot: LatencyStats | None = None
    e2e: LatencyStats | None = None
    lateness: LatencyStats | None = None
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def error_rate(self) -> float | None:
        done = self.completed + self.failed
        return self.failed / done if done else None

    @property
    def completed_ratio(self) -> float | None:
        return self.completed / self.scheduled if self.scheduled else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["error_rate"] = self.error_rate
        d["completed_ratio"] = self.completed_ratio
        return d


class RequestFolder:
    """Folds `requests` samples into a RequestSummary one at a time.

    `soakd run` feeds it as records are written, so the verdict needs no re-read of a night's spool at
    shutdown (when systemd's stop timeout is running); `soakd report` feeds it from the spool. Both
    go through this one fold, so they agree. Latencies are kept as float arrays (8 bytes each).
    """

    def __init__(self) -> None:
        self._s = RequestSummary()
        self._ttft = array("d")
        self._tpot = array("d")
        self._e2e = array("d")
        self._late = array("d")

    def add(self, sample: Sample) -> None:
        if sample.measurement != "requests":
            return
        s = self._s
        f = sample.fields
        s.scheduled += 1
        s.first_ns = sample.time_ns if s.first_ns is None else min(s.first_ns, sample.time_ns)
        s.last_ns = sample.time_ns if s.last_ns is None else max(s.last_ns, sample.time_ns)
        status = sample.tags.get("status", "error")
        self._late.append(_num(f.get("lateness_s")) or 0.0)
        if status == "shed":
            s.shed += 1
            return
        if status == "ok":
            s.completed += 1
            for name, dest in (("ttft_s", self._ttft), ("tpot_s", self._tpot), ("e2e_s", self._e2e)):
                value = _num(f.get(name))
                if value is not None:
                    dest.append(value)
        else:
            s.failed += 1
            kind = str(f.get("error", "unknown")).split(":", 1)[0]
            s.errors[kind] = s.errors.get(kind, 0) + 1
        tokens_in = f.get("input_tokens", 0)
        tokens_out = f.get("output_tokens", 0)
        s.input_tokens += int(tokens_in) if isinstance(tokens_in, int) else 0
        s.output_tokens += int(tokens_out) if isinstance(tokens_out, int) else 0

    def summary(self) -> RequestSummary:
        s = self._s
        s.ttft = LatencyStats.of(self._ttft)
        s.tpot = LatencyStats.of(self._tpot)
        s.e2e = LatencyStats.of(self._e2e)
        s.lateness = LatencyStats.of(self._late)
        return s


def _num(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def summarize(samples: Iterable[Sample]) -> RequestSummary:
    """Fold `requests` samples (one per request) into a summary; other measurements are ignored."""
    folder = RequestFolder()
    for sample in samples:
        folder.add(sample)
    return folder.summary()


@dataclass(frozen=True, slots=True)
class CriterionResult:
    """One criterion: its threshold, the measured value, and whether it passed (None: not measurable)."""

    name: str
    op: str
    threshold: float
    value: float | None
    passed: bool
    detail: str = ""


def evaluate(
    criteria: CriteriaConfig,
    summary: RequestSummary,
    *,
    ran_s: float,
    planned_s: float,
    interrupted: bool = False,
) -> list[CriterionResult]:
    """Judge the summary. A criterion whose value cannot be measured fails: no data is no evidence."""
    results: list[CriterionResult] = []

    def check(name: str, op: str, threshold: float | bool, value: float | None, detail: str = "") -> None:
        if threshold is False:
            return
        if value is None:
            results.append(CriterionResult(name, op, float(threshold), None, False, "no data"))
            return
        ok = value <= threshold if op == "<=" else value >= threshold
        results.append(CriterionResult(name, op, float(threshold), value, ok, detail))

    # A soak stopped early has not shown what the full duration would: it cannot pass.
    if interrupted:
        # Stopped early: the drain may push ran_s past the mark, but the soak did not finish.
        results.append(
            CriterionResult(
                "duration_completed_s", ">=", planned_s * 0.99, ran_s, False, "stopped before the end"
            )
        )
    else:
        check("duration_completed_s", ">=", planned_s * 0.99, ran_s, f"planned {planned_s:.0f} s")
    check("error_rate", "<=", criteria.max_error_rate, summary.error_rate)
    check("ttft_p99_ms", "<=", criteria.ttft_p99_ms, summary.ttft.p99_ms if summary.ttft else None)
    check("tpot_p99_ms", "<=", criteria.tpot_p99_ms, summary.tpot.p99_ms if summary.tpot else None)
    check(
        "completed_ratio",
        ">=",
        criteria.min_completed_ratio,
        summary.completed_ratio,
        f"{summary.completed} of {summary.scheduled} scheduled",
    )
    return results
