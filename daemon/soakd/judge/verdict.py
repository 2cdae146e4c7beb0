"""The verdict of a run: PASS/FAIL with its evidence, written atomically to the run directory."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from soakd.judge.criteria import CriterionResult, RequestSummary


@dataclass(frozen=True, slots=True)
class Verdict:
    run_id: str
    passed: bool
    criteria: list[CriterionResult]
    requests: RequestSummary
    ran_s: float
    planned_s: float
    interrupted: bool
    interruptions: list[dict[str, Any]] = field(default_factory=list)
    """Daemon crashes the run was resumed from: replay time, downtime, requests lost in flight."""
    metrics: dict[str, float | None] = field(default_factory=dict)
    """Every run-level metric by its criteria name (soakd.judge.metrics), for reports and comparisons."""

    @property
    def word(self) -> str:
        return "PASS" if self.passed else "FAIL"

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "verdict": self.word,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "ran_s": self.ran_s,
            "planned_s": self.planned_s,
            "interrupted": self.interrupted,
            "interruptions": self.interruptions,
            "lost_in_flight": lost_in_flight(self.interruptions),
            "criteria": [asdict(c) for c in self.criteria],
            "requests": self.requests.to_dict(),
            "metrics": self.metrics,
        }

    def lines(self) -> list[str]:
        """Human-readable verdict, one criterion per line."""
        return verdict_lines(self.to_dict())


def verdict_lines(doc: Mapping[str, Any]) -> list[str]:
    """A verdict (verdict.json's object) for people: the word, then one criterion per line."""
    out = [f"{doc.get('verdict', '?')}  run {doc.get('run_id', '?')}"]
    for c in doc.get("criteria") or []:
        value = "no data" if c.get("value") is None else f"{c['value']:.4g}"
        mark = "ok  " if c.get("passed") else "FAIL"
        extra = f"  ({c['detail']})" if c.get("detail") else ""
        out.append(
            f"  {mark} {c.get('name')} = {value} (must be {c.get('op')} {c.get('threshold', 0):g}){extra}"
        )
    for i in doc.get("interruptions") or []:
        out.append(
            f"  resumed after a crash at {float(i['at_s']):.0f} s of replay: down "
            f"{float(i['down_s']):.1f} s, {int(i['lost_in_flight'])} requests lost in flight"
        )
    return out


def lost_in_flight(interruptions: Iterable[Mapping[str, Any]]) -> int:
    """Requests in flight at the crashes a run was resumed from (a checkpoint's interruptions)."""
    return sum(int(i.get("lost_in_flight", 0)) for i in interruptions)


def make_verdict(
    run_id: str,
    criteria: list[CriterionResult],
    requests: RequestSummary,
    *,
    ran_s: float,
    planned_s: float,
    interrupted: bool,
    interruptions: list[dict[str, Any]] | None = None,
    metrics: dict[str, float | None] | None = None,
) -> Verdict:
    passed = bool(criteria) and all(c.passed for c in criteria)
    return Verdict(
        run_id, passed, criteria, requests, ran_s, planned_s, interrupted, interruptions or [], metrics or {}
    )
