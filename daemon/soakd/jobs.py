"""A run's periodic work: APScheduler's jobs (collection tiers, flush, shipping, checks, sd_notify) and
the fixed-rate tickers beside them, as one part that starts with the run and stops after the replay."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, JobEvent
from apscheduler.executors.asyncio import AsyncIOExecutor
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from soakd.collectors.ceiling import CeilingTracker
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.runner import CollectorRunner
from soakd.config import Config
from soakd.control import Controller
from soakd.engine.supervisor import EngineSupervisor
from soakd.files import write_json_atomic
from soakd.judge.criteria import first_abort, run_context
from soakd.judge.verdict import lost_in_flight
from soakd.live import LiveRun
from soakd.metric import FieldValue, Sample
from soakd.notify import notify, watchdog_interval_s
from soakd.replay.runner import ReplayStats
from soakd.resume import DueJournal
from soakd.rundir import SNAPSHOT_FILE
from soakd.sinks.registry import BuiltSink
from soakd.sinks.spool import Spool
from soakd.sinks.writer import SampleWriter
from soakd.ticker import Ticker

log = structlog.get_logger(__name__)

ProgressFn = Callable[[float, float, ReplayStats], None]

# APScheduler's own lines go through this logger, less its line per skipped run (SkipLog says those).
_SCHEDULER_LOG = logging.getLogger("apscheduler.scheduler.soakd")
_SCHEDULER_LOG.addFilter(lambda record: not str(record.msg).startswith('Execution of job "%s" skipped'))
SKIP_SAY_EVERY_S = 60.0


def ending_quietly(job: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """`job` as a scheduler job that a cancellation (the scheduler shut down while it ran: the run
    ends) ends quietly, as a run that returned. Otherwise APScheduler logs the CancelledError as the
    job's error, traceback and all, and soakd counts a failed job (a checkpoint in its worker thread
    at the stop: its write goes on, and the stop writes its own after it)."""

    @functools.wraps(job)
    async def run(*args: object, **kwargs: object) -> None:
        try:
            await job(*args, **kwargs)
        except asyncio.CancelledError:
            log.debug("job_cancelled", job=getattr(job, "__name__", "?"), reason="the scheduler stopped")

    return run


class _QuietExecutor(AsyncIOExecutor):  # type: ignore[misc]  # APScheduler has no types
    """APScheduler's asyncio executor, but a job's task cancelled by the shutdown before it even began
    (due in the same loop turn as the stop) is a run that ended, not "Error running job" with a
    CancelledError traceback."""

    def _run_job_error(self, job_id: str, exc: BaseException, traceback: object = None) -> None:
        if isinstance(exc, asyncio.CancelledError):
            self._run_job_success(job_id, [])  # the base's bookkeeping of a run that ended; no events
            return
        super()._run_job_error(job_id, exc, traceback)


def make_scheduler() -> AsyncIOScheduler:
    """The run's scheduler: runs coalesced, one instance of each job at a time, its lines through
    `_SCHEDULER_LOG`, jobs cancelled by its shutdown ending quietly (add them through ending_quietly)."""
    return AsyncIOScheduler(
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30},
        executors={"default": _QuietExecutor()},
        logger=_SCHEDULER_LOG,
    )


class SkipLog:
    """Runs of a job skipped because its previous run was still running (APScheduler's max_instances):
    counted per job and said at most once per `every_s` per job, with how many since, rather than one
    line per skip (a busy loop skips a 1 s job every second, flooding the journal)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, every_s: float = SKIP_SAY_EVERY_S
    ) -> None:
        self.skipped: dict[str, int] = {}
        self._clock = clock
        self._every_s = every_s
        self._unsaid: dict[str, int] = {}
        self._said_at: dict[str, float] = {}

    def add(self, job: str) -> None:
        self.skipped[job] = self.skipped.get(job, 0) + 1
        self._unsaid[job] = self._unsaid.get(job, 0) + 1
        now = self._clock()
        last = self._said_at.get(job)
        if last is None or now - last >= self._every_s:
            self._say(job, now)

    def flush(self) -> None:
        """Say what is not said yet (the run ends): no skip goes unsaid."""
        for job in list(self._unsaid):
            self._say(job, self._clock())

    def _say(self, job: str, now: float) -> None:
        log.warning(
            "job_skipped",
            job=job,
            skipped=self._unsaid.pop(job),
            total=self.skipped[job],
            reason="its previous run was still running",
            said_at_most_every_s=self._every_s,
        )
        self._said_at[job] = now


class Jobs:
    """The scheduler and its tickers; a lifecycle Component named `scheduler`."""

    name = "scheduler"
    stop_timeout_s = 30.0

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        live: LiveRun,
        runner: CollectorRunner,
        writer: SampleWriter,
        spool: Spool,
        engine: EngineSupervisor,
        *,
        journal: DueJournal | None = None,
        shipping: Sequence[BuiltSink] = (),
        controller: Controller | None = None,
        tickers: Sequence[Ticker] = (),
        gpu_watch: GpuThrottleWatch | None = None,
        ceiling: CeilingTracker | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.cfg = cfg
        self._run_dir = run_dir
        self._live = live
        self._runner = runner
        self._writer = writer
        self._spool = spool
        self._engine = engine
        self._journal = journal
        self._shipping = list(shipping)
        self._controller = controller
        self.tickers = list(tickers)
        self._gpu_watch = gpu_watch
        self._ceiling = ceiling
        self._progress = progress
        self.missed = 0
        self.errors = 0
        self.skips = SkipLog()
        self.last_collect = time.monotonic()
        self._sync: asyncio.Future[None] | None = None
        self.scheduler = make_scheduler()
        self.scheduler.add_listener(
            self._on_job_event, EVENT_JOB_MISSED | EVENT_JOB_ERROR | EVENT_JOB_MAX_INSTANCES
        )
        self._add_jobs()

    def _on_job_event(self, event: JobEvent) -> None:
        if event.code in (EVENT_JOB_MISSED, EVENT_JOB_MAX_INSTANCES):
            # Missed, or skipped because the previous run still ran (a slow tier outlasting its
            # interval): either way a run that did not happen.
            self.missed += 1
            if event.code == EVENT_JOB_MAX_INSTANCES:
                self.skips.add(event.job_id)
        else:
            self.errors += 1
            log.error("job_failed", job=event.job_id, error=repr(getattr(event, "exception", None)))

    def _add(self, job: Callable[..., Awaitable[None]], trigger: str, **kwargs: Any) -> None:
        self.scheduler.add_job(ending_quietly(job), trigger, **kwargs)

    def _add_jobs(self) -> None:
        cfg, add = self.cfg, self._add
        tcfg = cfg.telemetry
        # Jobs are coroutines so they run on the event loop, never in APScheduler's thread pool.
        if "gpu" in self._runner.names:
            add(self._gpu_slow, "interval", seconds=tcfg.gpu_slow_interval, id="gpu_slow")
        add(self._collect, "interval", seconds=tcfg.interval, id="collect")
        if cfg.control.enabled and self._controller is not None:
            add(self._control, "interval", seconds=cfg.control.interval, id="control")
        add(self._slow, "interval", seconds=tcfg.slow_interval, id="slow")
        add(self._check_engine, "interval", seconds=1.0, id="engine_check")
        if cfg.criteria.abort_on:
            add(self._check_abort, "interval", seconds=5.0, id="abort_check")
        add(self._flush, "interval", seconds=cfg.sinks.spool.fsync_interval, id="spool_flush")
        for sink in self._shipping:
            add(self._ship, "interval", args=(sink,), seconds=sink.interval_s, id=f"ship_{sink.name}")
        if self._progress is not None:
            add(self.tick_progress, "interval", seconds=1.0, id="progress")
        add(self._status, "interval", seconds=10.0, id="status")
        add(self._snapshot, "interval", seconds=cfg.run.snapshot_interval, id="snapshot")
        add(self._checkpoint, "interval", seconds=cfg.run.checkpoint_interval, id="checkpoint")
        wd = watchdog_interval_s()
        if wd is not None:
            add(self._watchdog, "interval", seconds=wd, id="watchdog")

    # -- the Component --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.scheduler.start()
        for ticker in self.tickers:
            ticker.start()

    async def stop(self) -> None:
        """The last progress line and collection (the replay's final counts), then no more jobs; a sync
        under way is waited for (the spool's final flush follows)."""
        try:
            await self.tick_progress()
            self._runner.run_once()
        finally:
            self.scheduler.shutdown(wait=False)
            self.skips.flush()
            for ticker in self.tickers:
                ticker.stop()
            if self._sync is not None:
                await asyncio.wait({self._sync})

    def summary(self) -> Mapping[str, Any]:
        return {
            "scheduler": {"missed": self.missed, "errors": self.errors, "skipped": dict(self.skips.skipped)},
            "tickers": {
                t.name: {"runs": t.runs, "missed": t.missed, "errors": t.errors} for t in self.tickers
            },
        }

    # -- the jobs -------------------------------------------------------------------------------------

    async def _collect(self) -> None:
        self._runner.run_once()
        self.last_collect = time.monotonic()

    async def _control(self) -> None:
        # The controller exists from the start; it acts only once the replay has begun.
        if self._controller is not None and self._live.replay_start is not None:
            await self._controller.tick()

    async def _gpu_slow(self) -> None:
        # Through the runner, as every slow source: a failed or slow read is counted against `gpu`.
        await self._runner.refresh(timeout_s=self.cfg.telemetry.gpu_slow_interval, only=frozenset({"gpu"}))

    async def _slow(self) -> None:
        # The GPU's slow tier has its own, faster job (gpu_slow).
        await self._runner.refresh(timeout_s=self.cfg.telemetry.slow_interval, exclude=frozenset({"gpu"}))

    async def _flush(self) -> None:
        # The disk's waits in worker threads: the loop paces the replay (a 10 ms fsync is a request
        # sent 10 ms late). The job only starts a sync: a disk slower than the interval (an engine start
        # writing its compile cache, measured on an H200) means fewer fsyncs, not a skipped job.
        if self._sync is None or self._sync.done():
            self._sync = asyncio.ensure_future(self._sync_files())

    async def _sync_files(self) -> None:
        await self._spool.sync_off_loop()  # degrades the spool itself on a failure
        if self._journal is not None:
            # With the spool: after a power loss the journal knows what the spool's records say.
            try:
                await self._journal.sync_off_loop()
            except OSError as err:
                # Counted as a failed job, as when the sync ran in the job itself.
                self.errors += 1
                log.error("journal_sync_failed", error=str(err))

    async def _ship(self, sink: BuiltSink) -> None:
        # Most of one interval, then yield to the next tick: a backlog after an outage drains at the
        # receiver's pace without the job outliving its interval (a skipped run).
        self._spool.flush(fsync=False)
        await sink.tick(0.8 * sink.interval_s)

    async def _check_engine(self) -> None:
        self._engine.check()
        replayer = self._live.replayer
        if not self._engine.alive() and replayer is not None and not replayer.fatal:
            replayer.fail("engine: no engine left to replay on")

    async def _check_abort(self) -> None:
        live = self._live
        replayer = live.soak_replayer()
        if replayer is None or replayer.fatal:
            return
        replayed = live.elapsed()
        if replayed < self.cfg.criteria.abort_grace:
            return
        gaps = live.interruptions()
        lost = lost_in_flight(gaps)
        live.metrics.lost_in_flight = lost  # an abort_on check counts them as the verdict does
        failed = first_abort(self.cfg.criteria, live.metrics, run_context(replayed, len(gaps), lost))
        if failed is None:
            return
        reason = f"criterion failed: {failed.expr} (measured {failed.value:.4g})"
        self._writer.event("criteria_abort", reason, value=float(failed.value or 0.0), replayed_s=replayed)
        replayer.fail(reason)

    async def _checkpoint(self) -> None:
        # Written from a worker thread: the checkpoint's lock orders it against a stop's own write.
        await asyncio.to_thread(self._live.write_checkpoint, self._run_dir)

    def healthy(self) -> tuple[bool, str]:
        """Whether the main loop is doing its work: the loop runs (else this is not called at all) and
        the collection cycle ran within a few intervals (a wedged job or a stuck collector stops it)."""
        # One and a half ping intervals (a slow cycle is not a hang; a stall is caught well within
        # WatchdogSec), and never below three collection intervals.
        wd = watchdog_interval_s()
        limit = max(3 * self.cfg.telemetry.interval, 1.5 * wd if wd is not None else 10.0)
        age = time.monotonic() - self.last_collect
        if age > limit:
            return False, f"no collection cycle for {age:.0f} s"
        return True, ""

    async def _watchdog(self) -> None:
        """WATCHDOG=1 only while healthy: systemd then kills (SIGABRT) and restarts a hung daemon."""
        ok, why = self.healthy()
        if ok:
            notify("WATCHDOG=1")
        else:
            log.error("watchdog_withheld", reason=why)

    async def _snapshot(self) -> None:
        """A mid-run snapshot a person can read without stopping the soak: `snapshot.json`."""
        replayer = self._live.soak_replayer()
        if replayer is None:
            return
        doc: dict[str, Any] = {
            "run_id": self._run_dir.name,
            "elapsed_s": self._live.elapsed(),
            "replay": asdict(replayer.stats),
            "points": dict(self._writer.counts),
        }
        if self._controller is not None:
            doc["control"] = self._controller.summary()
        if self._gpu_watch is not None:
            doc["gpu_throttle"] = self._gpu_watch.summary()
        if self._ceiling is not None:
            doc["decode_ceiling"] = self._ceiling.summary()
        await asyncio.to_thread(write_json_atomic, self._run_dir / SNAPSHOT_FILE, doc)

    async def _status(self) -> None:
        """systemd's STATUS line: what `systemctl status soakd` shows a person mid-run."""
        replayer = self._live.soak_replayer()
        if replayer is None:
            return
        st = replayer.stats
        elapsed, planned = self._live.elapsed(), self.cfg.run.duration
        pct = min(100.0, 100.0 * elapsed / planned)
        notify(
            f"STATUS=replaying {pct:.0f}% ({elapsed:.0f}/{planned:.0f} s): "
            f"{st.completed} done, {st.failed} failed, {st.shed} shed, {replayer.pending} in flight"
            + (f", {st.incomplete} left at the end" if st.incomplete else "")
            + (f", ceiling {self._controller.batch.limit}" if self._controller is not None else "")
        )

    async def tick_progress(self) -> None:
        replayer = self._live.replayer
        if self._progress is None or replayer is None:
            return
        self._progress(self._live.elapsed(), self.cfg.run.duration, replayer.stats)


class JobHealth:
    """Collector `scheduler`: the periodic jobs' misses and errors as a series, not only in the summary
    (a slow tier that overruns its interval, a job that raised, fast-tier slots skipped)."""

    name = "scheduler"

    def __init__(self, jobs: Jobs) -> None:
        self._jobs = jobs

    def collect(self, now_ns: int) -> list[Sample]:
        jobs = self._jobs
        fields: dict[str, FieldValue] = {"missed": jobs.missed, "errors": jobs.errors}
        for t in jobs.tickers:
            fields[f"{t.name}_missed"] = t.missed
            fields[f"{t.name}_errors"] = t.errors
        return [Sample("scheduler", fields, now_ns)]

    def close(self) -> None:
        return None
