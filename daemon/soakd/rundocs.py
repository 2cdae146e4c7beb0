"""What one run says of itself besides its verdict: meta.json's document, summary.json's, the run's own
point (the dashboard's runs table), and its first and last events (run_start or run_resume, run_end).
The run (app.Soak) writes them."""

from __future__ import annotations

import platform
from dataclasses import asdict
from datetime import datetime
from typing import Any

from soakd import __version__
from soakd.checkpoint import Checkpoint
from soakd.config import Config
from soakd.errors import EXIT_ERROR
from soakd.judge.verdict import Verdict
from soakd.lifecycle import Stack
from soakd.live import LiveRun
from soakd.metric import FieldValue
from soakd.redact import redacted
from soakd.replay.runner import ReplayStats
from soakd.replay_part import ReplayPart
from soakd.sinks.writer import SampleWriter
from soakd.traces.model import TraceSummary


def meta_doc(
    cfg: Config,
    run_id: str,
    host: str,
    started_utc: str,
    trace: TraceSummary,
    checkpoint: Checkpoint | None,
    gpu_meta: dict[str, Any] | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """meta.json: what ran, where, on which config and trace (its secrets redacted)."""
    return {
        "run_id": run_id,
        "host": host,
        "soakd_version": __version__,
        "python": platform.python_version(),
        "started_utc": started_utc,
        "resumes": len(checkpoint.interruptions) if checkpoint is not None else 0,
        "config_source": cfg.source,
        "config": redacted(cfg.model_dump(mode="json")),
        "trace": asdict(trace),
        **({"gpu": gpu_meta} if gpu_meta is not None else {}),
        **extra,
    }


def start_event(writer: SampleWriter, run_id: str, live: LiveRun, resumed: bool) -> None:
    """The run's first event: run_start, or run_resume with the crash it comes back from."""
    planned_s = live.planned_s
    if not resumed:
        writer.event("run_start", f"soak {run_id} starting", planned_s=planned_s)
        return
    gaps = live.checkpoint.interruptions if live.checkpoint is not None else []
    last = gaps[-1] if gaps else None
    writer.event(
        "run_resume",
        f"soak {run_id} resumed at {live.offset_s:.0f} s of {planned_s:.0f} s"
        + (f" after {last.down_s:.0f} s down, {last.lost_in_flight} requests lost" if last else ""),
        at_s=live.offset_s,
        down_s=last.down_s if last else 0.0,
        lost_in_flight=last.lost_in_flight if last else 0,
        planned_s=planned_s,
    )


def end_event(writer: SampleWriter, live: LiveRun, ran_s: float, stats: ReplayStats) -> None:
    """The replay's end (run_end): how long it ran, whether a signal stopped it, what this process did."""
    writer.event(
        "run_end",
        f"replay ended after {ran_s:.1f} s" + (f" (stopped by {live.stopped_by})" if live.stopped_by else ""),
        ran_s=ran_s,
        completed=stats.completed,
        failed=stats.failed,
        incomplete=stats.incomplete,
    )


def run_point(
    verdict: Verdict, written: bool, ran_s: float, live: LiveRun, started_utc: str
) -> dict[str, FieldValue]:
    """The `run` point: the verdict's figures for the dashboards."""
    return {
        # Only a verdict on disk may claim PASS.
        "passed": int(verdict.passed and written),
        "ran_s": ran_s,
        "planned_s": live.planned_s,
        "requests": verdict.requests.scheduled,
        "completed": verdict.requests.completed,
        "failed": verdict.requests.failed,
        "incomplete": verdict.requests.incomplete,
        "verdict_written": int(written),
        # Stopped on purpose (a signal): judged on the work done; an alert on it is a warning (its
        # PASS is of a shorter run), not a page.
        "stopped": int(bool(live.stopped_by)),
        # The run's span in epoch ms (its first start, across resumes, to now): the dashboard's
        # runs table links each run to its own time range.
        "start_ms": int(datetime.fromisoformat(started_utc).timestamp() * 1000),
        "end_ms": live.clock.wall_ns() // 1_000_000,
    }


def summary_doc(
    run_id: str,
    verdict: Verdict,
    verdict_error: str,
    ran_s: float,
    replay: ReplayPart,
    writer: SampleWriter,
    run_stack: Stack,
    sinks: Stack,
) -> dict[str, Any]:
    """summary.json: how the run ended, what it did, and each part's own entries (read after the stacks
    stopped, so a part reports what its stop did)."""
    # How the run ended as its verdict judged it: a signal that came after the verdict was written
    # must not make the summary say otherwise than verdict.json and the exit code.
    ending = verdict.ending
    doc: dict[str, Any] = {
        "run_id": run_id,
        # Only a verdict on disk is claimed: with none, the word says so.
        "verdict": verdict.word if not verdict_error else "NOT WRITTEN",
        "verdict_error": verdict_error,
        "exit_code": verdict.exit_code if not verdict_error else EXIT_ERROR,
        "error": ending.error,
        "ran_s": ran_s,
        # Stopped before its planned end (judge/verdict.py): by the operator (stopped_by) or on its
        # own (error). Not `resume.interruptions`, the crashes it was resumed from.
        "stopped_early": ending.early,
        "stopped_by": ending.stopped_by,
        # The phase the stop came in (judge.criteria.STOP_PHASES), empty if none.
        "stopped_in": ending.stopped_in,
        "replay_began": ending.replay_began,
        # The whole run across resumed processes, lost-in-flight requests counted as failed (the
        # verdict's figures); `replay` (replay_part) is this process's replayer alone.
        "requests": verdict.requests.to_dict(),
        "points": dict(sorted(writer.counts.items())),
        # Keys of parts a config leaves out, present and null: readers need not guess.
        "influx": None,
        "webhook": None,
        **sinks.summaries(),
        **run_stack.summaries(),
    }
    # Completions the server got that are not the trace's: a reader comparing the server's request
    # count with the trace's finds the difference here.
    engines = (doc.get("engine_telemetry") or {}).get("engines") or []
    probes = sum(int(e.get("vocab_probe_requests", 0)) for e in engines if isinstance(e, dict))
    doc["outside_trace"] = {"warmup_requests": replay.warmup_sent, "vocab_probe_requests": probes}
    stop_failures = {**sinks.stop_failures, **run_stack.stop_failures}
    if stop_failures:
        doc["stop_failures"] = stop_failures
    return doc
