"""The soak's replay as the run stack's last part: its start takes the run from a starting engine to the
replay's first send, `run` is the soak itself, and its summary is what the replay did.

The start, in order: the engine ready (parts.EnginePart), the warm-up, the engine's series counted from
then, the replayer made and handed to the stop signals (`LiveRun.adopt`), READY=1, the controller's
ceiling in force on the replay's gate, the connections opened, and the garbage collector frozen. A run
stopped, or whose engine failed, along the way goes no further: its verdict says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import structlog

from soakd.collectors.registry import Build
from soakd.collectors.runner import CollectorRunner
from soakd.config import Config, EngineChange
from soakd.control import Controller
from soakd.engine.base import EngineInfo
from soakd.engine.supervisor import EngineSupervisor
from soakd.live import LiveRun
from soakd.notify import notify
from soakd.parts import EnginePart
from soakd.replay.admission import AdmissionGate
from soakd.replay.pacer import Scheduled, schedule
from soakd.replay.prompts import PromptSynth
from soakd.replay.runner import START_S, Replayer, ReplayStats, RequestRecord
from soakd.replay.warmup import warm_up
from soakd.resume import DueJournal, ResumeState, shifted
from soakd.traces.loader import Trace

log = structlog.get_logger(__name__)


class ReplayPart:
    """The warm-up, the replay and what comes with them: the admission gate, the controller's start, the
    garbage collector's freeze and the configured engine changes."""

    name = "replay"
    stop_timeout_s = 60.0

    def __init__(
        self,
        cfg: Config,
        trace: Trace,
        build: Build,
        engine_part: EnginePart,
        runner: CollectorRunner,
        controller: Controller | None,
        *,
        run_tag: str,
        journal: DueJournal | None,
        resumed: ResumeState | None,
        began: float,
    ) -> None:
        self.cfg = cfg
        self._trace = trace
        self._b = build
        self._live: LiveRun = build.live
        self._engine_part = engine_part
        self._runner = runner
        self._controller = controller
        self._run_tag = run_tag
        self._journal = journal
        self._resumed = resumed
        self._began = began
        self._replayer: Replayer | None = None
        self._changes: EngineChanges | None = None
        self._frozen = False
        self.stats = ReplayStats()
        self.warmup_sent = 0
        """Warm-up requests sent before the replay (not the trace's)."""
        self.journal_errors = 0

    # -- the start: from a starting engine to the replay's first send --------------------------------

    async def start(self) -> None:
        live = self._live
        if live.replay_ended:
            log.info("resume_finishing", reason="the replay had ended before the crash")
            return
        info = await self._engine_part.ready()
        if not self._goes_on() or info is None:
            return
        prompts = PromptSynth(info.vocab_size, self.cfg.run.seed, info.reserved_ids)
        gate = AdmissionGate(self.cfg.replay.max_concurrency)
        await self._warm_up(info, prompts, gate)
        await self._engine_part.soak_begins(info)
        if not self._goes_on():
            return
        replayer = self._replayer = self._make_replayer(info, prompts, gate, await self._scheduled())
        live.adopt(replayer)
        notify("READY=1\nSTATUS=replaying")
        if self._resumed is not None:
            log.info("resume_replaying", resume_s=round(time.monotonic() - self._began, 3))
        if self._controller is not None:
            await self._controller.start(gate)
            self._runner.add(self._controller)
        # Everything alive now (the modules, the config, the engine's objects) is moved out of the
        # collector's reach: a full collection over it took 28-57 ms on the loop that paces the replay
        # (two per 300 requests, measured), a request sent that late; frozen, it stays a few ms.
        # Connections opened now, not while the first burst is due (an HTTP engine).
        await self._b.engine.prepare_replay(gate.limit)
        gc.collect()
        gc.freeze()
        self._frozen = True

    def _goes_on(self) -> bool:
        """False once the run was stopped or failed (the engine's start, the warm-up): the replay does not
        begin, and the verdict says why."""
        live = self._live
        if live.interrupted:
            log.warning("stopped_before_replay")
        return not (live.error or live.interrupted)

    async def _warm_up(self, info: EngineInfo, prompts: PromptSynth, gate: AdmissionGate) -> None:
        cfg, live = self.cfg, self._live
        n = cfg.replay.warmup_requests
        if n <= 0:
            return
        live.enter("warmup")
        self.warmup_sent += await warm_up(
            self._b.engine,
            list(itertools.islice(self._trace, n)),
            prompts,
            gate,
            self._b.writer.event,
            live.adopt,  # so a stop signal during warm-up ends it
            run_tag=self._run_tag + "w",
            max_model_len=info.max_model_len,
            timeout_s=cfg.engine.start_timeout,
            seed=cfg.run.seed,
        )
        live.replayer = None  # done: a later signal is not its to take

    def _make_replayer(
        self, info: EngineInfo, prompts: PromptSynth, gate: AdmissionGate, scheduled: Iterable[Scheduled]
    ) -> Replayer:
        cfg, live = self.cfg, self._live
        return Replayer(
            self._b.engine,
            scheduled,
            prompts,
            gate,
            live.clock,
            self._on_record_fn(),
            run_tag=self._run_tag,
            max_pending=cfg.replay.max_pending,
            max_model_len=info.max_model_len,
            drain_timeout_s=cfg.replay.drain_timeout,
            duration_s=max(0.0, cfg.run.duration - live.offset_s),
            seed=cfg.run.seed,
            sessions=cfg.replay.sessions,
            spec_sink=self._b.profile.add if "engine" in cfg.telemetry.collectors else None,
            on_due=self._journal_due,
            on_drain=lambda: live.enter("drain"),
        )

    async def _scheduled(self) -> Iterable[Scheduled]:
        cfg, summary = self.cfg, self._trace.summary
        scheduled: Iterable[Scheduled] = schedule(
            self._trace,
            span_s=summary.span_s,
            requests=summary.requests,
            speed=cfg.replay.speed,
            duration_s=cfg.run.duration,
            loop=cfg.replay.loop,
        )
        if self._resumed is None:
            return scheduled
        # The trace's next request after the crash point, on a clock that starts there. The requests
        # before it are read and skipped off the event loop, now: after READY=1 a long skip would block
        # the loop past the watchdog.
        rest = shifted(scheduled, self._resumed.done, self._live.offset_s)
        first = await asyncio.to_thread(next, rest, None)
        return rest if first is None else itertools.chain([first], rest)

    def _on_record_fn(self) -> Callable[[RequestRecord], None]:
        ceiling, controller = self._b.ceiling, self._controller
        writer, clock = self._b.writer, self._live.clock

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

    def _journal_due(self, item: Scheduled) -> None:
        """Journal a request that came due, at its place on the whole run's replay clock."""
        if self._journal is None:
            return
        try:
            self._journal.append(
                (item.loop, item.spec.index, item.spec.copy), item.due_s + self._live.offset_s
            )
        except OSError as err:
            # The request is still sent and recorded; a resume would only count it as lost if in flight.
            self.journal_errors += 1
            if self.journal_errors == 1 or self.journal_errors % 1000 == 0:
                log.error("journal_write_failed", error=str(err), errors=self.journal_errors)

    # -- the soak ------------------------------------------------------------------------------------

    async def run(self) -> float:
        """The soak itself (nothing when the start went no further); returns the replay time reached
        across resumes. Its stats are `stats`."""
        live, replayer = self._live, self._replayer
        if replayer is None:
            return live.offset_s
        # The replayer's own start: its clock begins START_S after run() is called.
        t0 = live.replay_start = live.clock.monotonic() + START_S
        live.enter("replay")
        self._changes = EngineChanges(self.cfg.engine.changes, self._b.engine, live)
        self._changes.start(t0)
        live.replaying = True
        try:
            self.stats = await replayer.run()
        finally:
            live.replaying = False
            await self._end()
        ran_s = live.offset_s + (live.clock.monotonic() - t0)
        if replayer.fatal:
            live.error = replayer.fatal
            self._b.writer.event("replay_error", f"replay ended early: {live.error}")
        return ran_s

    async def _end(self) -> None:
        if self._frozen:
            self._frozen = False
            gc.unfreeze()
        if self._changes is not None:
            changes, self._changes = self._changes, None
            await changes.end()

    async def stop(self) -> None:
        """What `run` ends, when it never ran (the start got as far as the freeze, then the run was
        cancelled); else nothing."""
        await self._end()

    def summary(self) -> Mapping[str, Any]:
        """`replay`: this process's replayer alone (the whole run's requests are the verdict's);
        `resume`: the crashes this run was resumed from, when there were any."""
        doc: dict[str, Any] = {"replay": asdict(self.stats)}
        gaps = self._live.interruptions()
        if self._resumed is not None or gaps:
            doc["resume"] = {
                "interruptions": gaps,
                "requests_before": self._resumed.finished if self._resumed is not None else 0,
                "journal_errors": self.journal_errors,
            }
        return doc


class EngineChanges:
    """The configured engine changes, each applied at its time into the replay (a resumed run started
    with those already due applied, see wiring.engine_config, and its clock starts at the crash point)."""

    def __init__(self, changes: Sequence[EngineChange], engine: EngineSupervisor, live: LiveRun) -> None:
        self._changes = sorted(changes, key=lambda c: c.at)
        self._engine = engine
        self._live = live
        self._task: asyncio.Task[None] | None = None
        self._rebuild: asyncio.Future[bool] | None = None

    def start(self, t0: float) -> None:
        self._task = asyncio.create_task(self._apply(t0))

    async def _apply(self, t0: float) -> None:
        live = self._live
        for change in self._changes:
            if change.at <= live.offset_s:
                continue
            await live.clock.sleep_until(t0 + change.at - live.offset_s, precise=False)
            if live.replayer is None or live.interrupted or live.error:
                return
            notify(f"STATUS=rebuilding the engine: {change.reason}")
            # Shielded: the end of the replay waits for a rebuild under way instead of cutting it.
            self._rebuild = asyncio.ensure_future(self._engine.rebuild(change))
            await asyncio.shield(self._rebuild)

    async def end(self) -> None:
        """Stop waiting for later changes. At the planned end a rebuild under way is finished; when the
        service is being stopped it is cancelled (the engine being started is stopped with it), so a
        stop is not held up by an engine start."""
        if self._rebuild is not None and not self._rebuild.done():
            if self._live.interrupted:
                self._rebuild.cancel()
            await asyncio.wait({self._rebuild})
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
