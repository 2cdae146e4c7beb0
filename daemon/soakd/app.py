"""One soak run, from a validated config to a verdict: prepare, start the stacks, replay, judge, summarize.

The parts are built by `wiring`, scheduled by `jobs`, and started and stopped by `lifecycle.Stack`:
the sinks stack outermost (stopped last, after the verdict is in the spool), inside it the run stack
(collectors, engine, scheduler, controller, replay: stopped in reverse once the replay ends). The engine's
start and the warm-up are the run stack's start (parts.EnginePart, replay_part.ReplayPart); a failed
engine start is recorded in the live run, a FAIL verdict. What stays here is the run's own story: its
folder, its stop signals in every phase, its verdict and its summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from soakd.checkpoint import Checkpoint
from soakd.clock import Clock, SystemClock
from soakd.collectors.engine import EngineCollector
from soakd.collectors.engine_gpus import check_parallel
from soakd.config import Config, EngineConfig
from soakd.engine import compat
from soakd.engine.base import Engine
from soakd.errors import EXIT_STOPPED
from soakd.files import write_json_atomic
from soakd.jobs import Jobs, ProgressFn
from soakd.judge.criteria import Ending
from soakd.judge.verdict import Verdict, verdict_of, write_verdict
from soakd.lifecycle import guard_step
from soakd.live import LiveRun
from soakd.logs import bind
from soakd.metric import Sample
from soakd.notify import notify
from soakd.owner import take as take_run_dir
from soakd.policies.lever import choose_lever
from soakd.replay.runner import ReplayStats
from soakd.resume import (
    DueJournal,
    ResumeState,
    find_resumable,
    fingerprint,
    take_up,
)
from soakd.rundir import JOURNAL_FILE, META_FILE, SUMMARY_FILE, VERDICT_FILE
from soakd.rundocs import end_event, meta_doc, run_point, start_event, summary_doc
from soakd.sinks.registry import open_sinks
from soakd.sinks.writer import SampleWriter
from soakd.stopping import RunStop
from soakd.stopsignals import STOP_SIGNALS, StopSignals
from soakd.traces.loader import Trace, open_trace
from soakd.wiring import (
    RunInputs,
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
        check_parallel(cfg, os.environ)
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
        # The batch lever, chosen once: the engine's config, the controller and the actuator receive it.
        self.lever = choose_lever(cfg, self.run_dir)
        self.live = LiveRun(clock or SystemClock(), cfg.run.duration)
        self.resumed: ResumeState | None = None
        self.started_utc = datetime.now(UTC).isoformat()
        self._journal: DueJournal | None = None
        self._verdict_error = ""
        self._parts: RunParts | None = None
        self._stop = RunStop(
            cfg,
            self.live,
            self.run_dir,
            engine_part=lambda: self._parts.engine_part if self._parts is not None else None,
            early_verdict=lambda: self._judge(self.live.offset_s),
        )
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
        return engine_config(self.cfg, self.lever, self.live.offset_s)

    def _write_meta(self, extra: dict[str, Any]) -> None:
        gpu = self._parts.build.gpu_meta if self._parts is not None else None
        doc = meta_doc(
            self.cfg,
            self.run_id,
            self.host,
            self.started_utc,
            self.trace.summary,
            self.live.checkpoint,
            gpu,
            extra,
        )
        write_json_atomic(self.run_dir / META_FILE, doc)

    def _on_signal(self, signame: str) -> None:
        """A stop signal, in whatever phase the run is (stopping.RunStop says what it does)."""
        self._stop.on_signal(signame)

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
            return await self._run()
        finally:
            if signals is not None:
                signals.detach()

    async def _run(self) -> RunResult:
        cfg, live = self.cfg, self.live
        self._open_run_dir()
        tags = {"run_id": self.run_id, "host": self.host}
        sinks = build_sinks(cfg, self.run_dir, tags, live, self.resumed, self._sinks)
        writer, spool = sinks.writer, sinks.spool
        parts = self._parts = build_run(cfg, live, sinks, self._run_inputs())
        ran_s = live.offset_s
        async with sinks.stack:
            start_event(writer, self.run_id, live, resumed=self.resumed is not None)
            notify(f"STATUS=starting engine ({cfg.engine.kind})")
            try:
                # Collectors, engine, scheduler, controller, replay: the engine's start and the warm-up
                # are in the stack's start, which ends at the replay's first send (replay_part).
                async with parts.stack:
                    ran_s = await parts.replay.run()
                    live.enter("verdict")
                    self._stop.natural_end()
            finally:
                live.enter("verdict")
                verdict = self._finish(writer, parts.replay.stats, ran_s)
                guard_step("spool_flush", lambda: spool.flush(fsync=True))
        summary = summary_doc(
            self.run_id, verdict, self._verdict_error, ran_s, parts.replay, writer, parts.stack, sinks.stack
        )
        guard_step("summary", lambda: write_json_atomic(self.run_dir / SUMMARY_FILE, summary))
        self._stop.done()
        word = verdict.word if not self._verdict_error else "verdict not written"
        notify(f"STATUS=done: {word}" + (f" (error: {live.error})" if live.error else ""))
        return RunResult(
            self.run_id, self.run_dir, verdict, summary, live.error, live.stopped_by, self._verdict_error
        )

    def _run_inputs(self) -> RunInputs:
        return RunInputs(
            self.run_dir,
            self.run_id[-4:],
            self.model,
            self.trace,
            self.lever,
            self.engine_config(),
            self._engine_factory,
            on_engines=lambda infos: self._write_meta(
                {"engine": asdict(infos[-1]), "engines": [asdict(i) for i in infos]}
                | compat.meta_field(self.cfg, infos[-1])
            ),
            journal=self._journal,
            resumed=self.resumed,
            began=self._t_start,
            progress=self._progress,
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

    def _finish(self, writer: SampleWriter, stats: ReplayStats, ran_s: float) -> Verdict:
        """After the run stack stopped: the checkpoint, the run_end event, the verdict and its point."""
        live = self.live
        guard_step("checkpoint", lambda: live.write_checkpoint(self.run_dir, ran_s))
        if self._journal is not None:
            guard_step("journal_close", self._journal.close)
        end_event(writer, live, ran_s, stats)
        verdict = self._judge(ran_s)
        point = run_point(verdict, not self._verdict_error, ran_s, live, self.started_utc)
        guard_step("run_point", lambda: writer([Sample("run", point, live.clock.wall_ns())]))
        return verdict

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
            write_verdict(self.run_dir, verdict, remove_if_refused=True)
            self._verdict_error = ""
        except OSError as err:
            self._verdict_error = f"{path}: {err.strerror or err}"
            log.error("verdict_not_written", path=str(path), error=str(err))
        return verdict

    # -- crash-resume -------------------------------------------------------------------------------

    def _begin_resumed(self, checkpoint: Checkpoint) -> None:
        state = self.resumed = take_up(self.run_dir, checkpoint)
        self.live.offset_s = state.offset_s
        self.live.metrics = state.metrics
        self.live.checkpoint = checkpoint
        self.started_utc = checkpoint.started_utc
