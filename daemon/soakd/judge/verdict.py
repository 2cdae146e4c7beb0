"""The verdict of a run: PASS/FAIL with its evidence, judged from its folded points (`verdict_of`) and
written atomically to the run directory by the one writer of verdict.json (`write_verdict`).

Two different things a reader must not confuse:
- `stopped_early`: this run's replay ended before its planned duration, either by the operator's stop
  (`stopped_by`: SIGINT, SIGTERM, SIGHUP; judged on the work done) or on its own (`ended_early`: the
  engine died past its restarts, an `abort_on` criterion; it cannot pass).
- `interruptions`: daemon crashes the run was resumed from (criterion `max_interruptions`).
Verdicts written before `stopped_early` existed have `interrupted` in its place (read by `stopped_early`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from soakd.config import CriteriaConfig
from soakd.errors import EXIT_ERROR, EXIT_FAIL, EXIT_OK, EXIT_STOPPED
from soakd.files import write_json_atomic
from soakd.judge.criteria import CriterionResult, Ending, evaluate, run_context
from soakd.judge.metrics import RunMetrics
from soakd.judge.requests import RequestSummary
from soakd.rundir import VERDICT_FILE


@dataclass(frozen=True, slots=True)
class Verdict:
    run_id: str
    passed: bool
    criteria: list[CriterionResult]
    requests: RequestSummary
    ran_s: float
    planned_s: float
    ending: Ending
    exit_code: int
    """The exit code `soakd run` returns with this verdict (exit_code_of)."""
    interruptions: list[dict[str, Any]] = field(default_factory=list)
    """Daemon crashes the run was resumed from: replay time, downtime, requests lost in flight."""
    metrics: dict[str, float | None] = field(default_factory=dict)
    """Every run-level metric by its criteria name (soakd.judge.metrics), for reports and comparisons."""

    @property
    def word(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "verdict": self.word,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "ran_s": self.ran_s,
            "planned_s": self.planned_s,
            "stopped_early": self.ending.early,
            "stopped_by": self.ending.stopped_by,
            "stopped_in": self.ending.stopped_in,
            "ended_early": self.ending.error,
            "replay_began": self.ending.replay_began,
            "interruptions": self.interruptions,
            "lost_in_flight": lost_in_flight(self.interruptions),
            "criteria": [asdict(c) for c in self.criteria],
            "requests": self.requests.to_dict(),
            "metrics": self.metrics,
        }

    def lines(self) -> list[str]:
        """Human-readable verdict, one criterion per line."""
        return verdict_lines(self.to_dict())


def exit_code_of(passed: bool, ending: Ending, stopped_code: int = EXIT_STOPPED) -> int:
    """What `soakd run` exits with: 3 ended early on its own, the stopped code (4; the systemd unit asks
    for 0) for an operator's stop, else 0 PASS / 1 FAIL."""
    if ending.error:
        return EXIT_ERROR
    if ending.stopped_by:
        return stopped_code
    return EXIT_OK if passed else EXIT_FAIL


def stopped_early(doc: Mapping[str, Any]) -> bool:
    """Whether a verdict.json (or summary.json) says the run stopped before its end; older files say
    `interrupted`."""
    return bool(doc.get("stopped_early", doc.get("interrupted", False)))


def stop_note(doc: Mapping[str, Any]) -> str:
    """How a verdict.json's run stopped early, in a few words for people; empty when it ran its course."""
    if not stopped_early(doc):
        return ""
    ran, planned = float(doc.get("ran_s") or 0.0), float(doc.get("planned_s") or 0.0)
    if doc.get("ended_early"):
        return f"ended early on its own at {ran:.0f} s of {planned:.0f} s: {doc['ended_early']}"
    by = doc.get("stopped_by")
    if not by:
        return "stopped before the end"
    # Files written before the phase was recorded have no `stopped_in`.
    phase = doc.get("stopped_in")
    where = f" in {phase}" if phase else ""
    if doc.get("replay_began") is False:
        return f"stopped by {by}{where} before the replay began: nothing was replayed"
    return f"stopped early by {by}{where} at {ran:.0f} s of {planned:.0f} s: the verdict judges the work done"


def verdict_lines(doc: Mapping[str, Any]) -> list[str]:
    """A verdict (verdict.json's object) for people: the word, how it stopped, one criterion per line."""
    out = [f"{doc.get('verdict', '?')}  run {doc.get('run_id', '?')}"]
    note = stop_note(doc)
    if note:
        out.append(f"  {note}")
    for c in doc.get("criteria") or []:
        value = "no data" if c.get("value") is None else f"{c['value']:.4g}"
        mark = "info" if c.get("informational") else "ok  " if c.get("passed") else "FAIL"
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
    ending: Ending | None = None,
    stopped_code: int = EXIT_STOPPED,
    interruptions: list[dict[str, Any]] | None = None,
    metrics: dict[str, float | None] | None = None,
) -> Verdict:
    ending = ending or Ending()
    passed = bool(criteria) and all(c.passed for c in criteria)
    return Verdict(
        run_id,
        passed,
        criteria,
        requests,
        ran_s,
        planned_s,
        ending,
        exit_code_of(passed, ending, stopped_code),
        interruptions or [],
        metrics or {},
    )


def verdict_of(
    run_id: str,
    criteria: CriteriaConfig,
    metrics: RunMetrics,
    *,
    ran_s: float,
    planned_s: float,
    interruptions: list[dict[str, Any]],
    ending: Ending | None = None,
    stopped_code: int = EXIT_STOPPED,
) -> Verdict:
    """The verdict over the run's folded points and its interruptions (nothing is written)."""
    lost = lost_in_flight(interruptions)
    # One accounting: the criteria, `metrics`, `checks` and everything that reads them count the lost.
    metrics.lost_in_flight = lost
    requests = metrics.summary()
    results = evaluate(
        criteria,
        requests,
        ran_s=ran_s,
        planned_s=planned_s,
        ending=ending,
        interruptions=len(interruptions),
        lost_in_flight=lost,
        metrics=metrics,
    )
    values = {**metrics.scalars(), **run_context(ran_s, len(interruptions), lost)}
    for r in results:
        if r.expr:
            values.setdefault(r.name, r.value)
    return make_verdict(
        run_id,
        results,
        requests,
        ran_s=ran_s,
        planned_s=planned_s,
        ending=ending,
        stopped_code=stopped_code,
        interruptions=interruptions,
        metrics=values,
    )


def write_verdict(run_dir: Path, verdict: Verdict, *, remove_if_refused: bool = False) -> None:
    """Write the run's verdict.json (atomically): the one place it is written. OSError when the disk
    refuses it; with `remove_if_refused`, an earlier verdict.json is removed first (best effort), so that
    none is left that says otherwise than the run that could not write its own."""
    path = run_dir / VERDICT_FILE
    try:
        write_json_atomic(path, verdict.to_dict())
    except OSError:
        if remove_if_refused:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        raise
