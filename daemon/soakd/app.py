"""One soak run, from a validated config to a verdict: prepare, start the stacks, replay, judge, summarize.

The parts are built by `wiring`, scheduled by `jobs`, and started and stopped by `lifecycle.Stack`:
the sinks stack outermost (stopped last, after the verdict is in the spool), inside it the run stack
(collectors, engine, scheduler, controller: stopped in reverse once the replay ends).

Over 500 lines because the run's sequence (start, engine, warm-up, replay, stop, verdict, summary) and its
signal and resume handling read in order here; the parts are built elsewhere (wiring).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import platform
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from soakd import __version__
from soakd.checkpoint import Checkpoint
from soakd.clock import Clock, SystemClock
from soakd.collectors.base import EngineListener
from soakd.collectors.ceiling import CeilingTracker
from soakd.collectors.engine import EngineCollector
from soakd.collectors.prom import MetricsScraper
from soakd.collectors.registry import build_collectors, find
from soakd.config import Config, EngineConfig
from soakd.engine import compat
from soakd.engine.base import Engine, EngineInfo
from soakd.errors import EXIT_ERROR, EXIT_STOPPED, EngineError
from soakd.files import write_json_atomic
from soakd.jobs import Jobs, ProgressFn
from soakd.judge.criteria import Ending
from soakd.judge.verdict import Verdict
from soakd.lifecycle import Stack
from soakd.live import LiveRun
from soakd.logs import bind
from soakd.metric import Sample
from soakd.notify import notify
from soakd.owner import take as take_run_dir
from soakd.parts import EngineChanges
from soakd.redact import redacted
from soakd.replay.admission import AdmissionGate
from soakd.replay.pacer import Scheduled, schedule
from soakd.replay.prompts import PromptSynth
from soakd.replay.runner import START_S, Replayer, ReplayStats, RequestRecord
from soakd.replay.warmup import warm_up
from soakd.report.runs import verdict_of
from soakd.resume import (
    DueJournal,
    ResumeState,
    find_resumable,
    fingerprint,
    shifted,
    take_up,
)
from soakd.rundir import JOURNAL_FILE, META_FILE, SUMMARY_FILE, VERDICT_FILE
from soakd.sinks.registry import open_sinks
from soakd.sinks.writer import SampleWriter
from soakd.stopsignals import STOP_SIGNALS, StopSignals
from soakd.traces.loader import Trace, open_trace
from soakd.wiring import (
    RunParts,
    build_run,
    build_sinks,
    check_writable,
    engine_config,
    make_engine,
    new_run_id,
    resolve_model,
)

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class RunResult:
    run_id: str
    run_dir: Path
    verdict: Verdict
    summary: dict[str, Any]
    error: str = ""
    """Why the run ended early on its own (engine failure, trace changed); the CLI exits 3."""
    stopped_by: str = ""
    """The signal that stopped the run early (SIGTERM: a service stop), or empty."""
    verdict_error: str = ""
    """Why verdict.json could not be written (a full disk), or empty: then nothing may claim the
    verdict, and the CLI exits 3."""


class Soak:
    """One soak run, from a validated config to a verdict."""

    def __init__(
        self,
        cfg: Config,
        *,
        progress: ProgressFn | None = None,
        clock: Clock | None = None,
        engine_factory: Callable[[Config, str, EngineCollector], Engine] | None = None,
        resume: bool = False,
        stopped_exit_code: int = EXIT_STOPPED,
        signals: StopSignals | None = None,
    ) -> None:
        self.cfg = cfg
        # The process's stop signals, when the caller installed them before this run was set up (the
        # CLI); without them the run installs the loop's own handlers.
        self._signals = signals
        self._stopped_code = stopped_exit_code
        self._progress = progress
        self._engine_factory = engine_factory or (
            lambda c, m, col: make_engine(c, m, col, log_dir=self.run_dir)
        )
        # Everything that can reject the input is checked here, before anything is written.
        self.trace: Trace = open_trace(cfg.trace, cfg.resolve, cfg.run.seed, cfg.replay)
        self.model = resolve_model(cfg)
        if engine_factory is None:  # the real engine: a vLLM outside the known versions only when accepted
            compat.check_version(cfg)
        self.host = cfg.run.host or socket.gethostname()
        # Secrets are read now, before the output folder is made (a bad credential is bad input: exit 2
        # with nothing half-made), then taken out of the environment the engine's processes inherit.
        self._sinks, secret_names = open_sinks(cfg, os.environ)
        for name in (*secret_names, "CREDENTIALS_DIRECTORY"):
            os.environ.pop(name, None)
        out_dir = cfg.resolve(cfg.run.output_dir)
        check_writable(out_dir, cfg.source)
        self.fingerprint = fingerprint(cfg.model_dump(mode="json"), asdict(self.trace.summary))
        self._resume_from: Checkpoint | None = None
        found = (
            find_resumable(out_dir, cfg.run.name, self.fingerprint, cfg.run.resume_within) if resume else None
        )
        if found is not None:
            self.run_dir, self._resume_from = found
            self.run_id = self._resume_from.run_id
        else:
            self.run_id = new_run_id(cfg.run.name)
            self.run_dir = out_dir / self.run_id
        self.live = LiveRun(clock or SystemClock(), cfg.run.duration)
        self.resumed: ResumeState | None = None
        self.started_utc = datetime.now(UTC).isoformat()
        self._journal: DueJournal | None = None
        self._journal_errors = 0
        self._warmup_sent = 0  # warm-up requests sent before the replay (not the trace's)
        self._stop_task: asyncio.Task[None] | None = None
        self._start_task: asyncio.Task[None] | None = None
        self._verdict_error = ""
        self._parts: RunParts | None = None
        self._t_start = time.monotonic()

    # The run's outcome as the CLI and the tests read it.
    @property
    def interrupted(self) -> bool:
        return self.live.interrupted

    @property
    def error(self) -> str:
        return self.live.error

    @property
    def stopped_by(self) -> str:
        return self.live.stopped_by

    @property
    def jobs(self) -> Jobs | None:
        return self._parts.jobs if self._parts is not None else None

    def healthy(self) -> tuple[bool, str]:
        return self._parts.jobs.healthy() if self._parts is not None else (True, "")

    def engine_config(self) -> EngineConfig:
        return engine_config(self.cfg, self.run_dir, self.live.offset_s)

    def _write_meta(self, extra: dict[str, Any]) -> None:
        gpu_meta = self._parts.build.gpu_meta if self._parts is not None else None
        checkpoint = self.live.checkpoint
        meta = {
            "run_id": self.run_id,
            "host": self.host,
            "soakd_version": __version__,
            "python": platform.python_version(),
            "started_utc": self.started_utc,
            "resumes": len(checkpoint.interruptions) if checkpoint is not None else 0,
            "config_source": self.cfg.source,
            "config": redacted(self.cfg.model_dump(mode="json")),
            "trace": asdict(self.trace.summary),
            **({"gpu": gpu_meta} if gpu_meta is not None else {}),
            **extra,
        }
        write_json_atomic(self.run_dir / META_FILE, meta)

    def _enter(self, phase: str) -> None:
        """The run reached `phase` (judge.criteria.STOP_PHASES): what a stop signal's verdict names."""
        if self.live.phase != phase:
            self.live.phase = phase
            log.info("run_phase", phase=phase)

    def _on_signal(self, signame: str) -> None:
        """A stop signal (SIGINT, SIGTERM, SIGHUP alike), in whatever phase the run is. The first stops the
        run: no more sends, the requests in flight drain (up to replay.drain_timeout), the verdict of the
        work done is written, with the phase (`stopped_in`). A stop during the warm-up aborts its requests
        (they are not the soak's); a further signal during the drain aborts the requests still in
        flight (each recorded once, failed as aborted) and the run goes on to its verdict."""
        live = self.live
        log.warning("signal_received", signal=signame, phase=live.phase)
        live.interrupted = True
        first = not live.stopped_by
        if first:
            live.stopped_by = signame
            live.stopped_in = live.phase
            if live.checkpoint is not None:
                live.checkpoint.stopped_by = signame
                _guard_sync("checkpoint", lambda: live.write_checkpoint(self.run_dir))
            pending = live.replayer.pending if live.replayer is not None else 0
            notify(f"STOPPING=1\nSTATUS=stopping ({signame}): draining {pending} requests in flight")
            if self._stop_task is None:
                with contextlib.suppress(RuntimeError):
                    self._stop_task = asyncio.get_running_loop().create_task(self._extend_stop())
        if live.replayer is not None:
            if live.replay_start is None or not first:
                # The warm-up's requests, or a drain the operator will not wait for: aborted now.
                live.replayer.abort()
            else:
                live.replayer.stop()
        elif first and not live.engine_started and live.checkpoint is not None:
            # The engine's start (minutes for a GPU engine) is cut short: its processes are killed and
            # the run ends with its verdict. One is left now too, in case the kill outlasts the service
            # manager's stop timeout; the normal end rewrites it. Only the first signal: a second Ctrl-C
            # must not cancel the cut-short start's own clean-up.
            log.warning("stop_during_engine_start")
            if self._start_task is not None:
                self._start_task.cancel()
            _guard_sync("early_verdict", lambda: self._judge(live.offset_s))

    def _adopt(self, replayer: Replayer) -> None:
        """`replayer` is the one a stop signal ends from now on. A signal that came while it was being
        made (the warm-up's phase logged, the schedule read) found none to end: it ends this one now,
        before its first send (the warm-up aborted, the replay stopped), or it would be lost."""
        live = self.live
        live.replayer = replayer
        if live.stopped_by:
            replayer.stop()

    # -- the run ---------------------------------------------------------------------------------------

    async def run(self) -> RunResult:
        self._t_start = time.monotonic()
        bind(run_id=self.run_id, host=self.host)
        loop = asyncio.get_running_loop()
        # First of all: a stop at any later point is a stop (marked, never resumed), not a default kill.
        # SIGHUP (the terminal closed) as SIGTERM; the engine's processes never see SIGINT or SIGHUP
        # (engine/vllm_local.py: TERMINAL_SIGNALS).
        signals = self._signals
        if signals is not None:
            signals.attach(loop, self._on_signal)
            if signals.received:
                # Came while the config, the trace and this run were set up: the run begins stopped.
                self._on_signal(signals.received[0])
        else:
            for sig in STOP_SIGNALS:
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self._on_signal, sig.name)
        try:
            return await self._run(loop)
        finally:
            if signals is not None:
                signals.detach()

    async def _run(self, loop: asyncio.AbstractEventLoop) -> RunResult:
        cfg, live = self.cfg, self.live
        self._open_run_dir()
        sinks = build_sinks(
            cfg,
            self.run_dir,
            {"run_id": self.run_id, "host": self.host},
            live,
            self.resumed,
            self._sinks,
        )
        writer, spool = sinks.writer, sinks.spool
        parts = self._parts = build_run(
            cfg,
            self.run_dir,
            self.model,
            live,
            sinks,
            self.engine_config(),
            self._engine_factory,
            on_engines=lambda infos: self._write_meta(
                {"engine": asdict(infos[-1]), "engines": [asdict(i) for i in infos]}
                | compat.meta_field(cfg, infos[-1])
            ),
            journal=self._journal,
            progress=self._progress,
        )
        stats = ReplayStats()
        ran_s = live.offset_s
        async with sinks.stack:
            self._start_event(writer)
            notify(f"STATUS=starting engine ({cfg.engine.kind})")
            try:
                async with parts.stack:
                    stats, ran_s = await self._run_replay(parts)
                    self._enter("verdict")
                    if not live.stopped_by:
                        notify("STOPPING=1\nSTATUS=stopping")
                        # The natural end stops the engine and ships the spool too: ask for time as a
                        # stop does.
                        self._stop_task = loop.create_task(self._extend_stop())
            finally:
                self._enter("verdict")
                verdict = self._finish(writer, stats, ran_s)
                _guard_sync("spool_flush", lambda: spool.flush(fsync=True))
        summary_doc = self._summary(verdict, stats, ran_s, writer, parts.stack, sinks.stack)
        _guard_sync("summary", lambda: write_json_atomic(self.run_dir / SUMMARY_FILE, summary_doc))
        if self._stop_task is not None:
            self._stop_task.cancel()
        word = verdict.word if not self._verdict_error else "verdict not written"
        notify(f"STATUS=done: {word}" + (f" (error: {live.error})" if live.error else ""))
        return RunResult(
            self.run_id, self.run_dir, verdict, summary_doc, live.error, live.stopped_by, self._verdict_error
        )

    def _open_run_dir(self) -> None:
        if self._resume_from is not None:
            self._begin_resumed(self._resume_from)
        else:
            # 0700: the run's files may name hosts, models and traffic; only the service user reads them.
            self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=False)
            # Its one owner from the start (soakd.owner); a resume owns its folder since find_resumable.
            take_run_dir(self.run_dir, wait_s=2.0)
            checkpoint = Checkpoint(self.run_id, self.fingerprint, self.started_utc, self.cfg.run.duration)
            # A stop that came during the setup: this run is never resumed either.
            checkpoint.stopped_by = self.live.stopped_by
            checkpoint.write(self.run_dir)
            self.live.checkpoint = checkpoint
        self._journal = DueJournal(self.run_dir / JOURNAL_FILE)
        self._write_meta({})

    def _start_event(self, writer: SampleWriter) -> None:
        cfg, live = self.cfg, self.live
        if self.resumed is None:
            writer.event("run_start", f"soak {self.run_id} starting", planned_s=cfg.run.duration)
            return
        gaps = live.checkpoint.interruptions if live.checkpoint is not None else []
        last = gaps[-1] if gaps else None
        writer.event(
            "run_resume",
            f"soak {self.run_id} resumed at {live.offset_s:.0f} s of {cfg.run.duration:.0f} s"
            + (f" after {last.down_s:.0f} s down, {last.lost_in_flight} requests lost" if last else ""),
            at_s=live.offset_s,
            down_s=last.down_s if last else 0.0,
            lost_in_flight=last.lost_in_flight if last else 0,
            planned_s=cfg.run.duration,
        )

    async def _start_engine(self, parts: RunParts) -> tuple[EngineInfo, PromptSynth, AdmissionGate] | None:
        """Start the engine, add the collectors it makes possible, warm it up. None when it did not start
        or the run was stopped meanwhile (the reason is in `live`)."""
        cfg, live, b = self.cfg, self.live, parts.build
        engine, writer = b.engine, b.writer
        if self.interrupted:
            return None  # stopped before the start began: no engine is started for nothing
        # In attach mode, the wait for the server to be ready: the same task, cut short the same way.
        self._enter("engine_start")
        # A task of its own, so a stop signal can cut it short (_on_signal cancels it).
        self._start_task = asyncio.ensure_future(engine.start())
        try:
            await self._start_task
        except EngineError as err:
            live.error = f"engine did not start: {err}"
            writer.event("engine_error", live.error)
            return None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not live.interrupted or (current is not None and current.cancelling()):
                raise  # this run itself is being cancelled, not stopped by a signal
            # Not an engine_error (an alert): a stop is not a failure; run_end says it was stopped.
            log.warning("engine_start_stopped", signal=live.stopped_by)
            return None
        finally:
            self._start_task = None
        live.engine_started = parts.engine_part.started = True
        if live.interrupted:
            return None
        info = engine.info
        writer.event(
            "engine_start",
            f"{info.kind} {info.version} started in {info.start_s:.1f} s",
            start_s=info.start_s,
            config=info.config_id,
        )
        compat.engine_event(cfg, info, writer.event)
        b.info = info
        for collector in build_collectors(b, "engine"):
            # Built now, for this engine: told which one at once (a rebuild tells it again).
            if isinstance(collector, EngineListener):
                collector.engine_started(info)
            parts.runner.add(collector)
        prompts = PromptSynth(info.vocab_size, cfg.run.seed, info.reserved_ids)
        gate = AdmissionGate(cfg.replay.max_concurrency)
        n = cfg.replay.warmup_requests
        if n > 0:
            self._enter("warmup")

            def on_replayer(replayer: Replayer) -> None:
                self._adopt(replayer)  # so a stop signal during warm-up ends it

            self._warmup_sent += await warm_up(
                engine,
                list(itertools.islice(self.trace, n)),
                prompts,
                gate,
                writer.event,
                on_replayer,
                run_tag=self.run_id[-4:] + "w",
                max_model_len=info.max_model_len,
                timeout_s=cfg.engine.start_timeout,
                seed=cfg.run.seed,
            )
            live.replayer = None  # done: a later signal is not its to take
        if parts.controller is not None:
            parts.controller.actuator.gate = gate
        if "engine" in cfg.telemetry.collectors and "per_step" in info.signals:
            # Without a per-step source (attach mode) `engine` points come from /metrics.
            b.engine_collector.activate()
        scraper = find(parts.runner.collectors, MetricsScraper)
        if scraper is not None:
            # A fresh scrape now is the baseline: start-up and warm-up counts are not the soak's.
            await _guard("metrics_baseline", scraper.refresh())
            scraper.rebase()
        return info, prompts, gate

    async def _run_replay(self, parts: RunParts) -> tuple[ReplayStats, float]:
        """The soak itself; returns the replay's stats and the replay time reached across resumes."""
        cfg, live = self.cfg, self.live
        stats = ReplayStats()
        if self.resumed is not None and self.resumed.remaining_s <= 0:
            # A run that crashed after its replay had ended (while stopping the engine or shipping) only
            # needs its verdict: no engine is started for nothing.
            log.info("resume_finishing", reason="the replay had ended before the crash")
            return stats, live.offset_s
        started = await self._start_engine(parts)
        if started is None or live.error or live.interrupted:
            if live.interrupted:
                log.warning("stopped_before_replay")
            return stats, live.offset_s
        info, prompts, gate = started
        controller, writer, profile = parts.controller, parts.build.writer, parts.build.profile
        replayer = Replayer(
            parts.build.engine,
            await self._scheduled(),
            prompts,
            gate,
            live.clock,
            self._on_record_fn(parts),
            run_tag=self.run_id[-4:],
            max_pending=cfg.replay.max_pending,
            max_model_len=info.max_model_len,
            drain_timeout_s=cfg.replay.drain_timeout,
            duration_s=max(0.0, cfg.run.duration - live.offset_s),
            seed=cfg.run.seed,
            sessions=cfg.replay.sessions,
            spec_sink=profile.add if "engine" in cfg.telemetry.collectors else None,
            on_due=self._journal_due,
            on_drain=lambda: self._enter("drain"),
        )
        self._adopt(replayer)
        notify("READY=1\nSTATUS=replaying")
        if self.resumed is not None:
            log.info("resume_replaying", resume_s=round(time.monotonic() - self._t_start, 3))
        if controller is not None:
            await controller.start()
            parts.runner.add(controller)
        # Everything alive now (the modules, the config, the engine's objects) is moved out of the
        # collector's reach: a full collection over it took 28-57 ms on the loop that paces the replay
        # (two per 300 requests, measured), a request sent that late; frozen, it stays a few ms.
        # Connections opened now, not while the first burst is due (an HTTP engine).
        await parts.build.engine.prepare_replay(gate.limit)
        gc.collect()
        gc.freeze()
        # The replayer's own start: its clock begins START_S after run() is called.
        t0 = live.replay_start = live.clock.monotonic() + START_S
        self._enter("replay")
        changes = EngineChanges(cfg.engine.changes, parts.build.engine, live)
        changes.start(t0)
        live.replaying = True
        try:
            stats = await replayer.run()
        finally:
            live.replaying = False
            gc.unfreeze()
            await changes.end()
        ran_s = live.offset_s + (live.clock.monotonic() - t0)
        if replayer.fatal:
            live.error = replayer.fatal
            writer.event("replay_error", f"replay ended early: {live.error}")
        return stats, ran_s

    async def _scheduled(self) -> Iterable[Scheduled]:
        cfg, summary = self.cfg, self.trace.summary
        scheduled: Iterable[Scheduled] = schedule(
            self.trace,
            span_s=summary.span_s,
            requests=summary.requests,
            speed=cfg.replay.speed,
            duration_s=cfg.run.duration,
            loop=cfg.replay.loop,
        )
        if self.resumed is None:
            return scheduled
        # The trace's next request after the crash point, on a clock that starts there. The requests
        # before it are read and skipped off the event loop, now: after READY=1 a long skip would block
        # the loop past the watchdog.
        rest = shifted(scheduled, self.resumed.done, self.live.offset_s)
        first = await asyncio.to_thread(next, rest, None)
        return rest if first is None else itertools.chain([first], rest)

    def _on_record_fn(self, parts: RunParts) -> Callable[[RequestRecord], None]:
        ceiling: CeilingTracker | None = parts.build.ceiling
        controller, writer, clock = parts.controller, parts.build.writer, self.live.clock

        def on_record(record: RequestRecord) -> None:
            sample = record.to_sample(clock.wall_ns())
            if ceiling is not None:
                ceiling.observe_request(record.input_tokens, record.output_tokens)
            if controller is not None:
                controller.observe_request(
                    record.input_tokens,
                    record.output_tokens,
                    ok=record.ok,
                    ttft_offered_s=record.ttft_offered_s,
                    tpot_s=record.tpot_s,
                )
            writer([sample])

        return on_record

    def _finish(self, writer: SampleWriter, stats: ReplayStats, ran_s: float) -> Verdict:
        """After the run stack stopped: the checkpoint, the run_end event, the verdict and its point."""
        cfg, live = self.cfg, self.live
        _guard_sync("checkpoint", lambda: live.write_checkpoint(self.run_dir, ran_s))
        if self._journal is not None:
            _guard_sync("journal_close", self._journal.close)
        writer.event(
            "run_end",
            f"replay ended after {ran_s:.1f} s"
            + (f" (stopped by {live.stopped_by})" if live.stopped_by else ""),
            ran_s=ran_s,
            completed=stats.completed,
            failed=stats.failed,
        )
        verdict = self._judge(ran_s)
        point = {
            # Only a verdict on disk may claim PASS.
            "passed": int(verdict.passed and not self._verdict_error),
            "ran_s": ran_s,
            "planned_s": cfg.run.duration,
            "requests": verdict.requests.scheduled,
            "completed": verdict.requests.completed,
            "failed": verdict.requests.failed,
            "verdict_written": int(not self._verdict_error),
            # Stopped on purpose (a signal): judged on the work done; an alert on it is a warning (its
            # PASS is of a shorter run), not a page.
            "stopped": int(bool(live.stopped_by)),
            # The run's span in epoch ms (its first start, across resumes, to now): the dashboard's
            # runs table links each run to its own time range.
            "start_ms": int(datetime.fromisoformat(self.started_utc).timestamp() * 1000),
            "end_ms": live.clock.wall_ns() // 1_000_000,
        }
        _guard_sync("run_point", lambda: writer([Sample("run", point, live.clock.wall_ns())]))
        return verdict

    def _summary(
        self,
        verdict: Verdict,
        stats: ReplayStats,
        ran_s: float,
        writer: SampleWriter,
        run_stack: Stack,
        sinks: Stack,
    ) -> dict[str, Any]:
        live = self.live
        # How the run ended as its verdict judged it: a signal that came after the verdict was written
        # must not make the summary say otherwise than verdict.json and the exit code.
        ending = verdict.ending
        doc: dict[str, Any] = {
            "run_id": self.run_id,
            # Only a verdict on disk is claimed: with none, the word says so.
            "verdict": verdict.word if not self._verdict_error else "NOT WRITTEN",
            "verdict_error": self._verdict_error,
            "exit_code": verdict.exit_code if not self._verdict_error else EXIT_ERROR,
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
            # verdict's figures); `replay` is this process's replayer alone.
            "requests": verdict.requests.to_dict(),
            "replay": asdict(stats),
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
        doc["outside_trace"] = {"warmup_requests": self._warmup_sent, "vocab_probe_requests": probes}
        stop_failures = {**sinks.stop_failures, **run_stack.stop_failures}
        if stop_failures:
            doc["stop_failures"] = stop_failures
        gaps = live.interruptions()
        if self.resumed is not None or gaps:
            doc["resume"] = {
                "interruptions": gaps,
                "requests_before": self.resumed.finished if self.resumed is not None else 0,
                "journal_errors": self._journal_errors,
            }
        return doc

    def _replay_began(self) -> bool:
        return self.live.replay_start is not None or self.live.offset_s > 0

    def _judge(self, ran_s: float) -> Verdict:
        """The verdict, written to verdict.json. If the disk refuses it, still returned, and the error
        kept (`_verdict_error`): the run then claims no verdict, and an earlier one (the early verdict of
        a stop during the engine's start) is removed so that none is left that says otherwise."""
        live = self.live
        verdict = verdict_of(
            self.run_id,
            self.cfg.criteria,
            live.metrics,
            ran_s=ran_s,
            planned_s=self.cfg.run.duration,
            ending=Ending(live.stopped_by, live.error, self._replay_began(), live.stopped_in),
            interruptions=live.interruptions(),
            stopped_code=self._stopped_code,
        )
        path = self.run_dir / VERDICT_FILE
        try:
            write_json_atomic(path, verdict.to_dict())
            self._verdict_error = ""
        except OSError as err:
            self._verdict_error = f"{path}: {err.strerror or err}"
            log.error("verdict_not_written", path=str(path), error=str(err))
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        return verdict

    # -- crash-resume -------------------------------------------------------------------------------

    def _begin_resumed(self, checkpoint: Checkpoint) -> None:
        state = self.resumed = take_up(self.run_dir, checkpoint)
        self.live.offset_s = state.offset_s
        self.live.metrics = state.metrics
        self.live.checkpoint = checkpoint
        self.started_utc = checkpoint.started_utc

    def _journal_due(self, item: Scheduled) -> None:
        """Journal a request that came due, at its place on the whole run's replay clock."""
        if self._journal is None:
            return
        try:
            self._journal.append(
                (item.loop, item.spec.index, item.spec.copy), item.due_s + self.live.offset_s
            )
        except OSError as err:
            # The request is still sent and recorded; a resume would only count it as lost if in flight.
            self._journal_errors += 1
            if self._journal_errors == 1 or self._journal_errors % 1000 == 0:
                log.error("journal_write_failed", error=str(err), errors=self._journal_errors)

    async def _extend_stop(self) -> None:
        """While a stop drains, ask the service manager for more time, in slices, up to a bound: the
        drain, the final shipping and the engine's shutdown, which the config bounds one by one."""
        step_s = 10.0
        sinks = self.cfg.sinks
        budget = self.cfg.replay.drain_timeout + sinks.influx.final_drain_timeout + 120.0
        budget += sinks.webhook.final_drain_timeout if sinks.webhook.enabled else 0.0
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            notify(f"EXTEND_TIMEOUT_USEC={int(3 * step_s * 1e6)}")
            await asyncio.sleep(step_s)


async def _guard(step: str, coro: Any) -> None:
    """Await one step whose failure must not end the run; log it by name and go on."""
    try:
        await coro
    except Exception as err:  # noqa: BLE001
        log.error("shutdown_step_failed", step=step, error=f"{type(err).__name__}: {err}")


def _guard_sync(step: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001  (the verdict and summary must still be written)
        log.error("shutdown_step_failed", step=step, error=f"{type(err).__name__}: {err}")
