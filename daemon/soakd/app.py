"""Wire a soak from its Config: start order, the run loop, stop order, the verdict; and sd_notify."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import platform
import re
import secrets
import signal
import socket
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    JobEvent,
)
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from soakd import __version__
from soakd.collectors.allocator import AllocatorCollector
from soakd.collectors.base import Collector
from soakd.collectors.ceiling import Bandwidth, CeilingTracker
from soakd.collectors.engine import EngineCollector, quantile_of_counts
from soakd.collectors.gpu import probe_nvml
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.host import HostCollector
from soakd.collectors.host_throttle import HostThrottleWatch
from soakd.collectors.nvml import LiveNvml, NvmlCollector, NvmlSource, RecordedNvml
from soakd.collectors.nvml_events import GpuEventListener
from soakd.collectors.prom import MetricsScraper
from soakd.collectors.replay import ReplayCollector
from soakd.collectors.runner import CollectorRunner
from soakd.collectors.spec import AcceptanceDrift, DriftSettings, SpecProfile
from soakd.config import Config, EngineConfig
from soakd.control import ControlInputs, Controller, Slo, input_harm, input_throttled
from soakd.engine.base import ACTIVE_SEQS_ENV, SIGNALS, Engine, EngineInfo
from soakd.engine.supervisor import EngineSupervisor, apply_change
from soakd.engine.vllm_local import SCHEDULER_CLS
from soakd.errors import ConfigError, EngineError
from soakd.files import write_json_atomic
from soakd.judge.criteria import first_abort, run_context
from soakd.judge.metrics import RunMetrics
from soakd.judge.verdict import Verdict, lost_in_flight
from soakd.logs import bind
from soakd.loopwatch import LoopWatch
from soakd.metric import FieldValue, Sample
from soakd.notify import notify, watchdog_interval_s
from soakd.policies.actuator import Actuator
from soakd.policies.throttle import HarmSettings, ThrottleState
from soakd.probe import hardware_profiles, model_bytes
from soakd.redact import redacted
from soakd.replay.admission import AdmissionGate
from soakd.replay.clock import Clock, SystemClock
from soakd.replay.pacer import Scheduled, schedule
from soakd.replay.prompts import PromptSynth
from soakd.replay.runner import Replayer, ReplayStats, RequestRecord
from soakd.report.runs import verdict_of
from soakd.resume import (
    Checkpoint,
    DueJournal,
    Interruption,
    ResumeState,
    find_resumable,
    fingerprint,
    load_state,
    shifted,
)
from soakd.rundir import (
    JOURNAL_FILE,
    LIMIT_FILE,
    META_FILE,
    SNAPSHOT_FILE,
    SPOOL_DIR,
    SUMMARY_FILE,
    VERDICT_FILE,
)
from soakd.shapes import effective_load_format
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.health import SinkHealth, SpoolHealth
from soakd.sinks.influx import LineWriter, make_writer
from soakd.sinks.spool import Spool
from soakd.sinks.webhook import WebhookHealth, WebhookSender, WebhookSink, make_sender
from soakd.ticker import Ticker
from soakd.tinymodel import is_model_dir
from soakd.traces.loader import Trace, open_trace

log = structlog.get_logger(__name__)


class SampleWriter:
    """Adds the run-wide tags and writes samples to the spool, the one place every sample goes first.

    InfluxDB keeps one point per series and timestamp: two points with equal time would overwrite each
    other, so times are kept strictly increasing per series.
    """

    def __init__(
        self,
        spool: Spool,
        tags: dict[str, str],
        wall_ns: Callable[[], int] = time.time_ns,
        after_ns: int = 0,
        observe: Callable[[Sample], None] | None = None,
    ) -> None:
        self._spool = spool
        self._observe = observe
        """Sees every point as written (the verdict's metrics fold), before the spool takes it: the
        verdict counts a point even if the disk refuses its line."""
        self._tags = tags
        self._wall_ns = wall_ns
        self._after_ns = after_ns
        """Every point is later than this (a resumed run's newest point), even if the clock was set back."""
        self.clock_behind = 0
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, samples: Iterable[Sample]) -> None:
        out: list[Sample] = []
        for s in samples:
            tags = {**s.tags, **self._tags}
            key = (s.measurement, tuple(sorted(tags.items())))
            t = s.time_ns
            if t <= self._after_ns:
                self.clock_behind += 1
                if self.clock_behind == 1:
                    log.warning("clock_behind_spool", behind_s=(self._after_ns - t) / 1e9)
                t = self._after_ns + 1
            last = self._last.get(key)
            if last is not None and t <= last:
                t = last + 1
            self._last[key] = t
            point = Sample(s.measurement, s.fields, t, tags)
            out.append(point)
            self.counts[s.measurement] = self.counts.get(s.measurement, 0) + 1
            if self._observe is not None:
                self._observe(point)
        self._spool.write(out)

    def event(self, kind: str, message: str, **fields: FieldValue) -> None:
        """An annotation: something soakd saw or did (Grafana draws these on every panel).

        After the spool is closed (the very end of a run) events go to the log only."""
        log.info("event", kind=kind, message=message, **fields)
        if not self._spool.closed:
            # One `events` measurement holds every kind's fields, and InfluxDB refuses a batch whose field
            # type differs from what the shard has (an `ok` bool here, an integer there; 0 beside 0.5):
            # numbers are written as floats, whatever their Python type.
            values = {k: float(v) if isinstance(v, int) else v for k, v in fields.items()}
            self([Sample("events", {"message": message, **values}, self._wall_ns(), tags={"kind": kind})])


class _JobHealth:
    """Collector `scheduler`: the periodic jobs' misses and errors as a series, not only in the summary
    (a slow tier that overruns its interval, a job that raised, fast-tier slots skipped)."""

    name = "scheduler"

    def __init__(self, soak: Soak) -> None:
        self._soak = soak

    def collect(self, now_ns: int) -> list[Sample]:
        soak = self._soak
        fields: dict[str, FieldValue] = {"missed": soak.scheduler_missed, "errors": soak.scheduler_errors}
        for t in soak._tickers:
            fields[f"{t.name}_missed"] = t.missed
            fields[f"{t.name}_errors"] = t.errors
        return [Sample("scheduler", fields, now_ns)]

    def close(self) -> None:
        return None


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


ProgressFn = Callable[[float, float, ReplayStats], None]


# A Hugging Face repository id as vLLM takes it: ORG/NAME, one slash, no path syntax around it.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model(cfg: Config) -> str:
    """The model vLLM loads: a local folder, or a hub id (`hf:NAME`, or a bare ORG/NAME when no such
    local folder exists: a local folder wins) passed through as vLLM takes it.

    For `engine.kind = "openai"` the server has its model already: the URL is what must be given.
    """
    if cfg.engine.kind == "openai":
        if not cfg.engine.url:
            raise ConfigError(
                'engine.kind = "openai" needs the server\'s base URL', file=cfg.source, key="engine.url"
            )
        return cfg.engine.served_model
    model = cfg.engine.model
    if model.startswith("hf:"):
        return model[3:]
    path = cfg.resolve(model)
    # The default (models/tiny) is the folder the setup builds, never a hub id: missing, it is to be built.
    default = EngineConfig.model_fields["model"].default
    if not path.exists() and _HUB_ID.fullmatch(model) and model != default:
        return model
    if not is_model_dir(path):
        raise ConfigError(
            f"no model at {path} (a hub id such as Qwen/Qwen3-0.6B or hf:NAME, a folder with config.json "
            f"and weights, `soakd model shape NAME DIR` for a shape, or `soakd model tiny {model}`)",
            file=cfg.source,
            key="engine.model",
        )
    return str(path)


def new_run_id(name: str, now: datetime | None = None) -> str:
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{name}-{secrets.token_hex(2)}"


def make_engine(cfg: Config, model: str, collector: EngineCollector, log_dir: Path | None = None) -> Engine:
    if cfg.engine.kind == "openai":
        from soakd.engine.openai_http import OpenAIEngine

        return OpenAIEngine(cfg.engine, collector.push)
    if cfg.engine.kind == "vllm-server":
        from soakd.engine.vllm_server import VllmServerEngine

        return VllmServerEngine(cfg.engine, model, collector.push, log_dir or cfg.resolve("."))
    from soakd.engine.vllm_local import VllmLocalEngine

    return VllmLocalEngine(cfg.engine, model, collector.push)


def _check_writable(out_dir: Path, source: str) -> None:
    """Fail at start, as bad input, when runs cannot be written (not hours later)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot create {out_dir}: {err.strerror}", file=source, key="run.output_dir"
        ) from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{out_dir} is not writable", file=source, key="run.output_dir")


class Soak:
    """One soak run, from a validated config to a verdict. Components are built in start order."""

    def __init__(
        self,
        cfg: Config,
        *,
        progress: ProgressFn | None = None,
        clock: Clock | None = None,
        engine_factory: Callable[[Config, str, EngineCollector], Engine] | None = None,
        resume: bool = False,
    ) -> None:
        self.cfg = cfg
        self._progress = progress
        self._clock = clock or SystemClock()
        self._engine_factory = engine_factory or (
            lambda c, m, col: make_engine(c, m, col, log_dir=self.run_dir)
        )
        # Everything that can reject the input is checked here, before anything is written.
        self.trace: Trace = open_trace(cfg.trace, cfg.resolve, cfg.run.seed, cfg.replay)
        self.model = resolve_model(cfg)
        self.host = cfg.run.host or socket.gethostname()
        out_dir = cfg.resolve(cfg.run.output_dir)
        _check_writable(out_dir, cfg.source)
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
        self.resumed: ResumeState | None = None
        self._offset_s = 0.0
        """Replay time already done before this start (a resumed run)."""
        self._checkpoint: Checkpoint | None = None
        self._journal: DueJournal | None = None
        self._journal_errors = 0
        self.stopped_by = ""
        self._stop_task: asyncio.Task[None] | None = None
        self._last_collect = time.monotonic()
        self._scheduler: AsyncIOScheduler | None = None
        self.interrupted = False
        self.error = ""
        self.started_utc = datetime.now(UTC).isoformat()
        self._replayer: Replayer | None = None
        self._engine_started = False
        self.scheduler_missed = 0
        self._progress_start: float | None = None
        self.scheduler_errors = 0
        self._tickers: list[Ticker] = []
        """Fixed-rate samplers that run beside the scheduler (the GPU's fast tier, the loop watch)."""
        self._replaying = False
        self._loopwatch: LoopWatch | None = None
        self._engines: list[EngineInfo] = []
        self._supervisor: EngineSupervisor | None = None
        self._rebuild_task: asyncio.Future[bool] | None = None
        self._scraper: MetricsScraper | None = None
        self._allocator: AllocatorCollector | None = None
        self._nvml: NvmlCollector | None = None
        self._gpu_watch: GpuThrottleWatch | None = None
        self._gpu_events: GpuEventListener | None = None
        self._gpu_meta: dict[str, Any] | None = None
        """Driver, CUDA version and each GPU's static facts, for meta.json (the report's environment)."""
        self._host_watch: HostThrottleWatch | None = None
        self._ceiling: CeilingTracker | None = None
        self._controller: Controller | None = None
        self._ceiling_reason = ""
        self._gpu_clock: Callable[[], float] = time.monotonic
        self._writer_counts: dict[str, int] | None = None
        self._emit: Callable[..., None] | None = None
        self._metrics: RunMetrics | None = None
        # Secrets are read now, before anything is written (a bad credential is bad input: exit 2 with
        # nothing half-made), then taken out of the environment the engine's processes inherit.
        icfg = cfg.sinks.influx
        self._lines: LineWriter | None = make_writer(icfg, os.environ) if icfg.enabled else None
        wcfg = cfg.sinks.webhook
        self._alerts: WebhookSender | None = make_sender(wcfg, os.environ) if wcfg.enabled else None
        secret_names = (icfg.token_env, icfg.password_env, wcfg.token_env, wcfg.password_env)
        for name in (*secret_names, "CREDENTIALS_DIRECTORY"):
            os.environ.pop(name, None)

    def _write_meta(self, extra: dict[str, Any]) -> None:
        meta = {
            "run_id": self.run_id,
            "host": self.host,
            "soakd_version": __version__,
            "python": platform.python_version(),
            "started_utc": self.started_utc,
            "resumes": len(self._checkpoint.interruptions) if self._checkpoint is not None else 0,
            "config_source": self.cfg.source,
            "config": redacted(self.cfg.model_dump(mode="json")),
            "trace": asdict(self.trace.summary),
            **({"gpu": self._gpu_meta} if self._gpu_meta is not None else {}),
            **extra,
        }
        write_json_atomic(self.run_dir / META_FILE, meta)

    def _on_signal(self, signame: str) -> None:
        log.warning("signal_received", signal=signame)
        self.interrupted = True
        if not self.stopped_by:
            self.stopped_by = signame
            if self._checkpoint is not None:
                self._checkpoint.stopped_by = signame
                self._guard_sync("checkpoint", self._write_checkpoint)
            pending = self._replayer.pending if self._replayer is not None else 0
            notify(f"STOPPING=1\nSTATUS=stopping ({signame}): draining {pending} requests in flight")
            with contextlib.suppress(RuntimeError):
                self._stop_task = asyncio.get_running_loop().create_task(self._extend_stop())
        if self._replayer is not None:
            self._replayer.stop()
        elif not self._engine_started and self._checkpoint is not None:
            # The engine's start cannot be cut short and may outlast the service manager's stop timeout:
            # leave a verdict now (FAIL, stopped before replay); the normal end rewrites it if reached.
            log.warning("stop_during_engine_start", hint="stopping once the engine is up")
            metrics = self._metrics if self._metrics is not None else RunMetrics()
            self._guard_sync("early_verdict", lambda: self._judge(self._offset_s, metrics))

    async def run(self) -> RunResult:
        cfg = self.cfg
        bind(run_id=self.run_id, host=self.host)
        t_start = time.monotonic()
        loop = asyncio.get_running_loop()
        # First of all: a stop at any later point is a stop (marked, never resumed), not a default kill.
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig.name)
        if self._resume_from is not None:
            self._begin_resumed(self._resume_from)
        else:
            # 0700: the run's files may name hosts, models and traffic; only the service user reads them.
            self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=False)
            self._checkpoint = Checkpoint(self.run_id, self.fingerprint, self.started_utc, cfg.run.duration)
            self._checkpoint.write(self.run_dir)
        self._journal = DueJournal(self.run_dir / JOURNAL_FILE)
        self._write_meta({})
        scfg = cfg.sinks.spool
        spool = Spool(
            self.run_dir / SPOOL_DIR,
            scfg.segment_bytes,
            scfg.fsync_interval,
            max_bytes=scfg.max_bytes,
            min_free_bytes=scfg.min_free_bytes,
        )
        metrics = self._metrics = self.resumed.metrics if self.resumed is not None else RunMetrics()
        writer = SampleWriter(
            spool,
            {"run_id": self.run_id, "host": self.host},
            after_ns=self.resumed.last_point_ns if self.resumed is not None else 0,
            observe=metrics.add,
        )
        if self.resumed is not None:
            writer.counts.update(self.resumed.points)
        self._writer_counts = writer.counts
        self._emit = writer.event

        def on_spool(kind: str, fields: dict[str, FieldValue]) -> None:
            what = "degraded" if kind == "spool_degraded" else "recovered"
            writer.event(
                kind, f"spool {what}: {fields.get('state', '')} {fields.get('reason', '')}".strip(), **fields
            )

        spool.on_event = on_spool
        forwarder = self._make_forwarder(writer)
        webhook = self._make_webhook(writer)
        dcfg = cfg.telemetry.spec_drift
        drift = AcceptanceDrift(
            DriftSettings(dcfg.baseline, dcfg.window, dcfg.threshold, dcfg.min_draft_tokens),
            on_event=writer.event,
        )
        engine_collector = EngineCollector(active=False, drift=drift)
        engine_collector.ceiling = self._ceiling = self._make_ceiling()
        profile = SpecProfile()

        def build(ecfg: EngineConfig) -> Engine:
            return self._engine_factory(cfg.model_copy(update={"engine": ecfg}), self.model, engine_collector)

        def on_started(info: EngineInfo) -> None:
            # After a rebuild every engine series carries the new configuration's id.
            engine_collector.config_id = profile.config_id = info.config_id
            if self._scraper is not None:
                self._scraper.config_id = info.config_id
            if self._allocator is not None:
                self._allocator.config_id = info.config_id
            engine_collector.cudagraphs = info.cudagraphs
            if self._engines and self._engines[-1].speculative_tokens != info.speculative_tokens:
                # Other draft settings accept differently by design: drift is judged anew against
                # this configuration's own first window.
                drift.reset()
            self._engines.append(info)
            self._write_meta({"engine": asdict(info), "engines": [asdict(i) for i in self._engines]})

        engine = self._supervisor = EngineSupervisor(
            build, self._engine_config(), on_event=writer.event, on_started=on_started
        )
        collectors = self._make_collectors(engine, engine_collector, writer)
        health: list[Collector] = [SpoolHealth(spool)]
        if forwarder is not None:
            health.append(SinkHealth(forwarder))
        if webhook is not None:
            health.append(WebhookHealth(webhook))
        loopwatch = self._loopwatch = LoopWatch(writer.event, active=lambda: self._replaying and engine.ready)
        self._tickers.append(loopwatch.ticker)
        runner = CollectorRunner([*collectors, _JobHealth(self), loopwatch, *health], writer)
        controller = self._make_controller(engine, engine_collector, drift, writer)
        scheduler = self._scheduler = self._make_scheduler(runner, spool, forwarder, engine)
        if webhook is not None:
            self._add_webhook_job(scheduler, spool, webhook)
        if self.resumed is not None:
            gaps = self._checkpoint.interruptions if self._checkpoint is not None else []
            last = gaps[-1] if gaps else None
            writer.event(
                "run_resume",
                f"soak {self.run_id} resumed at {self._offset_s:.0f} s of {cfg.run.duration:.0f} s"
                + (f" after {last.down_s:.0f} s down, {last.lost_in_flight} requests lost" if last else ""),
                at_s=self._offset_s,
                down_s=last.down_s if last else 0.0,
                lost_in_flight=last.lost_in_flight if last else 0,
                planned_s=cfg.run.duration,
            )
        else:
            writer.event("run_start", f"soak {self.run_id} starting", planned_s=cfg.run.duration)
        notify(f"STATUS=starting engine ({cfg.engine.kind})")
        scheduler.start()
        for ticker in self._tickers:
            ticker.start()
        # A run that crashed after its replay had ended (while stopping the engine or shipping) only
        # needs its verdict: no engine is started for nothing.
        finishing = self.resumed is not None and self.resumed.remaining_s <= 0
        started = False
        t_run0 = t_run1 = self._clock.monotonic()
        stats = ReplayStats()
        try:
            try:
                if finishing:
                    log.info("resume_finishing", reason="the replay had ended before the crash")
                else:
                    await engine.start()
                    started = self._engine_started = True
            except EngineError as err:
                self.error = f"engine did not start: {err}"
                writer.event("engine_error", self.error)
            if started and not self.interrupted:
                info = engine.info
                writer.event(
                    "engine_start",
                    f"{info.kind} {info.version} started in {info.start_s:.1f} s",
                    start_s=info.start_s,
                    config=info.config_id,
                )
                self._add_engine_collectors(runner, engine, info, engine_collector, profile)
                prompts = PromptSynth(info.vocab_size, cfg.run.seed, info.reserved_ids)
                gate = AdmissionGate(cfg.replay.max_concurrency)
                await self._warm_up(engine, prompts, gate, writer, info.max_model_len)
                if controller is not None:
                    controller.actuator.gate = gate
                if "engine" in cfg.telemetry.collectors and "per_step" in info.signals:
                    # Without a per-step source (attach mode) `engine` points come from /metrics.
                    engine_collector.activate()
                if self._scraper is not None:
                    # A fresh scrape now is the baseline: start-up and warm-up counts are not the soak's.
                    await self._guard("metrics_baseline", self._scraper.refresh())
                    self._scraper.rebase()
            if started and not self.interrupted and not self.error:
                summary = self.trace.summary
                scheduled: Iterable[Scheduled] = schedule(
                    self.trace,
                    span_s=summary.span_s,
                    requests=summary.requests,
                    speed=cfg.replay.speed,
                    duration_s=cfg.run.duration,
                    loop=cfg.replay.loop,
                )
                if self.resumed is not None:
                    # The trace's next request after the crash point, on a clock that starts there. The
                    # requests before it are read and skipped off the event loop, now: after READY=1 a
                    # long skip would block the loop past the watchdog.
                    rest = shifted(scheduled, self.resumed.done, self._offset_s)
                    first = await asyncio.to_thread(next, rest, None)
                    scheduled = rest if first is None else itertools.chain([first], rest)

                def on_record(record: RequestRecord) -> None:
                    sample = record.to_sample(self._clock.wall_ns())
                    if self._ceiling is not None:
                        self._ceiling.observe_request(record.input_tokens, record.output_tokens)
                    if controller is not None:
                        controller.observe_request(
                            record.input_tokens,
                            record.output_tokens,
                            ok=record.ok,
                            ttft_s=record.ttft_s,
                            tpot_s=record.tpot_s,
                            queue_s=record.queue_s,
                        )
                    writer([sample])

                self._replayer = Replayer(
                    engine,
                    scheduled,
                    prompts,
                    gate,
                    self._clock,
                    on_record,
                    run_tag=self.run_id[-4:],
                    max_pending=cfg.replay.max_pending,
                    max_model_len=info.max_model_len,
                    drain_timeout_s=cfg.replay.drain_timeout,
                    duration_s=max(0.0, cfg.run.duration - self._offset_s),
                    seed=cfg.run.seed,
                    sessions=cfg.replay.sessions,
                    spec_sink=profile.add if "engine" in cfg.telemetry.collectors else None,
                    on_due=self._journal_due,
                )
                notify("READY=1\nSTATUS=replaying")
                if self.resumed is not None:
                    log.info("resume_replaying", resume_s=round(time.monotonic() - t_start, 3))
                if controller is not None:
                    await controller.start()
                    runner.add(controller)
                    self._controller = controller
                t_run0 = self._clock.monotonic()
                self._progress_start = t_run0
                changes = asyncio.create_task(self._apply_changes(engine, t_run0))
                self._replaying = True
                try:
                    stats = await self._replayer.run()
                finally:
                    self._replaying = False
                    await self._end_changes(changes)
                t_run1 = self._clock.monotonic()
                if self._replayer.fatal:
                    self.error = self._replayer.fatal
                    writer.event("replay_error", f"replay ended early: {self.error}")
            elif self.interrupted:
                log.warning("stopped_before_replay")
        finally:
            if not self.stopped_by:
                notify("STOPPING=1\nSTATUS=stopping")
                # The natural end stops the engine and ships the spool too: ask for time as a stop does.
                self._stop_task = asyncio.get_running_loop().create_task(self._extend_stop())
            # Each step on its own: one failing (a full disk, say) must not keep the engine running.
            await self._guard("progress", self._tick_progress())
            if self._controller is not None:
                await self._guard("control_finish", self._controller.finish())
            self._guard_sync("final_collect", runner.run_once)
            self._guard_sync("scheduler", lambda: scheduler.shutdown(wait=False))
            for ticker in self._tickers:
                ticker.stop()
            if started:
                await self._guard("engine_stop", engine.stop())
            self._guard_sync("collectors_close", runner.close)
        ran_s = self._offset_s + (t_run1 - t_run0)
        self._guard_sync("checkpoint", lambda: self._write_checkpoint(ran_s))
        if self._journal is not None:
            self._guard_sync("journal_close", self._journal.close)
        writer.event(
            "run_end",
            f"replay ended after {ran_s:.1f} s" + (" (interrupted)" if self.interrupted else ""),
            ran_s=ran_s,
            completed=stats.completed,
            failed=stats.failed,
        )
        verdict = self._judge(ran_s, metrics)
        self._guard_sync(
            "run_point",
            lambda: writer(
                [
                    Sample(
                        "run",
                        {
                            "passed": int(verdict.passed),
                            "ran_s": ran_s,
                            "planned_s": cfg.run.duration,
                            "requests": verdict.requests.scheduled,
                            "completed": verdict.requests.completed,
                            "failed": verdict.requests.failed,
                            # Stopped on purpose (SIGTERM: a service stop): the FAIL is expected, and
                            # an alert on it is a warning, not a page.
                            "stopped": int(bool(self.stopped_by)),
                        },
                        self._clock.wall_ns(),
                    )
                ]
            ),
        )
        self._guard_sync("spool_flush", lambda: spool.flush(fsync=True))
        alerted_all = True
        if webhook is not None:
            # First: the verdict and the episodes the end resolved reach the on-call in seconds.
            notify("STATUS=sending the last alerts")
            try:
                alerted_all = await webhook.drain(cfg.sinks.webhook.final_drain_timeout)
            except Exception as err:  # noqa: BLE001  (the verdict and summary must still be written)
                log.error("shutdown_step_failed", step="webhook_drain", error=f"{type(err).__name__}: {err}")
                alerted_all = False
            await self._guard("webhook_close", webhook.aclose())
        shipped_all = True
        if forwarder is not None:
            notify("STATUS=shipping spool to InfluxDB")
            # Shipped before the spool closes, so outage/backfill events of this last stretch are kept.
            try:
                shipped_all = await forwarder.drain(cfg.sinks.influx.final_drain_timeout)
            # The verdict and summary must still be written, whatever the last shipping raised.
            except Exception as err:  # noqa: BLE001
                log.error("shutdown_step_failed", step="influx_drain", error=f"{type(err).__name__}: {err}")
                shipped_all = False
            if not shipped_all:
                log.error(
                    "influx_backlog_left",
                    lines=forwarder.backlog_lines(),
                    hint="the spool keeps them; ship them later with `soakd report RUN --ship`",
                )
            await self._guard("influx_close", forwarder.writer.aclose())
        self._guard_sync("spool_close", spool.close)
        summary_doc = {
            "run_id": self.run_id,
            "verdict": verdict.word,
            "error": self.error,
            "ran_s": ran_s,
            "interrupted": self.interrupted,
            # The whole run across resumed processes, lost-in-flight requests counted as failed (the
            # verdict's figures); `replay` is this process's replayer alone.
            "requests": verdict.requests.to_dict(),
            "replay": asdict(stats),
            "points": dict(sorted(writer.counts.items())),
            "spool": {
                "lines": spool.lines_written,
                "bytes": spool.bytes_written,
                "segments": spool.segments_created,
                "fsyncs": spool.fsyncs,
                "total_bytes": spool.total_bytes,
                "state": spool.state,
                "dropped": dict(sorted(spool.dropped.items())),
            },
            "influx": None
            if forwarder is None
            else {
                "lines_shipped": forwarder.lines_shipped,
                "lines_rejected": forwarder.lines_rejected,
                "failures": forwarder.failures,
                "backlog_lines": forwarder.backlog_lines(),
                "all_shipped": shipped_all,
            },
            "webhook": None if webhook is None else {**webhook.summary(), "all_delivered": alerted_all},
            "collectors": {name: asdict(h) for name, h in runner.health.items()},
            "scheduler": {"missed": self.scheduler_missed, "errors": self.scheduler_errors},
            "tickers": {
                t.name: {"runs": t.runs, "missed": t.missed, "errors": t.errors} for t in self._tickers
            },
            "loop": self._loopwatch.summary() if self._loopwatch is not None else None,
            "engine_steps": engine_collector.steps_total,
            "spec_decode": {
                "drafts": engine_collector.spec_drafts_total,
                "accepted": engine_collector.spec_accepted_total,
            },
            "engine_telemetry": self._engine_telemetry(engine, engine_collector, profile, drift),
            "gpu_throttle": self._gpu_watch.summary() if self._gpu_watch is not None else None,
            "gpu_events": self._gpu_events.summary() if self._gpu_events is not None else None,
            "host_throttle": self._host_watch.summary() if self._host_watch is not None else None,
            "control": self._controller.summary() if self._controller is not None else None,
            "decode_ceiling": self._ceiling.summary()
            if self._ceiling is not None
            else {"available": False, "reason": self._ceiling_reason},
        }
        if self.resumed is not None or self._interruptions():
            summary_doc["resume"] = {
                "interruptions": self._interruptions(),
                "requests_before": self.resumed.finished if self.resumed is not None else 0,
                "journal_errors": self._journal_errors,
            }
        self._guard_sync("summary", lambda: write_json_atomic(self.run_dir / SUMMARY_FILE, summary_doc))
        if self._stop_task is not None:
            self._stop_task.cancel()
        notify(f"STATUS=done: {verdict.word}" + (f" (error: {self.error})" if self.error else ""))
        return RunResult(self.run_id, self.run_dir, verdict, summary_doc, self.error, self.stopped_by)

    def _judge(self, ran_s: float, metrics: RunMetrics) -> Verdict:
        """The verdict, written to verdict.json; if the disk refuses it, still returned (and logged)."""
        verdict = verdict_of(
            self.run_id,
            self.cfg.criteria,
            metrics,
            ran_s=ran_s,
            planned_s=self.cfg.run.duration,
            interrupted=self.interrupted or bool(self.error),
            interruptions=self._interruptions(),
        )
        try:
            write_json_atomic(self.run_dir / VERDICT_FILE, verdict.to_dict())
        except OSError as err:
            log.error("verdict_not_written", error=str(err))
        return verdict

    # -- crash-resume -------------------------------------------------------------------------------

    def _begin_resumed(self, checkpoint: Checkpoint) -> None:
        """Take up an unfinished run: its accounting from journal and spool, the crash as an interruption."""
        state = self.resumed = load_state(self.run_dir, checkpoint)
        self._offset_s = state.offset_s
        self.started_utc = checkpoint.started_utc
        down_s = max(0.0, (time.time_ns() - state.last_seen_ns) / 1e9)
        if state.remaining_s > 0 or state.lost:
            # A crash after the replay ended with nothing in flight cut nothing short: no interruption.
            checkpoint.interruptions.append(
                Interruption(state.offset_s, down_s, len(state.lost), datetime.now(UTC).isoformat())
            )
            checkpoint.lost.extend(state.lost)
        checkpoint.elapsed_s = state.offset_s
        self._checkpoint = checkpoint
        checkpoint.write(self.run_dir)
        log.warning(
            "run_resumed",
            at_s=round(state.offset_s, 3),
            down_s=round(down_s, 3),
            finished=state.finished,
            lost_in_flight=len(state.lost),
            remaining_s=round(state.remaining_s, 3),
        )

    def _interruptions(self) -> list[dict[str, Any]]:
        return [asdict(i) for i in self._checkpoint.interruptions] if self._checkpoint is not None else []

    def _journal_due(self, item: Scheduled) -> None:
        """Journal a request that came due, at its place on the whole run's replay clock."""
        if self._journal is None:
            return
        try:
            self._journal.append((item.loop, item.spec.index, item.spec.copy), item.due_s + self._offset_s)
        except OSError as err:
            # The request is still sent and recorded; a resume would only count it as lost if in flight.
            self._journal_errors += 1
            if self._journal_errors == 1 or self._journal_errors % 1000 == 0:
                log.error("journal_write_failed", error=str(err), errors=self._journal_errors)

    def _elapsed(self) -> float:
        """Replay time reached, across resumes."""
        if self._progress_start is None:
            return self._offset_s
        return self._offset_s + self._clock.monotonic() - self._progress_start

    def _write_checkpoint(self, elapsed_s: float | None = None) -> None:
        if self._checkpoint is None:
            return
        self._checkpoint.elapsed_s = self._elapsed() if elapsed_s is None else elapsed_s
        self._checkpoint.write(self.run_dir)

    async def _checkpoint_job(self) -> None:
        self._write_checkpoint()

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

    def _add_engine_collectors(
        self,
        runner: CollectorRunner,
        engine: EngineSupervisor,
        info: EngineInfo,
        engine_collector: EngineCollector,
        profile: SpecProfile,
    ) -> None:
        """Collectors whose source exists only once the engine runs, chosen by what it offers."""
        names = self.cfg.telemetry.collectors
        if "engine" in names:
            runner.add(profile)
        if "allocator" in names and "allocator" in info.signals:
            self._allocator = AllocatorCollector(engine.memory_stats, config_id=info.config_id)
            runner.add(self._allocator)
        if "metrics" in names and "metrics" in info.signals:
            self._scraper = MetricsScraper(
                engine.metrics_text, per_step="per_step" in info.signals, config_id=info.config_id
            )
            runner.add(self._scraper)

    async def _apply_changes(self, engine: EngineSupervisor, t0: float) -> None:
        """The configured engine changes, each at its time into the replay (a resumed run started with
        those already due applied, see _engine_config, and its clock starts at the crash point)."""
        for change in sorted(self.cfg.engine.changes, key=lambda c: c.at):
            if change.at <= self._offset_s:
                continue
            await self._clock.sleep_until(t0 + change.at - self._offset_s, precise=False)
            if self._replayer is None or self.interrupted or self.error:
                return
            notify(f"STATUS=rebuilding the engine: {change.reason}")
            # Shielded: the end of the replay waits for a rebuild under way instead of cutting it.
            self._rebuild_task = asyncio.ensure_future(engine.rebuild(change))
            await asyncio.shield(self._rebuild_task)

    async def _end_changes(self, task: asyncio.Task[None]) -> None:
        """Stop waiting for later changes. At the planned end a rebuild under way is finished; when the
        service is being stopped it is cancelled (the engine being started is stopped with it), so a
        stop is not held up by an engine start."""
        if self._rebuild_task is not None and not self._rebuild_task.done():
            if self.interrupted:
                self._rebuild_task.cancel()
            await asyncio.wait({self._rebuild_task})
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _engine_telemetry(
        self,
        engine: EngineSupervisor,
        engine_collector: EngineCollector,
        profile: SpecProfile,
        drift: AcceptanceDrift,
    ) -> dict[str, Any]:
        """What the engine's own telemetry covered, and what it could not see (for the report)."""
        info = self._engines[-1] if self._engines else None
        signals = list(info.signals) if info is not None else []
        doc: dict[str, Any] = {
            "signals": signals,
            "missing": [text for name, text in SIGNALS.items() if name not in signals],
            "cudagraphs": engine_collector.cudagraph_summary(),
        }
        points = self._writer_counts.get("spec_decode", 0) if self._writer_counts is not None else 0
        if profile.requests and "spec_per_request" not in signals:
            # An attached server that reports per-request acceptance (its own --per-request-... flag).
            doc["missing"].remove(SIGNALS["spec_per_request"])
        if self._scraper is not None:
            doc["metrics_missing"] = self._scraper.missing()
        # Known from the engine's own config where soakd sees it, else from what was written.
        spec_on = (
            any(i.speculative_tokens > 0 for i in self._engines) if "per_step" in signals else points > 0
        )
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

    async def _guard(self, step: str, coro: Coroutine[Any, Any, Any]) -> None:
        """Await one shutdown step; log its failure and go on with the others."""
        try:
            await coro
        # Shutdown must reach the verdict whatever one step raises; each failure is logged by name.
        except Exception as err:  # noqa: BLE001
            log.error("shutdown_step_failed", step=step, error=f"{type(err).__name__}: {err}")

    def _guard_sync(self, step: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001  (same reason as _guard)
            log.error("shutdown_step_failed", step=step, error=f"{type(err).__name__}: {err}")

    async def _warm_up(
        self,
        engine: Engine,
        prompts: PromptSynth,
        gate: AdmissionGate,
        writer: SampleWriter,
        max_model_len: int,
    ) -> None:
        """Send the trace's first requests once, unrecorded, so one-off kernel compilation (Triton JIT,
        first-shape allocations) does not land in the soak's latencies. Its prompts use their own salt,
        so they warm no prefix the replay will look up."""
        n = self.cfg.replay.warmup_requests
        if n <= 0:
            return
        first = list(itertools.islice(self.trace, n))
        records: list[RequestRecord] = []
        warm = Replayer(
            engine,
            [Scheduled(spec=spec, loop=-1, due_s=0.0) for spec in first],
            prompts,
            gate,
            SystemClock(),
            records.append,
            run_tag=self.run_id[-4:] + "w",
            max_pending=len(first),
            max_model_len=max_model_len,
            drain_timeout_s=self.cfg.engine.start_timeout,
            seed=self.cfg.run.seed,
            sessions="open",  # all at once: warm-up only needs the kernels compiled
        )
        self._replayer = warm  # so a stop signal during warm-up ends it
        t0 = time.monotonic()
        stats = await warm.run()
        took = time.monotonic() - t0
        writer.event(
            "warmup",
            f"{stats.completed} warm-up requests in {took:.1f} s",
            requests=len(records),
            failed=stats.failed,
            warmup_s=took,
        )

    def _make_forwarder(self, writer: SampleWriter) -> Forwarder | None:
        icfg = self.cfg.sinks.influx
        if not icfg.enabled:
            return None

        def on_event(kind: str, fields: dict[str, float | int | str]) -> None:
            writer.event(kind, f"InfluxDB {kind.removeprefix('sink_')}", **fields)

        if self._lines is None:
            return None
        return Forwarder(self.run_dir / SPOOL_DIR, self._lines, icfg.batch_lines, on_event=on_event)

    def _make_webhook(self, writer: SampleWriter) -> WebhookSink | None:
        if self._alerts is None:
            return None

        def on_event(kind: str, fields: dict[str, float | int | str]) -> None:
            writer.event(kind, f"alert webhook {kind.removeprefix('webhook_')}", **fields)

        return WebhookSink(self.run_dir / SPOOL_DIR, self._alerts, self.cfg.sinks.webhook, on_event=on_event)

    def _add_webhook_job(self, scheduler: AsyncIOScheduler, spool: Spool, webhook: WebhookSink) -> None:
        interval = self.cfg.sinks.webhook.interval

        async def alert() -> None:
            # As the InfluxDB job: most of one interval, so a backlog never makes the job skip a run.
            spool.flush(fsync=False)
            await webhook.tick(0.8 * interval)

        scheduler.add_job(alert, "interval", seconds=interval, id="webhook")

    def _engine_config(self) -> EngineConfig:
        """The engine configuration to start: the config's, with soakd's scheduler class when the batch
        policy moves vLLM's admission limit live (and the file it reads named in the environment, which
        the engine's processes inherit)."""
        cfg = self.cfg
        ecfg = cfg.engine
        for change in sorted(ecfg.changes, key=lambda c: c.at):
            if change.at <= self._offset_s:
                # A resumed run starts the engine as it was at the crash point.
                ecfg = apply_change(ecfg, change)
        batch = cfg.control.batch
        wants = (
            cfg.control.enabled and batch.enabled and batch.lever == "scheduler" and not cfg.control.dry_run
        )
        if wants and ecfg.kind != "openai" and not ecfg.scheduler_cls:
            os.environ[ACTIVE_SEQS_ENV] = str(self.run_dir / LIMIT_FILE)
            ecfg = ecfg.model_copy(update={"scheduler_cls": SCHEDULER_CLS})
        return ecfg

    def _make_controller(
        self,
        engine: EngineSupervisor,
        engine_collector: EngineCollector,
        drift: AcceptanceDrift,
        writer: SampleWriter,
    ) -> Controller | None:
        """The control loop, fed by the throttle watches, the replay and the engine's step stats."""
        ccfg = self.cfg.control
        if not ccfg.enabled:
            return None
        gpu_watch, host_watch = self._gpu_watch, self._host_watch
        throttled = input_throttled(
            ccfg.scope,
            gpu_watch.throttled if gpu_watch is not None else None,
            (lambda: host_watch.state is ThrottleState.THROTTLED) if host_watch is not None else None,
        )
        harm = input_harm(
            ccfg.scope,
            gpu_watch.harm if gpu_watch is not None else None,
            # A host's CPU throttle episode is thermal: sysfs counts only thermal throttling.
            (lambda: "thermal" if host_watch.state is ThrottleState.THROTTLED else "")
            if host_watch is not None
            else None,
        )

        def engine_info() -> EngineInfo | None:
            return engine.info if engine.alive() else None

        inputs = ControlInputs(
            throttled=throttled,
            output_tokens=lambda: self._replayer.stats.output_tokens if self._replayer is not None else 0,
            in_flight=lambda: self._replayer.pending if self._replayer is not None else 0,
            tokens_per_step=lambda: engine_collector.tokens_per_step,
            engine=engine_info,
            drifting=lambda: drift.drifting,
            harm=harm,
            waiting=lambda: self._replayer.waiting_admission if self._replayer is not None else 0,
            draining=lambda: self._replayer.draining if self._replayer is not None else False,
            energy_j=gpu_watch.energy_j if gpu_watch is not None else lambda: None,
            limited=gpu_watch.limited if gpu_watch is not None and ccfg.scope != "host" else lambda: False,
        )
        limit_file = self.run_dir / LIMIT_FILE if ccfg.batch.lever == "scheduler" else None
        actuator = Actuator(
            engine, writer.event, lever=ccfg.batch.lever, limit_file=limit_file, dry_run=ccfg.dry_run
        )
        crit = self.cfg.criteria
        slo = Slo(
            ttft_s=None if crit.ttft_p99_ms is False else crit.ttft_p99_ms / 1000.0,
            tpot_s=None if crit.tpot_p99_ms is False else crit.tpot_p99_ms / 1000.0,
        )
        return Controller(ccfg, self.cfg.replay.max_concurrency, inputs, actuator, self.run_dir, slo=slo)

    def _make_ceiling(self) -> CeilingTracker | None:
        """The decode-ceiling tracker: the local model's bytes and a bandwidth (configured, else NVML's
        theoretical figure for GPU 0). None, with the reason kept for the summary, when either is missing."""
        tcfg = self.cfg.telemetry
        path = Path(self.model)
        if self.cfg.engine.kind == "openai" or not is_model_dir(path):
            self._ceiling_reason = "no local model folder to read the weight bytes from"
            return None
        ecfg = self.cfg.engine
        try:
            # Dummy weights are the config's shapes, whatever safetensors lie beside it.
            load_format = effective_load_format(ecfg.load_format, ecfg.extra_args, self.model)
            model = model_bytes(path, load_format=load_format)
        except (OSError, ValueError, KeyError, TypeError) as err:
            self._ceiling_reason = f"model bytes unreadable: {err}"[:300]
            return None
        if tcfg.ceiling_bandwidth_gbs > 0:
            bandwidth = Bandwidth(tcfg.ceiling_bandwidth_gbs, "configured")
        elif tcfg.gpu_recording or "gpu" not in tcfg.collectors:
            self._ceiling_reason = (
                "no live GPU to read the bandwidth from: set telemetry.ceiling_bandwidth_gbs"
            )
            return None
        else:
            profiles, status = hardware_profiles(measure_copy=False, use_torch=False)
            best = profiles[0].best_bandwidth_gbs() if profiles else None
            if best is None:
                self._ceiling_reason = (
                    f"no GPU bandwidth ({status.get('reason') or 'NVML gave no bus width or memory clock'}): "
                    "set telemetry.ceiling_bandwidth_gbs"
                )
                return None
            bandwidth = Bandwidth(best[0], best[1])
        log.info(
            "decode_ceiling", bandwidth_gbs=bandwidth.gbs, source=bandwidth.source, weights=model.weight_bytes
        )
        return CeilingTracker(model, bandwidth)

    def _make_collectors(
        self, engine: Engine, engine_collector: EngineCollector, writer: SampleWriter
    ) -> list[Collector]:
        names = self.cfg.telemetry.collectors
        # The replay's own series is always on: it is how a run shows it kept up with the trace.
        out: list[Collector] = [
            ReplayCollector(lambda: self._replayer if self._progress_start is not None else None)
        ]
        if "host" in names:
            # The throttle detector over the CPUs' clocks, throttle counts and thermal margin: what a
            # CPU-only soak has instead of NVML.
            watch = HostThrottleWatch(writer.event)
            self._host_watch = watch
            out += [HostCollector(engine.process_ids, self.run_dir, on_read=watch.observe), watch]
        if "engine" in names:
            out.append(engine_collector)
        if "gpu" in names:
            out += self._make_gpu_collectors(engine, writer)
        return out

    def _make_gpu_collectors(self, engine: Engine, writer: SampleWriter) -> list[Collector]:
        """NVML (or a recording of it), the throttle detector fed by its fast tier, and (live) the
        listener for XID and ECC events."""
        tcfg = self.cfg.telemetry
        source: NvmlSource
        extra: list[Collector] = []
        cuda = ""
        if tcfg.gpu_recording:
            speed = tcfg.gpu_recording_speed

            def recorded_time() -> float:
                # The recording plays along with the replay: its first reading until the replay
                # starts (the engine's start-up is not what was recorded), then at `speed`.
                start = self._progress_start
                return 0.0 if start is None else (self._clock.monotonic() - start) * speed

            self._gpu_clock = recorded_time
            source = RecordedNvml(self.cfg.resolve(tcfg.gpu_recording), recorded_time)
        else:
            gpu = probe_nvml()
            if gpu.count == 0:
                # Said once, then the soak runs on with host and engine telemetry.
                log.warning("gpu_telemetry_off", reason=gpu.reason or "no GPU found")
                return []
            import pynvml

            source = LiveNvml(pynvml, pids=engine.process_ids)
            with contextlib.suppress(pynvml.NVMLError):
                version = int(pynvml.nvmlSystemGetCudaDriverVersion())  # 13000 for CUDA 13.0
                cuda = f"{version // 1000}.{version % 1000 // 10}"
            events = GpuEventListener(pynvml, range(source.gpu_count()), writer.event)
            events.start()
            self._gpu_events = events
            extra.append(events)
        self._gpu_meta = {
            "source": "recording" if tcfg.gpu_recording else "nvml",
            "driver": source.driver_version(),
            "cuda_driver": cuda,
            "devices": [source.static(i).to_dict() for i in range(source.gpu_count())],
        }
        h = self.cfg.control.harm
        watch = GpuThrottleWatch(
            {i: source.static(i).max_sm_mhz for i in range(source.gpu_count())},
            on_event=writer.event,
            harm=HarmSettings(
                window_s=h.window,
                power_loss=h.power_loss,
                thermal_loss=h.thermal_loss,
                enter_s=h.enter,
                leave_s=h.leave,
            ),
        )
        energy_every = max(1, round(tcfg.gpu_energy_interval / tcfg.gpu_slow_interval))
        self._nvml = NvmlCollector(source, on_fast=watch.observe, energy_every=energy_every)
        if self._ceiling is not None:
            # GPM's measured DRAM share beside the computed decode share, over the same busy intervals.
            self._ceiling.measured_dram_pct = self._nvml.gpm_dram_bw_pct
        self._gpu_watch = watch
        return [self._nvml, watch, *extra]

    def _make_scheduler(
        self,
        runner: CollectorRunner,
        spool: Spool,
        forwarder: Forwarder | None,
        engine: EngineSupervisor,
    ) -> AsyncIOScheduler:
        cfg = self.cfg
        scheduler = AsyncIOScheduler(
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30}
        )

        def on_job_event(event: JobEvent) -> None:
            if event.code in (EVENT_JOB_MISSED, EVENT_JOB_MAX_INSTANCES):
                # Missed, or skipped because the previous run still ran (a slow tier outlasting its
                # interval): either way a run that did not happen.
                self.scheduler_missed += 1
            else:
                self.scheduler_errors += 1
                log.error("job_failed", job=event.job_id, error=repr(getattr(event, "exception", None)))

        scheduler.add_listener(on_job_event, EVENT_JOB_MISSED | EVENT_JOB_ERROR | EVENT_JOB_MAX_INSTANCES)

        # Jobs are coroutines so they run on the event loop, never in APScheduler's thread pool.
        async def collect() -> None:
            runner.run_once()
            self._last_collect = time.monotonic()

        async def flush() -> None:
            spool.flush(fsync=True)
            if self._journal is not None:
                # With the spool: after a power loss the journal knows what the spool's records say.
                self._journal.sync()

        async def slow() -> None:
            # The GPU's slow tier has its own, faster job (gpu_slow).
            await runner.refresh(timeout_s=cfg.telemetry.slow_interval, exclude=frozenset({"gpu"}))

        async def check_abort() -> None:
            replayer, metrics = self._replayer, self._metrics
            if replayer is None or replayer.fatal or metrics is None or self._progress_start is None:
                return
            replayed = self._elapsed()
            if replayed < cfg.criteria.abort_grace:
                return
            gaps = self._interruptions()
            context = run_context(replayed, len(gaps), lost_in_flight(gaps))
            failed = first_abort(cfg.criteria, metrics, context)
            if failed is None:
                return
            reason = f"criterion failed: {failed.expr} (measured {failed.value:.4g})"
            if self._emit is not None:
                self._emit("criteria_abort", reason, value=float(failed.value or 0.0), replayed_s=replayed)
            replayer.fail(reason)

        async def check_engine() -> None:
            engine.check()
            if not engine.alive() and self._replayer is not None and not self._replayer.fatal:
                self._replayer.fail("engine: no engine left to replay on")

        nvml = self._nvml
        if nvml is not None:

            def gpu_fast() -> None:
                nvml.sample_fast(self._gpu_clock())

            async def gpu_slow() -> None:
                try:
                    await nvml.refresh()
                # Same containment as the collector runner: one failed slow read is logged and the
                # soak goes on (the counters' next delta still covers the time).
                except Exception as err:  # noqa: BLE001
                    log.warning("gpu_slow_read_failed", error=f"{type(err).__name__}: {err}"[:200])

            # The 10 Hz tier on a plain loop timer: an APScheduler job per sample costs more than the sample.
            self._tickers.append(Ticker("gpu_fast", cfg.telemetry.gpu_fast_interval, gpu_fast))
            scheduler.add_job(gpu_slow, "interval", seconds=cfg.telemetry.gpu_slow_interval, id="gpu_slow")
        scheduler.add_job(collect, "interval", seconds=cfg.telemetry.interval, id="collect")

        async def control() -> None:
            # The controller exists from the start; it acts only once the replay has begun.
            if self._controller is not None:
                await self._controller.tick()

        if cfg.control.enabled:
            scheduler.add_job(control, "interval", seconds=cfg.control.interval, id="control")
        scheduler.add_job(slow, "interval", seconds=cfg.telemetry.slow_interval, id="slow")
        scheduler.add_job(check_engine, "interval", seconds=1.0, id="engine_check")
        if cfg.criteria.abort_on:
            scheduler.add_job(check_abort, "interval", seconds=5.0, id="abort_check")
        scheduler.add_job(flush, "interval", seconds=cfg.sinks.spool.fsync_interval, id="spool_flush")
        if forwarder is not None:

            async def ship() -> None:
                # Ship for most of one interval, then yield to the next tick: a backlog after an outage
                # drains at the database's pace without the job outliving its interval (a skipped run).
                spool.flush(fsync=False)
                budget = time.monotonic() + 0.8 * cfg.sinks.influx.interval
                while await forwarder.step() > 0 and time.monotonic() < budget:
                    pass

            scheduler.add_job(ship, "interval", seconds=cfg.sinks.influx.interval, id="forward")
        if self._progress is not None:
            scheduler.add_job(self._tick_progress, "interval", seconds=1.0, id="progress")
        scheduler.add_job(self._status, "interval", seconds=10.0, id="status")
        scheduler.add_job(self._snapshot, "interval", seconds=cfg.run.snapshot_interval, id="snapshot")
        scheduler.add_job(
            self._checkpoint_job, "interval", seconds=cfg.run.checkpoint_interval, id="checkpoint"
        )
        wd = watchdog_interval_s()
        if wd is not None:
            scheduler.add_job(self._watchdog, "interval", seconds=wd, id="watchdog")
        return scheduler

    def healthy(self) -> tuple[bool, str]:
        """Whether the main loop is doing its work: the loop runs (else this is not called at all) and
        the collection cycle ran within a few intervals (a wedged job or a stuck collector stops it)."""
        # One and a half ping intervals (a slow cycle is not a hang; a stall is caught well within
        # WatchdogSec), and never below three collection intervals.
        wd = watchdog_interval_s()
        limit = max(3 * self.cfg.telemetry.interval, 1.5 * wd if wd is not None else 10.0)
        age = time.monotonic() - self._last_collect
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
        if self._replayer is None or self._progress_start is None:
            return
        doc: dict[str, Any] = {
            "run_id": self.run_id,
            "elapsed_s": self._elapsed(),
            "replay": asdict(self._replayer.stats),
            "points": dict(self._writer_counts or {}),
        }
        if self._controller is not None:
            doc["control"] = self._controller.summary()
        if self._gpu_watch is not None:
            doc["gpu_throttle"] = self._gpu_watch.summary()
        if self._ceiling is not None:
            doc["decode_ceiling"] = self._ceiling.summary()
        write_json_atomic(self.run_dir / SNAPSHOT_FILE, doc)

    async def _status(self) -> None:
        """systemd's STATUS line: what `systemctl status soakd` shows a person mid-run."""
        if self._replayer is None or self._progress_start is None:
            return
        st = self._replayer.stats
        elapsed = self._elapsed()
        pct = min(100.0, 100.0 * elapsed / self.cfg.run.duration)
        notify(
            f"STATUS=replaying {pct:.0f}% ({elapsed:.0f}/{self.cfg.run.duration:.0f} s): "
            f"{st.completed} done, {st.failed} failed, {st.shed} shed, {self._replayer.pending} in flight"
            + (f", ceiling {self._controller.batch.limit}" if self._controller is not None else "")
        )

    async def _tick_progress(self) -> None:
        if self._progress is None or self._replayer is None:
            return
        self._progress(self._elapsed(), self.cfg.run.duration, self._replayer.stats)
