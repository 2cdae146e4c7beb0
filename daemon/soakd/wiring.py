"""Build a run's parts from its Config: the model, the engine, the sinks, the controller; the
collectors through their registry (soakd.collectors.registry)."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import structlog

from soakd.collectors.base import Collector
from soakd.collectors.ceiling import Bandwidth, CeilingTracker
from soakd.collectors.engine import EngineCollector
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.host_throttle import HostThrottleWatch
from soakd.collectors.registry import Build, build_collectors, find
from soakd.collectors.replay import ReplayCollector
from soakd.collectors.runner import CollectorRunner
from soakd.collectors.spec import AcceptanceDrift, DriftSettings, SpecProfile
from soakd.config import Config, EngineConfig
from soakd.control import ControlInputs, Controller, Slo, input_harm, input_throttled
from soakd.engine.base import Engine, EngineInfo
from soakd.engine.live_limit import name_limit_file
from soakd.engine.supervisor import EngineSupervisor, apply_change
from soakd.errors import ConfigError, EngineError
from soakd.jobs import JobHealth, Jobs, ProgressFn
from soakd.lifecycle import Component, Stack
from soakd.live import LiveRun
from soakd.loopwatch import LoopWatch
from soakd.metric import FieldValue
from soakd.parts import EnginePart, collectors_part, controller_part
from soakd.policies.actuator import Actuator
from soakd.policies.lever import Lever
from soakd.policies.throttle import ThrottleState
from soakd.probe import hardware_profiles, model_bytes
from soakd.redact import redact_url
from soakd.replay_part import ReplayPart
from soakd.resume import DueJournal, ResumeState
from soakd.rundir import SPOOL_DIR
from soakd.shapes import effective_load_format
from soakd.sinks.health import SpoolHealth
from soakd.sinks.parts import SpoolPart
from soakd.sinks.registry import BuiltSink, Opened
from soakd.sinks.spool import Spool
from soakd.sinks.writer import SampleWriter
from soakd.tinymodel import is_model_dir
from soakd.traces.loader import Trace

log = structlog.get_logger(__name__)

# A Hugging Face repository id as vLLM takes it: ORG/NAME, one slash, no path syntax around it.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model(cfg: Config) -> str:
    """The model vLLM loads: a local folder, or a hub id (`hf:NAME`, or a bare ORG/NAME when no such
    local folder exists: a local folder wins) passed through as vLLM takes it.

    For `engine.kind = "openai"` the server has its model already: the URL is what must be given, and
    its authentication one way only (check_engine_auth, against the process environment).
    """
    check_sender_reader(cfg)
    if cfg.engine.kind == "openai":
        if not cfg.engine.url:
            raise ConfigError(
                'engine.kind = "openai" needs the server\'s base URL', file=cfg.source, key="engine.url"
            )
        check_engine_auth(cfg, os.environ)
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


def check_sender_reader(cfg: Config) -> None:
    """The native stream reader asked for (`engine.sender_reader = "native"`) where it did not build:
    bad input, refused before the run starts ("auto" would read in Python)."""
    from soakd.engine.native import UNAVAILABLE

    if cfg.engine.sender_reader == "native" and UNAVAILABLE:
        raise ConfigError(
            f'the native stream reader is {UNAVAILABLE}: set "auto" or "python"',
            file=cfg.source,
            key="engine.sender_reader",
        )


def check_engine_auth(cfg: Config, env: Mapping[str, str]) -> None:
    """One way to authenticate to an OpenAI-compatible server: credentials in the URL
    (`http://user:password@host`, HTTP basic auth) or an API key (the variable `engine.api_key_env`
    names, a bearer token), never both. Both given is bad input, refused before the run starts: which
    one the server expects is not soakd's to guess. The variable only counts when set and non-empty
    (`api_key_env` has a default name); neither secret is ever shown."""
    name = cfg.engine.api_key_env
    if not name or not env.get(name, ""):
        return
    try:
        userinfo = "@" in urlsplit(cfg.engine.url).netloc
    except ValueError:
        return  # an unparsable URL is refused where it is used, in words of its own
    if userinfo:
        raise ConfigError(
            f"credentials in the URL ({redact_url(cfg.engine.url)}) and an API key in ${name} (engine."
            "api_key_env): give one (user:password in the URL for basic auth, or the key for a bearer token)",
            file=cfg.source,
            key="engine.url",
        )


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

    return VllmLocalEngine(cfg.engine, model, collector.push, log_dir)


def check_writable(out_dir: Path, source: str) -> None:
    """Fail at start, as bad input, when runs cannot be written (not hours later)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot create {out_dir}: {err.strerror}", file=source, key="run.output_dir"
        ) from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{out_dir} is not writable", file=source, key="run.output_dir")


def engine_config(cfg: Config, lever: Lever, offset_s: float) -> EngineConfig:
    """The engine configuration to start: the config's as it was `offset_s` into the replay (a resumed
    run starts the engine as it was at the crash point), with the scheduler class the run's lever needs
    (policies/lever.py decides it: soakd's for the scheduler lever, advice-only runs included)."""
    ecfg = cfg.engine
    for change in sorted(ecfg.changes, key=lambda c: c.at):
        if change.at <= offset_s:
            ecfg = apply_change(ecfg, change)
    if lever.scheduler_cls:
        ecfg = ecfg.model_copy(update={"scheduler_cls": lever.scheduler_cls})
    return ecfg


def make_drift(cfg: Config, writer: SampleWriter) -> AcceptanceDrift:
    dcfg = cfg.telemetry.spec_drift
    return AcceptanceDrift(
        DriftSettings.from_config(dcfg),
        on_event=writer.event,
    )


def make_ceiling(cfg: Config, model: str) -> tuple[CeilingTracker | None, str]:
    """The decode-ceiling tracker: the local model's bytes and a bandwidth (configured, else NVML's
    theoretical figure for GPU 0); or None with the reason, for the summary, when either is missing."""
    tcfg = cfg.telemetry
    path = Path(model)
    if cfg.engine.kind == "openai" or not is_model_dir(path):
        return None, "no local model folder to read the weight bytes from"
    ecfg = cfg.engine
    if ecfg.gpus_needed > 1:
        # One GPU's bandwidth against the whole model's bytes: neither split (tensor) nor summed (data)
        # parallelism is modelled, and a wrong ceiling is worse than none.
        return None, "a parallel engine: the decode ceiling is modelled for one GPU only"
    try:
        # Dummy weights are the config's shapes, whatever safetensors lie beside it.
        load_format = effective_load_format(ecfg.load_format, ecfg.extra_args, model)
        weights = model_bytes(path, load_format=load_format)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"model bytes unreadable: {err}"[:300]
    if tcfg.ceiling_bandwidth_gbs > 0:
        bandwidth = Bandwidth(tcfg.ceiling_bandwidth_gbs, "configured")
    elif tcfg.gpu_recording or "gpu" not in tcfg.collectors:
        return None, "no live GPU to read the bandwidth from: set telemetry.ceiling_bandwidth_gbs"
    else:
        profiles, status = hardware_profiles(measure_copy=False, use_torch=False)
        best = profiles[0].best_bandwidth_gbs() if profiles else None
        if best is None:
            why = status.get("reason") or "NVML gave no bus width or memory clock"
            return None, f"no GPU bandwidth ({why}): set telemetry.ceiling_bandwidth_gbs"
        bandwidth = Bandwidth(best[0], best[1])
    log.info(
        "decode_ceiling", bandwidth_gbs=bandwidth.gbs, source=bandwidth.source, weights=weights.weight_bytes
    )
    return CeilingTracker(weights, bandwidth), ""


def make_controller(
    cfg: Config,
    run_dir: Path,
    lever: Lever,
    engine: EngineSupervisor,
    collectors: Sequence[Collector],
    engine_collector: EngineCollector,
    drift: AcceptanceDrift,
    live: LiveRun,
    writer: SampleWriter,
) -> Controller | None:
    """The control loop, fed by the throttle watches, the replay and the engine's step stats."""
    ccfg = cfg.control
    if not ccfg.enabled:
        return None
    gpu_watch, host_watch = find(collectors, GpuThrottleWatch), find(collectors, HostThrottleWatch)
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

    def fading() -> bool:
        # The GPUs' harm in its tail, and no harm from the host's CPUs now (which has no tail).
        if gpu_watch is None or ccfg.scope == "host":
            return False
        host_now = host_watch is not None and host_watch.state is ThrottleState.THROTTLED
        return gpu_watch.harm_fading() and not (ccfg.scope != "gpu" and host_now)

    def engine_info() -> EngineInfo | None:
        # Alive but between engines (a restart or rebuild under way): none to act on this tick.
        try:
            return engine.info if engine.alive() else None
        except EngineError:
            return None

    inputs = ControlInputs(
        throttled=throttled,
        output_tokens=lambda: live.replayer.stats.output_tokens if live.replayer is not None else 0,
        in_flight=lambda: live.replayer.pending if live.replayer is not None else 0,
        tokens_per_step=lambda: engine_collector.tokens_per_step,
        engine=engine_info,
        drifting=lambda: drift.drifting,
        harm=harm,
        harm_source=gpu_watch.harm_source
        if gpu_watch is not None and ccfg.scope != "host"
        else lambda _k: "",
        harm_fading=fading,
        waiting=lambda: live.replayer.waiting_admission if live.replayer is not None else 0,
        head_wait=lambda: live.replayer.head_wait_s() if live.replayer is not None else 0.0,
        draining=lambda: live.replayer.draining if live.replayer is not None else False,
        prompt_tokens_computed=lambda: engine_collector.prompt_computed_total,
        energy_j=gpu_watch.energy_j if gpu_watch is not None else lambda: None,
        energy_s=gpu_watch.energy_s if gpu_watch is not None else lambda: None,
        limited=gpu_watch.limited if gpu_watch is not None and ccfg.scope != "host" else lambda: False,
        shared=gpu_watch.shared if gpu_watch is not None and ccfg.scope != "host" else lambda: None,
    )
    if lever.note:
        log.warning("scheduler_lever_unavailable", reason=lever.note)
    actuator = Actuator(engine, writer.event, lever=lever, dry_run=ccfg.dry_run)
    crit = cfg.criteria
    slo = Slo(
        ttft_s=None if crit.ttft_p99_ms is False else crit.ttft_p99_ms / 1000.0,
        tpot_s=None if crit.tpot_p99_ms is False else crit.tpot_p99_ms / 1000.0,
    )
    return Controller(ccfg, cfg.replay.max_concurrency, inputs, actuator, run_dir, slo=slo)


@dataclass(slots=True)
class Sinks:
    spool: Spool
    writer: SampleWriter
    shipping: list[BuiltSink]
    """The configured sinks that ship from the spool (soakd.sinks.registry)."""
    health: list[Collector]
    """The spool's and the sinks' health collectors, run with the others."""
    stack: Stack
    """The outer stack: stopped after the verdict is written (the sinks in reverse, then the spool)."""


def build_sinks(
    cfg: Config,
    run_dir: Path,
    tags: dict[str, str],
    live: LiveRun,
    resumed: ResumeState | None,
    opened: Opened,
) -> Sinks:
    """The spool every sample goes to first, the writer in front of it (adding the run's `tags`, folding
    the verdict's metrics), and the configured sinks that ship from it."""
    scfg = cfg.sinks.spool
    spool = Spool(
        run_dir / SPOOL_DIR,
        scfg.segment_bytes,
        scfg.fsync_interval,
        max_bytes=scfg.max_bytes,
        min_free_bytes=scfg.min_free_bytes,
    )
    writer = SampleWriter(
        spool,
        tags,
        after_ns=resumed.last_point_ns if resumed is not None else 0,
        observe=live.metrics.add,
    )
    if resumed is not None:
        writer.counts.update(resumed.points)

    def on_spool(kind: str, fields: dict[str, FieldValue]) -> None:
        what = "degraded" if kind == "spool_degraded" else "recovered"
        text = f"spool {what}: {fields.get('state', '')} {fields.get('reason', '')}".strip()
        writer.event(kind, text, **fields)

    spool.on_event = on_spool
    spool.background_fsync = True  # the scheduler's flush job fsyncs it in a worker thread
    shipping = opened.build(cfg, run_dir, writer)
    health: list[Collector] = [SpoolHealth(spool), *(s.health for s in shipping)]
    parts: list[Component] = [SpoolPart(spool), *(s.part for s in shipping)]
    return Sinks(spool, writer, shipping, health, Stack("sinks", parts))


@dataclass(slots=True)
class RunParts:
    """What the run's own code reads of the built parts (the rest is reached through the stack)."""

    build: Build
    runner: CollectorRunner
    controller: Controller | None
    jobs: Jobs
    engine_part: EnginePart
    replay: ReplayPart
    stack: Stack
    """The run stack: collectors, engine, scheduler, controller, replay; started in order (the engine's
    start and the warm-up among them), stopped in reverse when the replay ends."""


EngineFactory = Callable[[Config, str, EngineCollector], Engine]


@dataclass(frozen=True, slots=True)
class RunInputs:
    """What the run stack is built from besides the config and the sinks."""

    run_dir: Path
    run_tag: str
    """Salts the replay's prompts (the warm-up's salt adds a "w")."""
    model: str
    trace: Trace
    lever: Lever
    ecfg: EngineConfig
    """The engine configuration to start (engine_config)."""
    engine_factory: EngineFactory
    on_engines: Callable[[list[EngineInfo]], None]
    journal: DueJournal | None
    resumed: ResumeState | None
    began: float
    """When the run began (time.monotonic), for the resume's log line."""
    progress: ProgressFn | None = None


def build_run(cfg: Config, live: LiveRun, sinks: Sinks, run: RunInputs) -> RunParts:
    """The run stack's parts: collectors (from the registry), engine, scheduler, controller, replay."""
    writer, run_dir, model = sinks.writer, run.run_dir, run.model
    drift = make_drift(cfg, writer)
    engine_collector = EngineCollector(active=False, drift=drift)
    ceiling, ceiling_reason = make_ceiling(cfg, model)
    engine_collector.ceiling = ceiling
    profile = SpecProfile()

    def build_engine(engine_cfg: EngineConfig) -> Engine:
        return run.engine_factory(cfg.model_copy(update={"engine": engine_cfg}), model, engine_collector)

    def on_started(info: EngineInfo) -> None:
        engine_part.engine_started(info)

    # The engine's processes inherit the environment: soakd's scheduler class finds its file there.
    name_limit_file(run.lever.limit_file)
    engine = EngineSupervisor(build_engine, run.ecfg, on_event=writer.event, on_started=on_started)
    b = Build(cfg, run_dir, writer, engine, live, engine_collector, profile, ceiling)
    # The replay's own series is always on: it is how a run shows it kept up with the trace.
    collectors: list[Collector] = [ReplayCollector(live.soak_replayer), *build_collectors(b, "start")]
    loopwatch = LoopWatch(writer.event, active=lambda: live.replaying and engine.ready)
    runner = CollectorRunner([*collectors, loopwatch, *sinks.health], writer)
    engine_part = EnginePart(engine, b, drift, runner, run.on_engines)
    controller = make_controller(
        cfg, run_dir, run.lever, engine, collectors, engine_collector, drift, live, writer
    )
    jobs = Jobs(
        cfg,
        run_dir,
        live,
        runner,
        writer,
        sinks.spool,
        engine,
        journal=run.journal,
        shipping=sinks.shipping,
        controller=controller,
        tickers=[*b.tickers, loopwatch.ticker],
        gpu_watch=find(collectors, GpuThrottleWatch),
        ceiling=ceiling,
        progress=run.progress,
    )
    runner.add(JobHealth(jobs))
    replay = ReplayPart(
        cfg,
        run.trace,
        b,
        engine_part,
        runner,
        controller,
        run_tag=run.run_tag,
        journal=run.journal,
        resumed=run.resumed,
        began=run.began,
    )
    parts: list[Component] = [
        collectors_part(runner, ceiling, ceiling_reason),
        engine_part,
        jobs,
        controller_part(controller, live),
        replay,
    ]
    return RunParts(b, runner, controller, jobs, engine_part, replay, Stack("run", parts))
