"""The run's own parts as lifecycle components: the collectors, the engine and the controller, with
what each adds to summary.json. (The sinks' parts are in sinks.parts, the scheduler is jobs.Jobs, the
replay is replay_part.ReplayPart.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import structlog

from soakd.collectors.base import EngineListener
from soakd.collectors.ceiling import CeilingTracker
from soakd.collectors.engine import EngineCollector, quantile_of_counts
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.host_throttle import HostThrottleWatch
from soakd.collectors.nvml_events import GpuEventListener
from soakd.collectors.prom import MetricsScraper
from soakd.collectors.registry import Build, build_collectors, each, find
from soakd.collectors.runner import CollectorRunner
from soakd.collectors.spec import AcceptanceDrift, SpecProfile
from soakd.control import Controller
from soakd.engine import compat
from soakd.engine.base import SIGNALS, EngineInfo
from soakd.engine.supervisor import EngineSupervisor
from soakd.errors import EngineError
from soakd.lifecycle import Part
from soakd.live import LiveRun
from soakd.loopwatch import LoopWatch
from soakd.sinks.writer import SampleWriter

log = structlog.get_logger(__name__)

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
            # A parallel engine's GPUs against each other: the straggler, per replica (None: one GPU).
            "gpu_spread": (gpu_watch.spread_summary() or None) if gpu_watch is not None else None,
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
    """The engine as a stack part. Its start is the run's first step (minutes for a GPU engine) and may
    fail: a failure is recorded in the live run (`live.error`, an `engine_error` event), a FAIL verdict,
    never an exception. The start runs as a task of its own, begun by `start` so that the parts after it
    (the scheduler: the watchdog, the host series) run meanwhile, awaited by `ready`, and cut short by a
    stop signal (`cut_short`). Its stop is bounded; its summary is what the engine's telemetry covered."""

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
        self._live = build.live
        self._drift = drift
        self._runner = runner
        self._starting: asyncio.Task[None] | None = None

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
        """Begin the engine's start; none when the run was stopped before it or its replay had ended (a
        resumed run that only needs its verdict): no engine is started for nothing. In attach mode, the
        wait for the server to be ready: the same task, cut short the same way."""
        live = self._live
        if live.interrupted or live.replay_ended:
            return
        live.enter("engine_start")
        self._starting = asyncio.ensure_future(self.engine.start())

    def cut_short(self) -> None:
        """A stop signal during the engine's start: the start is cancelled (its processes are killed)."""
        if self._starting is not None:
            self._starting.cancel()

    async def ready(self) -> EngineInfo | None:
        """The started engine, its collectors added (built now, for this engine); None when it did not
        start (the reason in `live.error`) or the run was stopped meanwhile."""
        live, writer = self._live, self._build.writer
        if self._starting is None:
            return None
        try:
            await self._starting
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
            self._starting = None
        live.engine_started = self.started = True
        if live.interrupted:
            return None
        info = self.engine.info
        writer.event(
            "engine_start",
            f"{info.kind} {info.version} started in {info.start_s:.1f} s",
            start_s=info.start_s,
            config=info.config_id,
        )
        compat.engine_event(self._build.cfg, info, writer.event)
        self._build.info = info
        for collector in build_collectors(self._build, "engine"):
            # Told which engine at once (a rebuild tells it again).
            if isinstance(collector, EngineListener):
                collector.engine_started(info)
            self._runner.add(collector)
        return info

    async def soak_begins(self, info: EngineInfo) -> None:
        """After the warm-up: the engine's own series count from now. Per-step stats are turned on (without
        a per-step source, attach mode, `engine` points come from /metrics), and a fresh scrape of the
        server's /metrics is the baseline: start-up and warm-up counts are not the soak's."""
        b = self._build
        if "engine" in b.cfg.telemetry.collectors and "per_step" in info.signals:
            b.engine_collector.activate()
        scraper = find(self._runner.collectors, MetricsScraper)
        if scraper is not None:
            try:
                await scraper.refresh()
            except Exception as err:  # noqa: BLE001  (a failed baseline must not end the run)
                log.error(
                    "shutdown_step_failed", step="metrics_baseline", error=f"{type(err).__name__}: {err}"
                )
            scraper.rebase()

    async def stop(self) -> None:
        if self._starting is not None:
            # A start nobody awaited (a later part's start failed, or the run was cancelled): cut short.
            starting, self._starting = self._starting, None
            starting.cancel()
            await asyncio.wait({starting})
            if not starting.cancelled():
                starting.exception()  # retrieved: its failure is this stop's, not an unheard task's
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
