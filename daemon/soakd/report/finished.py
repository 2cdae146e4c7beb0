"""A finished run read back for `soakd report`: the config that judges it, its verdict judged again,
and the sign-off report written (also right after `soakd run`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from soakd.checkpoint import read_checkpoint
from soakd.config import Config
from soakd.errors import EXIT_STOPPED, UsageError
from soakd.judge.criteria import Ending
from soakd.judge.metrics import RunMetrics
from soakd.judge.verdict import Verdict, stopped_early
from soakd.owner import check_run_files
from soakd.report.html import build_doc, write_report
from soakd.report.runs import fold_spool, judge, read_json
from soakd.report.series import SeriesBuilder
from soakd.rundir import META_FILE, REPORT_HTML, REPORT_JSON, SUMMARY_FILE, VERDICT_FILE

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class FinishedRun:
    run_dir: Path
    meta: dict[str, Any]
    summary: dict[str, Any]
    """summary.json; empty for a run that died before writing it."""
    config: Config
    """The config that judges it: the one the run was started with, unless another was given."""

    @property
    def run_id(self) -> str:
        return str(self.meta["run_id"])

    def ran_s(self) -> float:
        """Replay time reached: the summary's, else (a run that died) its checkpoint's."""
        if "ran_s" in self.summary:
            return float(self.summary["ran_s"])
        checkpoint = read_checkpoint(self.run_dir)
        return checkpoint.elapsed_s if checkpoint is not None else 0.0

    def recorded_verdict(self) -> dict[str, Any] | None:
        """verdict.json as the run wrote it (or a --rejudge rewrote it); None when it has none."""
        path = self.run_dir / VERDICT_FILE
        return read_json(path) if os.path.lexists(path) else None

    def stopped_code(self) -> int:
        """The code a stop exited with (4, or the systemd unit's 0): the run's, not the criteria's. The
        verdict records it since soakd wrote `stopped_early`, the summary too; an older verdict's
        `exit_code` was PASS/FAIL's, so its run is taken to have exited as `soakd run` does by default."""
        for doc in (self.recorded_verdict() or {}, self.summary):
            code = doc.get("exit_code")
            if "stopped_early" in doc and isinstance(code, int) and not isinstance(code, bool):
                return code
        return EXIT_STOPPED

    def ending(self) -> Ending:
        """How the run ended, from its summary. A run that never wrote one died before its end. An older
        summary says `interrupted` (set only by a stop signal) beside `error` (the run's own reason): with
        no error it was the operator's stop, whose signal its checkpoint names."""
        s = self.summary
        if not s:
            return Ending(error="the run died before its end (no summary.json)")
        stopped_by, error = str(s.get("stopped_by") or ""), str(s.get("error") or "")
        if not stopped_by and not error and stopped_early(s):
            checkpoint = read_checkpoint(self.run_dir)
            stopped_by = (checkpoint.stopped_by if checkpoint is not None else "") or "a stop signal"
        phase = str(s.get("stopped_in") or "") if stopped_by else ""
        return Ending(stopped_by, error, bool(s.get("replay_began", True)), phase)


def open_run(run_dir: Path, given: Config | None) -> FinishedRun:
    """A run folder's metadata and summary, and the config to judge it by; a folder that is not a
    soakd run's, or whose config this soakd cannot load, is a one-line UsageError."""
    # Read-only, never locked (a live run's owner keeps writing), never through a link: a run file that
    # is a symlink or not a regular file is refused, naming it, before any is read.
    check_run_files(run_dir, segments=False, error=UsageError)
    meta = read_json(run_dir / META_FILE)
    if not isinstance(meta.get("config"), dict) or "run_id" not in meta:
        raise UsageError("not a soakd run's metadata (no config or run_id)", file=run_dir / META_FILE)
    try:
        config = given if given is not None else Config.model_validate(meta["config"])
    except ValueError as err:  # pydantic's ValidationError: a run from a soakd whose config differed
        first = str(err).splitlines()[1:3]
        raise UsageError(
            f"the run's config does not load in this soakd ({' '.join(first)}): judge it with --config FILE",
            file=run_dir / META_FILE,
        ) from None
    summary_path = run_dir / SUMMARY_FILE
    summary = read_json(summary_path) if os.path.lexists(summary_path) else {}
    return FinishedRun(run_dir, meta, summary, config)


def judge_again(run: FinishedRun, metrics: RunMetrics | None = None) -> Verdict:
    """The run judged by `run.config`'s criteria over its points (folded from the spool unless given);
    verdict.json is rewritten."""
    return judge(
        run.run_dir,
        run.run_id,
        run.config.criteria,
        ran_s=run.ran_s(),
        planned_s=float(run.meta["config"]["run"]["duration"]),
        ending=run.ending(),
        metrics=metrics,
        stopped_code=run.stopped_code(),
    )


def write_sign_off(
    run: FinishedRun,
    verdict: dict[str, Any],
    series: SeriesBuilder,
    html: Path | None,
    json_path: Path,
    *,
    source: str,
) -> None:
    """The sign-off report (HTML unless `html` is None, and its JSON) of a verdict and the run's series."""
    data = series.build(run.meta["config"])
    doc = build_doc(run.run_dir, run.meta, verdict, data, source=source, summary=run.summary)
    write_report(doc, html, json_path)


def report_after_run(run_dir: Path) -> Path | None:
    """The sign-off report of a run that just ended, from its spool and the verdict it wrote; its path,
    or None when it could not be made (logged: the exit code is left alone). The engine is stopped by
    now."""
    t0 = time.monotonic()
    try:
        meta = read_json(run_dir / META_FILE)
        verdict = read_json(run_dir / VERDICT_FILE)
        summary = read_json(run_dir / SUMMARY_FILE) if os.path.lexists(run_dir / SUMMARY_FILE) else {}
        _, series = fold_spool(run_dir)
        data = series.build(meta["config"])
        doc = build_doc(run_dir, meta, verdict, data, source="spool", summary=summary)
        write_report(doc, run_dir / REPORT_HTML, run_dir / REPORT_JSON)
    except Exception as err:  # noqa: BLE001 - the run is judged already; the report is an extra
        log.error("report_not_written", run_dir=str(run_dir), error=f"{type(err).__name__}: {err}"[:300])
        return None
    log.info("report_written", path=str(run_dir / REPORT_HTML), seconds=round(time.monotonic() - t0, 2))
    return run_dir / REPORT_HTML
