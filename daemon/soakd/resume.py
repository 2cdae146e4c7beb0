"""Crash-resume: what a run leaves on disk so that a restarted daemon continues it, and reading it back.

A run directory holds everything a resume needs, written as the run goes:

- `checkpoint.json` (atomic, every `run.checkpoint_interval` and at each (re)start): run id, the config's
  fingerprint, the replay time reached, and the interruptions so far;
- `replay.journal`: one line per request that came due (`loop index copy due_s`), appended with one
  unbuffered write each, so a SIGKILL loses none of it;
- the spool, whose `requests` records say which of those finished (the verdict is rebuilt from them);
- `control-state.json` and the forwarder's cursor, which their owners already read back.

The journal minus the finished records is exactly the requests that were in flight at the crash: they
are counted as lost, never replayed twice, and the replay continues with the trace's next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from soakd.checkpoint import Checkpoint, Interruption, RequestKey, read_checkpoint
from soakd.errors import InputError
from soakd.files import NotRegularFile, open_no_follow, open_private_append, read_no_follow
from soakd.judge.metrics import METRIC_MEASUREMENTS, RunMetrics
from soakd.metric import Sample, parse_line
from soakd.owner import check_run_files, release, take
from soakd.replay.pacer import Scheduled
from soakd.rundir import JOURNAL_FILE, SPOOL_DIR, SUMMARY_FILE
from soakd.sinks.spool import iter_lines, list_segments

log = structlog.get_logger(__name__)


def fingerprint(config: dict[str, Any], trace: dict[str, Any]) -> str:
    """A short hash of the validated config and the trace's summary: a run resumes only under the same
    configuration and trace (anything else would splice two different soaks into one verdict)."""
    doc = json.dumps({"config": config, "trace": trace}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


class DueJournal:
    """Appends one line per request that came due; each line is one write(2), durable across a SIGKILL
    of the daemon (the page cache keeps it), fsynced with the spool."""

    def __init__(self, path: Path) -> None:
        self.path = path
        torn = False
        try:
            with contextlib.suppress(FileNotFoundError), os.fdopen(open_no_follow(path), "rb") as f:
                size = f.seek(0, os.SEEK_END)
                torn = size > 0 and f.seek(size - 1) >= 0 and f.read(1) != b"\n"
            # Appended to only as the run folder's own regular file: never a link's target.
            self._fd = open_private_append(path)
        except NotRegularFile as err:
            raise InputError(f"refused: {err.strerror}", file=path) from None
        if torn:
            # A line torn by a power loss must not swallow the first line this process appends.
            os.write(self._fd, b"\n")

    def append(self, key: RequestKey, due_s: float) -> None:
        if self._fd < 0:
            return
        loop, index, copy = key
        os.write(self._fd, f"{loop} {index} {copy} {due_s:.6f}\n".encode())

    def sync(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)

    async def sync_off_loop(self) -> None:
        """fsync in a worker thread, on a duplicate of the descriptor (a close meanwhile is harmless):
        the event loop, which paces the replay, never waits on the disk."""
        if self._fd < 0:
            return
        fd = os.dup(self._fd)
        try:
            await asyncio.to_thread(os.fsync, fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


def read_journal(path: Path) -> dict[RequestKey, float]:
    """Every request the journal says came due, with its replay due time; a torn last line is ignored."""
    due: dict[RequestKey, float] = {}
    try:
        data = read_no_follow(path)
    except FileNotFoundError:
        return due
    except NotRegularFile as err:
        raise InputError(f"refused: {err.strerror}", file=path) from None
    for raw in data.split(b"\n")[:-1]:  # the part after the last newline is torn (or empty)
        parts = raw.split()
        if len(parts) != 4:
            log.warning("journal_line_skipped", path=str(path), line=raw[:80].decode(errors="replace"))
            continue
        try:
            due[(int(parts[0]), int(parts[1]), int(parts[2]))] = float(parts[3])
        except ValueError:
            log.warning("journal_line_skipped", path=str(path), line=raw[:80].decode(errors="replace"))
    return due


def request_key(sample: Sample) -> RequestKey:
    """The scheduled request a `requests` record is about."""
    f = sample.fields
    return (int(f.get("loop", 0)), int(f.get("index", 0)), int(f.get("copy", 0)))


@dataclass(slots=True)
class ResumeState:
    """What a resumed run starts from, read from its directory."""

    checkpoint: Checkpoint
    due: dict[RequestKey, float]
    """Requests that came due before the crash."""
    finished_keys: set[RequestKey]
    """Requests with a record in the spool."""
    metrics: RunMetrics
    """The verdict's fold over the points already written (request records and the metrics' series)."""
    finished: int
    lost: list[RequestKey]
    """Came due, never finished, not counted at an earlier crash: in flight at this crash."""
    offset_s: float
    """Replay time to continue from."""
    points: dict[str, int]
    """Points per measurement already in the spool."""
    last_seen_ns: int
    """The run's last sign of life (newest write to its spool, journal or checkpoint)."""
    damaged_lines: int = 0
    """Lines of the spool the verdict reads that could not be parsed (skipped, each logged)."""
    last_point_ns: int = 0
    """The newest point time in the spool: points after the resume must come later (a wall clock set
    back meanwhile would otherwise overwrite earlier points of the same series in InfluxDB)."""

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.checkpoint.planned_s - self.offset_s)

    @property
    def done(self) -> set[RequestKey]:
        """Requests the resumed replay must not send: they came due, or have a record, before."""
        return set(self.due) | self.finished_keys


def _last_seen_ns(run_dir: Path, checkpoint: Checkpoint) -> int:
    newest = checkpoint.wall_ns
    for path in [*list_segments(run_dir / SPOOL_DIR), run_dir / JOURNAL_FILE]:
        with contextlib.suppress(OSError):
            newest = max(newest, path.stat().st_mtime_ns)
    return newest


def load_state(run_dir: Path, checkpoint: Checkpoint) -> ResumeState:
    """Rebuild the run's accounting from its journal and spool (one pass over the spool)."""
    due = read_journal(run_dir / JOURNAL_FILE)
    metrics = RunMetrics()
    finished: set[RequestKey] = set()
    points: dict[str, int] = {}
    newest = 0
    damaged = 0
    for line in iter_lines(run_dir / SPOOL_DIR):
        # The timestamp is the last field of a line.
        stamp = line[line.rfind(" ") + 1 :]
        if stamp.isdigit():
            newest = max(newest, int(stamp))
        # The measurement is the line's first unescaped ',' or ' '; soakd's names need no escaping.
        end = min((i for i in (line.find(","), line.find(" ")) if i >= 0), default=len(line))
        name = line[:end]
        points[name] = points.get(name, 0) + 1
        if name not in METRIC_MEASUREMENTS:
            continue
        try:
            sample = parse_line(line)
            key = request_key(sample) if name == "requests" else None
        except (ValueError, OverflowError) as err:
            # A damaged line (a power loss can leave NULs) is not a point to count: said, not fatal.
            damaged += 1
            log.warning("spool_line_damaged", run_dir=str(run_dir), error=str(err)[:200])
            continue
        metrics.add(sample)
        if key is not None:
            finished.add(key)
    counted = set(checkpoint.lost)
    lost = sorted(k for k in due if k not in finished and k not in counted)
    offset = max([checkpoint.elapsed_s, *due.values()])
    return ResumeState(
        checkpoint=checkpoint,
        due=due,
        finished_keys=finished,
        metrics=metrics,
        finished=len(finished),
        lost=lost,
        offset_s=offset,
        points=points,
        last_seen_ns=_last_seen_ns(run_dir, checkpoint),
        damaged_lines=damaged,
        last_point_ns=newest,
    )


def take_up(run_dir: Path, checkpoint: Checkpoint) -> ResumeState:
    """Take up an unfinished run: its accounting from journal and spool, the crash as an interruption
    recorded in the checkpoint (written back)."""
    state = load_state(run_dir, checkpoint)
    down_s = max(0.0, (time.time_ns() - state.last_seen_ns) / 1e9)
    if state.remaining_s > 0 or state.lost:
        # A crash after the replay ended with nothing in flight cut nothing short: no interruption.
        checkpoint.interruptions.append(
            Interruption(state.offset_s, down_s, len(state.lost), datetime.now(UTC).isoformat())
        )
        checkpoint.lost.extend(state.lost)
    checkpoint.elapsed_s = state.offset_s
    checkpoint.write(run_dir)
    log.warning(
        "run_resumed",
        at_s=round(state.offset_s, 3),
        down_s=round(down_s, 3),
        finished=state.finished,
        lost_in_flight=len(state.lost),
        remaining_s=round(state.remaining_s, 3),
    )
    return state


def find_resumable(
    out_dir: Path, name: str, fp: str, within_s: float, now_ns: int | None = None
) -> tuple[Path, Checkpoint] | None:
    """The newest unfinished run of this name under out_dir that may be resumed, or None (with the reason
    logged). Only the newest one is considered: an older unfinished run was already given up on."""
    now = time.time_ns() if now_ns is None else now_ns
    try:
        # Run ids are STAMP-NAME-XXXX (new_run_id): a 16-character UTC stamp and 4 hex digits.
        candidates = sorted(
            (p for p in out_dir.iterdir() if p.is_dir() and not p.is_symlink() and p.name[17:-5] == name),
            reverse=True,
        )
    except FileNotFoundError:
        candidates = []
    for run_dir in candidates:
        # One owner per run folder, before anything in it is read: a second resume of the same run is
        # refused here (exit 2, naming the owner's pid), never a second writer of its journal and spool.
        take(run_dir)
        try:
            found = _resumable(run_dir, fp, within_s, now)
        except BaseException:
            release(run_dir)
            raise
        if found is None:
            release(run_dir)
        return found
    log.info("resume_none", reason="no unfinished run", output_dir=str(out_dir))
    return None


def _resumable(run_dir: Path, fp: str, within_s: float, now: int) -> tuple[Path, Checkpoint] | None:
    """`run_dir` and its checkpoint if it may be resumed, else None with the reason logged."""
    check_run_files(run_dir)
    checkpoint = read_checkpoint(run_dir)
    if checkpoint is None:
        # The newest run has no checkpoint (it died before writing one, or predates them): an older
        # one was given up on when this one started.
        log.info("resume_none", reason="the newest run has no checkpoint", run_dir=str(run_dir))
        return None
    if (run_dir / SUMMARY_FILE).exists():
        log.info("resume_none", reason="the newest run finished", run_dir=str(run_dir))
        return None
    if checkpoint.stopped_by:
        log.info("resume_none", reason=f"the newest run was stopped ({checkpoint.stopped_by})")
        return None
    if checkpoint.fingerprint != fp:
        log.warning("resume_skipped", run_dir=str(run_dir), reason="config or trace changed since it started")
        return None
    age_s = (now - _last_seen_ns(run_dir, checkpoint)) / 1e9
    if age_s > within_s:
        log.warning(
            "resume_skipped",
            run_dir=str(run_dir),
            reason=f"last active {age_s:.0f} s ago (run.resume_within = {within_s:.0f} s)",
            hint=f"judge it with `soakd report {run_dir.name}`",
        )
        return None
    return run_dir, checkpoint


def shifted(items: Iterable[Scheduled], done: Container[RequestKey], offset_s: float) -> Iterator[Scheduled]:
    """The schedule's requests that have not come due yet, due `offset_s` earlier (the resumed replay's
    clock starts at the crash point). Later session turns that were waiting on their previous turn at the
    crash are due before the offset: they go at once."""
    for item in items:
        key = (item.loop, item.spec.index, item.spec.copy)
        if key in done:
            continue
        yield Scheduled(spec=item.spec, loop=item.loop, due_s=max(0.0, item.due_s - offset_s))
