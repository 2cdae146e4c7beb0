"""What a stop signal does to a run, in whatever phase it is, and the time a stopping run asks of the
service manager.

SIGINT, SIGTERM and SIGHUP alike (the process-level handler is stopsignals.StopSignals, which hands each
one to the run, `Soak._on_signal`, on the run's loop). The first stops the run: no more sends, the
requests in flight drain (up to replay.drain_timeout), the verdict of the work done is written, with the
phase (`stopped_in`). A stop during the warm-up aborts its requests (they are not the soak's); a stop
during the engine's start cuts it short; a further signal during the drain aborts the requests still in
flight (each recorded once, as left unfinished: `incomplete`, not failed) and the run goes on to its
verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from soakd.config import Config
from soakd.lifecycle import guard_step
from soakd.live import LiveRun
from soakd.notify import notify
from soakd.parts import EnginePart

log = structlog.get_logger(__name__)


class RunStop:
    """One run's stop: `on_signal` for each stop signal, `natural_end` when the replay ended on its own,
    `done` once the summary is written."""

    def __init__(
        self,
        cfg: Config,
        live: LiveRun,
        run_dir: Path,
        *,
        engine_part: Callable[[], EnginePart | None],
        early_verdict: Callable[[], object],
    ) -> None:
        self._cfg = cfg
        self._live = live
        self._run_dir = run_dir
        self._engine_part = engine_part
        self._early_verdict = early_verdict
        self._extending: asyncio.Task[None] | None = None

    def on_signal(self, signame: str) -> None:
        live = self._live
        log.warning("signal_received", signal=signame, phase=live.phase)
        live.interrupted = True
        first = not live.stopped_by
        if first:
            live.stopped_by = signame
            live.stopped_in = live.phase
            if live.checkpoint is not None:
                live.checkpoint.stopped_by = signame
                guard_step("checkpoint", lambda: live.write_checkpoint(self._run_dir))
            pending = live.replayer.pending if live.replayer is not None else 0
            notify(f"STOPPING=1\nSTATUS=stopping ({signame}): draining {pending} requests in flight")
            self._extend()
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
            engine_part = self._engine_part()
            if engine_part is not None:
                engine_part.cut_short()
            guard_step("early_verdict", self._early_verdict)

    def natural_end(self) -> None:
        """The replay ended without a stop signal: stopping the engine and shipping the spool take time
        too, asked for as a stop does."""
        if not self._live.stopped_by:
            notify("STOPPING=1\nSTATUS=stopping")
            self._extend()

    def done(self) -> None:
        if self._extending is not None:
            self._extending.cancel()

    def _extend(self) -> None:
        if self._extending is None:
            with contextlib.suppress(RuntimeError):  # no loop running (a signal during the setup)
                self._extending = asyncio.get_running_loop().create_task(self._extend_timeout())

    async def _extend_timeout(self) -> None:
        """While a stop drains, ask the service manager for more time, in slices, up to a bound: the
        drain, the final shipping and the engine's shutdown, which the config bounds one by one."""
        step_s = 10.0
        sinks = self._cfg.sinks
        budget = self._cfg.replay.drain_timeout + sinks.influx.final_drain_timeout + 120.0
        budget += sinks.webhook.final_drain_timeout if sinks.webhook.enabled else 0.0
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            notify(f"EXTEND_TIMEOUT_USEC={int(3 * step_s * 1e6)}")
            await asyncio.sleep(step_s)
