"""The run's own parts as lifecycle components: the collectors, the engine and the controller, with
what each adds to summary.json. (The sinks' parts are in sinks.parts, the scheduler is jobs.Jobs.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from soakd.collectors.base import EngineListener
from soakd.collectors.ceiling import CeilingTracker
from soakd.collectors.engine import EngineCollector, quantile_of_counts
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.host_throttle import HostThrottleWatch
from soakd.collectors.nvml_events import GpuEventListener
from soakd.collectors.prom import MetricsScraper
from soakd.collectors.registry import Build, each, find
from soakd.collectors.runner import CollectorRunner
from soakd.collectors.spec import AcceptanceDrift, SpecProfile
from soakd.config import EngineChange
from soakd.control import Controller
from soakd.engine.base import SIGNALS, EngineInfo
from soakd.engine.supervisor import EngineSupervisor
from soakd.lifecycle import Part
from soakd.live import LiveRun
from soakd.loopwatch import LoopWatch
from soakd.notify import notify
from soakd.sinks.writer import SampleWriter

# vLLM's shutdown joins its engine-core process and workers; bounded so a stop never hangs on it.
ENGINE_STOP_TIMEOUT_S = 300.0


def collectors_part(runner: CollectorRunner, ceiling: CeilingTracker | None, ceiling_reason: str) -> Part:
    """The collectors: the GPU event listener's thread starts with the run; all close after the engine
    stops (the last collection already ran in the scheduler's stop)."""
    collectors = list(runner.collectors)

    async def start() -> None:
        for listener in each(collectors, GpuEventListener):
            listener.start()

    def summary() -> dict[str, Any]:
        gpu_watch, host_watch = find(collectors, GpuThrottleWatch), find(collectors, HostThrottleWatch)
        events, loopwatch = find(collectors, GpuEventListener), find(collectors, LoopWatch)
        return {
            "collectors": {name: asdict(h) for name, h in runner.health.items()},
            "loop": loopwatch.summary() if loopwatch is not None else None,
            "gpu_throttle": gpu_watch.summary() if gpu_watch is not None else None,
            "gpu_events": events.summary() if events is not None else None,
            "host_throttle": host_watch.summary() if host_watch is not None else None,
            "decode_ceiling": ceiling.summary()
            if ceiling is not None
            else {"available": False, "reason": ceiling_reason},
        }

    return Part("collectors", start=start, stop=runner.close, summary=summary)


def controller_part(controller: Controller | None, live: LiveRun) -> Part:
    """The controller takes part once the replay began (its start is the replay's first step): then
    its stop saves its state and its summary is the run's `control`."""

    async def stop() -> None:
        if controller is not None and live.replay_start is not None:
            await controller.finish()

    def summary() -> dict[str, Any]:
        started = controller is not None and live.replay_start is not None
        return {"control": controller.summary() if started and controller is not None else None}

    return Part("control", stop=stop, summary=summary)


class EnginePart:
    """The engine as a stack part: its start is the run's first step (it may fail, which is a verdict,
    not a crash); its stop is bounded; its summary is what the engine's telemetry covered."""

    name = "engine"
    stop_timeout_s = ENGINE_STOP_TIMEOUT_S

    def __init__(
        self,
        engine: EngineSupervisor,
        build: Build,
        drift: AcceptanceDrift,
        runner: CollectorRunner,
        on_engines: Callable[[list[EngineInfo]], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_engines = on_engines
        self.started = False
        self.infos: list[EngineInfo] = []
        self._build = build
        self._drift = drift
        self._runner = runner

    def engine_started(self, info: EngineInfo) -> None:
        """Every (re)start (the supervisor's hook): the collectors that tag or judge by the
        configuration are told, and `on_engines` hears which engines ran so far (for meta.json)."""
        for collector in self._runner.collectors:
            if isinstance(collector, EngineListener):
                collector.engine_started(info)
        self.infos.append(info)
        if self._on_engines is not None:
            self._on_engines(list(self.infos))

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        if self.started:
            await self.engine.stop()

    def summary(self) -> Mapping[str, Any]:
        ec = self._build.engine_collector
        return {
            "engine_steps": ec.steps_total,
            "spec_decode": {"drafts": ec.spec_drafts_total, "accepted": ec.spec_accepted_total},
            "engine_telemetry": engine_telemetry(
                self.engine,
                self.infos,
                ec,
                self._build.profile,
                self._drift,
                self._runner,
                self._build.writer,
            ),
        }


def engine_telemetry(
    engine: EngineSupervisor,
    engines: list[EngineInfo],
    engine_collector: EngineCollector,
    profile: SpecProfile,
    drift: AcceptanceDrift,
    runner: CollectorRunner,
    writer: SampleWriter,
) -> dict[str, Any]:
    """What the engine's own telemetry covered, and what it could not see (for the report)."""
    info = engines[-1] if engines else None
    signals = list(info.signals) if info is not None else []
    doc: dict[str, Any] = {
        "signals": signals,
        "missing": [text for name, text in SIGNALS.items() if name not in signals],
        "cudagraphs": engine_collector.cudagraph_summary(),
    }
    points = writer.counts.get("spec_decode", 0)
    if profile.requests and "spec_per_request" not in signals:
        # An attached server that reports per-request acceptance (its own --per-request-... flag).
        doc["missing"].remove(SIGNALS["spec_per_request"])
    scraper = find(runner.collectors, MetricsScraper)
    if scraper is not None:
        doc["metrics_missing"] = scraper.missing()
    # Known from the engine's own config where soakd sees it, else from what was written.
    spec_on = any(i.speculative_tokens > 0 for i in engines) if "per_step" in signals else points > 0
    if not spec_on:
        doc["spec_decode"] = {
            "enabled": False,
            "points": points,
            "note": "speculative decoding was off: no acceptance series were written",
        }
    else:
        doc["spec_decode"] = {
            "enabled": True,
            "points": points,
            "drafts": engine_collector.spec_drafts_total,
            "accepted": engine_collector.spec_accepted_total,
            "drift": drift.summary(),
            "profile": profile.summary(),
        }
    hist = dict(engine_collector.tokens_per_step)
    if hist:
        doc["tokens_per_step"] = {
            "steps": sum(hist.values()),
            "p50": quantile_of_counts(hist, 0.5),
            "p90": quantile_of_counts(hist, 0.9),
            "p99": quantile_of_counts(hist, 0.99),
            "max": max(hist),
        }
    doc.update(engine.telemetry_summary())
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
