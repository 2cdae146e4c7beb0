"""Judge a run against the criteria of config.toml: the named criteria over its request summary, and each
`[criteria] checks` line (parsed by lang.criteria) measured over its run-level metrics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from soakd.config import CriteriaConfig
from soakd.judge.metrics import RunMetrics
from soakd.judge.requests import RequestSummary, waited_share
from soakd.lang.criteria import DEFAULT_WINDOW_S, DISTRIBUTIONS, OPS, Check, parse_check


@dataclass(frozen=True, slots=True)
class CriterionResult:
    """One criterion: its threshold, the measured value, and whether it passed (None: not measurable)."""

    name: str
    op: str
    threshold: float
    value: float | None
    passed: bool
    detail: str = ""
    expr: str = ""
    """The `[criteria] checks` line this result judges (empty for the named criteria)."""
    informational: bool = False
    """A line that states a fact and does not judge (the duration of a run the operator stopped)."""


STOP_PHASES = ("setup", "engine_start", "warmup", "replay", "drain", "verdict")
"""The phases of `soakd run` a stop signal can come in, in order: setup (the config, the trace, the run
folder, the sinks), engine_start (an in-process start, or the wait for an attached server to be ready),
warmup, replay, drain (the replay's end: no more sends, the requests in flight finish), verdict (the
engine and the other parts stopping, the verdict being written)."""


@dataclass(frozen=True, slots=True)
class Ending:
    """How a run ended, as the verdict judges it. Not its crashes: those are `interruptions` (a daemon
    that died and was resumed, criterion `max_interruptions`)."""

    stopped_by: str = ""
    """The signal that stopped it before its end (SIGINT, SIGTERM, SIGHUP): the operator's stop. The run
    is judged on the work done; the duration line says how far it got."""
    error: str = ""
    """Why it ended early on its own (the engine died past its restarts, an `abort_on` criterion, a
    changed trace): it has not shown the planned duration and cannot pass."""
    replay_began: bool = True
    """False for a run stopped (or failed) before its replay began: nothing was replayed to judge."""
    stopped_in: str = ""
    """The phase a stop signal came in (`STOP_PHASES`: setup, engine_start, warmup, replay, drain,
    verdict); empty when not stopped, or in a file written before the phase was recorded."""

    @property
    def early(self) -> bool:
        """Stopped or ended before its planned end."""
        return bool(self.stopped_by or self.error)


def evaluate(
    criteria: CriteriaConfig,
    summary: RequestSummary,
    *,
    ran_s: float,
    planned_s: float,
    ending: Ending | None = None,
    interruptions: int = 0,
    lost_in_flight: int = 0,
    metrics: RunMetrics | None = None,
) -> list[CriterionResult]:
    """Judge the summary (and, for `checks`, the run's metrics). A criterion whose value cannot be
    measured fails: no data is no evidence."""
    results: list[CriterionResult] = []

    def check(
        name: str,
        op: str,
        threshold: float | bool,
        value: float | None,
        detail: str = "",
        no_data: str = "no data",
    ) -> None:
        if threshold is False:
            return
        if value is None:
            results.append(CriterionResult(name, op, float(threshold), None, False, no_data))
            return
        results.append(CriterionResult(name, op, float(threshold), value, OPS[op](value, threshold), detail))

    results.append(_duration(ran_s, planned_s, ending or Ending()))
    check(
        "error_rate",
        "<=",
        criteria.max_error_rate,
        summary.error_rate,
        f"{summary.failed} of {summary.completed + summary.failed} finished; "
        f"{summary.incomplete} left at the run's end not counted"
        if summary.incomplete
        else "",
        # Nothing finished: every request the replay sent was cut by its end.
        f"no data: none finished; {summary.incomplete} left at the run's end"
        if summary.incomplete
        else "no data",
    )
    check(
        "ttft_p99_ms",
        "<=",
        criteria.ttft_p99_ms,
        summary.ttft_offered.p99_ms if summary.ttft_offered else None,
        _ttft_detail(summary),
    )
    check("tpot_p99_ms", "<=", criteria.tpot_p99_ms, summary.tpot.p99_ms if summary.tpot else None)
    check(
        "completed_ratio",
        ">=",
        criteria.min_completed_ratio,
        summary.completed_ratio,
        f"{summary.completed} of {summary.scheduled} scheduled"
        + (_incomplete_detail(summary) if summary.incomplete else ""),
    )
    if criteria.max_interruptions is not False:
        check(
            "interruptions",
            "<=",
            criteria.max_interruptions,
            float(interruptions),
            f"daemon restarts resumed; {lost_in_flight} requests lost in flight" if interruptions else "",
        )
    context = run_context(ran_s, interruptions, lost_in_flight)
    for text in [*criteria.checks, *criteria.abort_on]:
        parsed = parse_check(text)  # validated when the config was loaded
        value, note = measure(parsed, metrics, context) if metrics is not None else (None, "")
        passed = value is not None and OPS[parsed.op](value, parsed.threshold)
        detail = note if value is not None else ("no data" + (f": {note}" if note else ""))
        results.append(CriterionResult(parsed.name, parsed.op, parsed.threshold, value, passed, detail, text))
    return results


def _incomplete_detail(summary: RequestSummary) -> str:
    unsent = f", {summary.incomplete_unsent} never sent" if summary.incomplete_unsent else ""
    return f"; {summary.incomplete} left at the run's end{unsent}"


def _ttft_detail(summary: RequestSummary) -> str:
    """What the TTFT criterion's figure is, beside the server's view and, when the ceiling bound, the
    admission wait inside it."""
    parts = ["as offered: from the due time"]
    if summary.ttft is not None and summary.ttft.p99_ms is not None:
        parts.append(f"from the send {summary.ttft.p99_ms:,.0f} ms")
    share = summary.admission_wait_share
    if share and summary.queue is not None and summary.queue.p99_ms is not None:
        parts.append(
            f"admission ceiling bound: {waited_share(share)} waited, p99 wait {summary.queue.p99_ms:,.0f} ms"
        )
    return "; ".join(parts)


def _duration(ran_s: float, planned_s: float, ending: Ending) -> CriterionResult:
    """The duration line. A run that ended early on its own has not shown the planned duration: it
    fails (the drain may push ran_s past the mark, but the soak did not finish). An operator's stop is
    not a failure: the line is informational and the verdict judges the work done, unless nothing was
    replayed at all."""
    threshold = planned_s * 0.99
    name = "duration_completed_s"
    if ending.error:
        return CriterionResult(name, ">=", threshold, ran_s, False, f"ended early: {ending.error}"[:200])
    if ending.stopped_by and not ending.replay_began:
        detail = f"stopped by {ending.stopped_by} before the replay began: nothing to judge"
        return CriterionResult(name, ">=", threshold, ran_s, False, detail)
    if ending.stopped_by:
        detail = (
            f"stopped at {ran_s:.0f} of {planned_s:.0f} s by {ending.stopped_by}: "
            "the verdict judges the work done"
        )
        return CriterionResult(name, ">=", threshold, ran_s, True, detail, informational=True)
    return CriterionResult(name, ">=", threshold, ran_s, ran_s >= threshold, f"planned {planned_s:.0f} s")


def run_context(duration_s: float, interruptions: int, lost_in_flight: int) -> dict[str, float]:
    """The metrics that come from the run itself, not from its points (measure's `context`): how long
    it ran, the crashes it was resumed from and the requests lost in flight at them."""
    return {
        "duration_s": duration_s,
        "interruptions": float(interruptions),
        "lost_in_flight": float(lost_in_flight),
    }


def first_abort(
    criteria: CriteriaConfig, metrics: RunMetrics, context: dict[str, float]
) -> CriterionResult | None:
    """The first `abort_on` check that fails now (one with no data yet does not abort), or None."""
    for text in criteria.abort_on:
        parsed = parse_check(text)
        value, note = measure(parsed, metrics, context)
        if value is not None and not OPS[parsed.op](value, parsed.threshold):
            return CriterionResult(parsed.name, parsed.op, parsed.threshold, value, False, note, text)
    return None


def measure(check: Check, metrics: RunMetrics, context: Mapping[str, float]) -> tuple[float | None, str]:
    """The check's measured value (None: nothing to measure) and a short note on what it covered."""
    if check.agg is None:
        if check.metric in context:
            return context[check.metric], ""
        return metrics.scalar(check.metric), ""
    if check.agg == "events":
        return float(metrics.events.get(check.metric, 0)), ""
    if check.metric in DISTRIBUTIONS:
        q = metrics.requests.quantiles(check.metric)
        raw = {"p": q.percentile(check.q or 0.0), "min": q.min, "max": q.max, "mean": q.mean}[check.agg]
        return (raw * 1000.0 if raw is not None else None), f"{len(q)} requests"
    if check.agg == "sustained_ratio":
        first_s, last_s = check.kwargs["first"], check.kwargs["last"]
        span = metrics.span_s
        if span < max(first_s, last_s):
            return None, f"the replay ran {span:.0f} s, shorter than first={first_s:g}s / last={last_s:g}s"
        first = metrics.over(check.metric, first_s=first_s)
        last = metrics.over(check.metric, last_s=last_s)
        if first is None or last is None or first == 0:
            return None, "no data in the first or last span"
        note = "spans overlap" if first_s + last_s > span else ""
        return last / first, f"last {last:.4g} / first {first:.4g}" + (f"; {note}" if note else "")
    window = check.kwargs.get("window", DEFAULT_WINDOW_S)
    points = metrics.windows(check.metric, window)
    if not points:
        return None, ""
    values = [v for _, v in points]
    value = (
        min(values)
        if check.agg == "min"
        else max(values)
        if check.agg == "max"
        else sum(values) / len(values)
    )
    return value, f"{len(values)} windows of {window:g} s"
