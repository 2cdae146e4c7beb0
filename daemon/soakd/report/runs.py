"""Find a finished run on disk and judge it from its spool (the same path `soakd run` ends with)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from soakd.config import CriteriaConfig
from soakd.errors import EXIT_STOPPED, UsageError
from soakd.files import read_input_text, read_json_no_follow
from soakd.judge.criteria import Ending
from soakd.judge.metrics import METRIC_FIELDS, METRIC_MEASUREMENTS, RunMetrics
from soakd.judge.verdict import Verdict, verdict_of, write_verdict
from soakd.metric import Sample
from soakd.report.series import FIELDS, SeriesBuilder, spool_samples
from soakd.rundir import CHECKPOINT_FILE, SPOOL_DIR, VERDICT_FILE
from soakd.sinks.spool import iter_samples, list_segments, torn_tail_bytes

log = structlog.get_logger(__name__)


def _union(*maps: dict[str, tuple[str, ...] | None]) -> dict[str, tuple[str, ...] | None]:
    out: dict[str, tuple[str, ...] | None] = {}
    for m in maps:
        for name, fields in m.items():
            have = out.get(name, ())
            out[name] = None if fields is None or (name in out and have is None) else (*(have or ()), *fields)
    return {k: None if v is None else tuple(dict.fromkeys(v)) for k, v in out.items()}


# What a report reads: the plotted series and the verdict's metrics.
READ_FIELDS = _union(FIELDS, METRIC_FIELDS)


def find_run(arg: str, output_dir: Path) -> Path:
    """A run directory from a path or a run id (looked up under output_dir; a unique prefix is enough)."""
    path = Path(arg)
    if (path / SPOOL_DIR).is_dir():
        return path
    candidate = output_dir / arg
    if (candidate / SPOOL_DIR).is_dir():
        return candidate
    if output_dir.is_dir():
        matches = sorted(
            p for p in output_dir.iterdir() if p.name.startswith(arg) and (p / SPOOL_DIR).is_dir()
        )
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise UsageError(f"run id prefix {arg!r} matches {len(matches)} runs under {output_dir}")
    raise UsageError(f"no run at {arg!r} (not a run directory, nor a run id under {output_dir})")


# A run's JSON files are small (meta.json of a large config: tens of kB); more is not soakd's.
MAX_RUN_JSON_BYTES = 16 << 20


def read_json(path: Path) -> dict[str, Any]:
    """A run file's JSON object; anything else (a FIFO, a huge or non-UTF-8 file, deep nesting) is a
    one-line UsageError naming the file."""
    text = read_input_text(path, MAX_RUN_JSON_BYTES, "a soakd run file", UsageError, follow=False)
    try:
        data = json.loads(text)
    except RecursionError:
        raise UsageError("JSON nested deeper than the parser goes", file=path) from None
    except json.JSONDecodeError as err:
        raise UsageError(f"not JSON: {err.msg}", file=path, line=err.lineno) from None
    if not isinstance(data, dict):
        raise UsageError("not a JSON object", file=path)
    return data


def damaged_line(path: Path, line: int, why: str) -> None:
    """Told of a spool line that is not line protocol (iter_samples' `on_damaged`)."""
    # Said, never silent, and never the end of the judgement: one damaged record is one record less.
    log.warning("spool_line_damaged", file=str(path), line=line, error=why[:200])


def warn_torn_tails(spool_dir: Path) -> None:
    """Warn of each segment whose last line was torn by a crash (readers stop at its last whole line)."""
    for segment in list_segments(spool_dir):
        torn = torn_tail_bytes(segment)
        if torn:
            # A crash mid-write: the whole lines before it are read, the tail is not a record.
            log.warning("spool_torn_tail", file=str(segment), bytes=torn, kept="up to the last whole line")


def read_interruptions(run_dir: Path) -> list[dict[str, Any]]:
    """The crashes a run was resumed from, as its checkpoint lists them (none without one)."""
    try:
        data = read_json_no_follow(run_dir / CHECKPOINT_FILE)
        items = data.get("interruptions", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def judge(
    run_dir: Path,
    run_id: str,
    criteria: CriteriaConfig,
    *,
    ran_s: float,
    planned_s: float,
    ending: Ending | None = None,
    metrics: RunMetrics | None = None,
    interruptions: list[dict[str, Any]] | None = None,
    stopped_code: int = EXIT_STOPPED,
) -> Verdict:
    """Evaluate the criteria over the run's points (read from its spool unless `metrics` is given,
    already folded); write verdict.json."""
    if metrics is None:
        metrics = RunMetrics().add_all(
            iter_samples(run_dir / SPOOL_DIR, METRIC_MEASUREMENTS, on_damaged=damaged_line)
        )
        warn_torn_tails(run_dir / SPOOL_DIR)
    if interruptions is None:
        interruptions = read_interruptions(run_dir)
    verdict = verdict_of(
        run_id,
        criteria,
        metrics,
        ran_s=ran_s,
        planned_s=planned_s,
        ending=ending,
        interruptions=interruptions,
        stopped_code=stopped_code,
    )
    write_verdict(run_dir, verdict)
    return verdict


def fold_run(samples: Iterable[Sample]) -> tuple[RunMetrics, SeriesBuilder]:
    """One pass over a run's points: the metrics the verdict judges and the report's series."""
    metrics = RunMetrics()
    builder = SeriesBuilder()
    for sample in samples:
        metrics.add(sample)
        builder.add(sample)
    return metrics, builder


def fold_spool(run_dir: Path) -> tuple[RunMetrics, SeriesBuilder]:
    """`fold_run` over a run's spool: damaged lines skipped and logged, torn tails warned of."""
    folded = fold_run(spool_samples(run_dir / SPOOL_DIR, READ_FIELDS, on_damaged=damaged_line))
    warn_torn_tails(run_dir / SPOOL_DIR)
    return folded


def load_metrics(run_dir: Path) -> dict[str, float | None]:
    """A finished run's metrics: verdict.json's `metrics` when it has them, else folded from the spool."""
    try:
        data = read_json_no_follow(run_dir / VERDICT_FILE)
        metrics = data.get("metrics") if isinstance(data, dict) else None
    except (OSError, ValueError):
        metrics = None
    if isinstance(metrics, dict):
        return {str(k): float(v) if isinstance(v, int | float) else None for k, v in metrics.items()}
    return RunMetrics().add_all(iter_samples(run_dir / SPOOL_DIR, METRIC_MEASUREMENTS)).scalars()
