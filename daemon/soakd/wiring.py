"""Build a run's parts from its Config: the one module that names concrete classes.

Collectors are chosen through a registry (node_exporter's pattern): `register(name, factory)` where
`name` is what `telemetry.collectors` lists. A factory gets the build context and returns collectors;
`at="engine"` factories run once the engine is up, and only when it offers `signal`. A new collector is
one module plus one `register` line here (and its name in config's `CollectorName`, the schema users
see; a test keeps the two in step).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog

from soakd.collectors.allocator import AllocatorCollector
from soakd.collectors.base import Collector
from soakd.collectors.ceiling import Bandwidth, CeilingTracker
from soakd.collectors.engine import EngineCollector
from soakd.collectors.gpu import probe_nvml
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.host import HostCollector
from soakd.collectors.host_throttle import HostThrottleWatch
from soakd.collectors.nvml import LiveNvml, NvmlCollector, NvmlSource, RecordedNvml
from soakd.collectors.nvml_events import GpuEventListener
from soakd.collectors.prom import MetricsScraper
from soakd.collectors.spec import AcceptanceDrift, DriftSettings, SpecProfile
from soakd.config import Config, EngineConfig
from soakd.control import ControlInputs, Controller, Slo, input_harm, input_throttled
from soakd.engine.base import ACTIVE_SEQS_ENV, Engine, EngineInfo
from soakd.engine.supervisor import EngineSupervisor, apply_change
from soakd.engine.vllm_local import SCHEDULER_CLS
from soakd.errors import ConfigError
from soakd.live import LiveRun
from soakd.policies.actuator import Actuator
from soakd.policies.throttle import HarmSettings, ThrottleState
from soakd.probe import hardware_profiles, model_bytes
from soakd.rundir import LIMIT_FILE, SPOOL_DIR
from soakd.shapes import effective_load_format
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.influx import LineWriter
from soakd.sinks.webhook import WebhookSender, WebhookSink
from soakd.sinks.writer import SampleWriter
from soakd.ticker import Ticker
from soakd.tinymodel import is_model_dir

log = structlog.get_logger(__name__)

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


def engine_config(cfg: Config, run_dir: Path, offset_s: float) -> EngineConfig:
    """The engine configuration to start: the config's as it was `offset_s` into the replay (a resumed
    run starts the engine as it was at the crash point), with soakd's scheduler class when the batch
    policy moves vLLM's admission limit live (and the file it reads named in the environment, which the
    engine's processes inherit)."""
    ecfg = cfg.engine
    for change in sorted(ecfg.changes, key=lambda c: c.at):
        if change.at <= offset_s:
            ecfg = apply_change(ecfg, change)
    batch = cfg.control.batch
    wants = cfg.control.enabled and batch.enabled and batch.lever == "scheduler" and not cfg.control.dry_run
    if wants and ecfg.kind != "openai" and not ecfg.scheduler_cls:
        os.environ[ACTIVE_SEQS_ENV] = str(run_dir / LIMIT_FILE)
        ecfg = ecfg.model_copy(update={"scheduler_cls": SCHEDULER_CLS})
    return ecfg


# -- the collector registry ---------------------------------------------------------------------------


@dataclass(slots=True)
class Build:
    """What a collector factory may read, and the few things the GPU's factory hands back."""

    cfg: Config
    run_dir: Path
    writer: SampleWriter
    engine: EngineSupervisor
    live: LiveRun
    engine_collector: EngineCollector
    profile: SpecProfile
    ceiling: CeilingTracker | None
    info: EngineInfo | None = None
    """The started engine, for `at="engine"` factories."""
    tickers: list[Ticker] = field(default_factory=list)
    """Fixed-rate samplers beside the scheduler (the GPU's fast tier)."""
    gpu_meta: dict[str, Any] | None = None
    """Driver, CUDA version and each GPU's static facts, for meta.json."""


Factory = Callable[[Build], Sequence[Collector]]


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    factory: Factory
    at: Literal["start", "engine"]
    signal: str | None


REGISTRY: list[Entry] = []


def register(
    name: str, factory: Factory, *, at: Literal["start", "engine"] = "start", signal: str | None = None
) -> None:
    """Add a collector factory under the `telemetry.collectors` name that turns it on."""
    REGISTRY.append(Entry(name, factory, at, signal))


def _host(b: Build) -> Sequence[Collector]:
    # The throttle detector over the CPUs' clocks, throttle counts and thermal margin: what a CPU-only
    # soak has instead of NVML.
    watch = HostThrottleWatch(b.writer.event)
    return [HostCollector(b.engine.process_ids, b.run_dir, on_read=watch.observe), watch]


def _gpu(b: Build) -> Sequence[Collector]:
    """NVML (or a recording of it), the throttle detector fed by its fast tier, and (live) the listener
    for XID and ECC events."""
    tcfg = b.cfg.telemetry
    source: NvmlSource
    extra: list[Collector] = []
    cuda = ""
    gpu_time: Callable[[], float] = time.monotonic
    if tcfg.gpu_recording:
        speed, live = tcfg.gpu_recording_speed, b.live

        def recorded_time() -> float:
            # The recording plays along with the replay: its first reading until the replay starts
            # (the engine's start-up is not what was recorded), then at `speed`.
            start = live.replay_start
            return 0.0 if start is None else (live.clock.monotonic() - start) * speed

        gpu_time = recorded_time
        source = RecordedNvml(b.cfg.resolve(tcfg.gpu_recording), recorded_time)
    else:
        gpu = probe_nvml()
        if gpu.count == 0:
            # Said once, then the soak runs on with host and engine telemetry.
            log.warning("gpu_telemetry_off", reason=gpu.reason or "no GPU found")
            return []
        import pynvml

        source = LiveNvml(pynvml, pids=b.engine.process_ids)
        with contextlib.suppress(pynvml.NVMLError):
            version = int(pynvml.nvmlSystemGetCudaDriverVersion())  # 13000 for CUDA 13.0
            cuda = f"{version // 1000}.{version % 1000 // 10}"
        extra.append(GpuEventListener(pynvml, range(source.gpu_count()), b.writer.event))
    b.gpu_meta = {
        "source": "recording" if tcfg.gpu_recording else "nvml",
        "driver": source.driver_version(),
        "cuda_driver": cuda,
        "devices": [source.static(i).to_dict() for i in range(source.gpu_count())],
    }
    h = b.cfg.control.harm
    watch = GpuThrottleWatch(
        {i: source.static(i).max_sm_mhz for i in range(source.gpu_count())},
        on_event=b.writer.event,
        harm=HarmSettings(
            window_s=h.window,
            power_loss=h.power_loss,
            thermal_loss=h.thermal_loss,
            enter_s=h.enter,
            leave_s=h.leave,
        ),
    )
    energy_every = max(1, round(tcfg.gpu_energy_interval / tcfg.gpu_slow_interval))
    nvml = NvmlCollector(source, on_fast=watch.observe, energy_every=energy_every)
    if b.ceiling is not None:
        # GPM's measured DRAM share beside the computed decode share, over the same busy intervals.
        b.ceiling.measured_dram_pct = nvml.gpm_dram_bw_pct
    # The 10 Hz tier on a plain loop timer: an APScheduler job per sample costs more than the sample.
    b.tickers.append(Ticker("gpu_fast", tcfg.gpu_fast_interval, lambda: nvml.sample_fast(gpu_time())))
    return [nvml, watch, *extra]


def _allocator(b: Build) -> Sequence[Collector]:
    assert b.info is not None
    return [AllocatorCollector(b.engine.memory_stats, config_id=b.info.config_id)]


def _metrics(b: Build) -> Sequence[Collector]:
    assert b.info is not None
    per_step = "per_step" in b.info.signals
    return [MetricsScraper(b.engine.metrics_text, per_step=per_step, config_id=b.info.config_id)]


register("host", _host)
register("engine", lambda b: [b.engine_collector])
register("gpu", _gpu)
register("engine", lambda b: [b.profile], at="engine")
register("allocator", _allocator, at="engine", signal="allocator")
register("metrics", _metrics, at="engine", signal="metrics")


def build_collectors(b: Build, at: Literal["start", "engine"]) -> list[Collector]:
    """The collectors `telemetry.collectors` turns on, for the start or for a started engine."""
    names = b.cfg.telemetry.collectors
    out: list[Collector] = []
    for entry in REGISTRY:
        if entry.at != at or entry.name not in names:
            continue
        if entry.signal is not None and (b.info is None or entry.signal not in b.info.signals):
            continue
        out.extend(entry.factory(b))
    return out


C = TypeVar("C")


def find(collectors: Sequence[object], kind: type[C]) -> C | None:
    """The one collector of a kind among those built (a watch the controller reads), or None."""
    return next((c for c in collectors if isinstance(c, kind)), None)


def each(collectors: Sequence[object], kind: type[C]) -> Iterator[C]:
    return (c for c in collectors if isinstance(c, kind))


def make_drift(cfg: Config, writer: SampleWriter) -> AcceptanceDrift:
    dcfg = cfg.telemetry.spec_drift
    return AcceptanceDrift(
        DriftSettings(dcfg.baseline, dcfg.window, dcfg.threshold, dcfg.min_draft_tokens),
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

    def engine_info() -> EngineInfo | None:
        return engine.info if engine.alive() else None

    inputs = ControlInputs(
        throttled=throttled,
        output_tokens=lambda: live.replayer.stats.output_tokens if live.replayer is not None else 0,
        in_flight=lambda: live.replayer.pending if live.replayer is not None else 0,
        tokens_per_step=lambda: engine_collector.tokens_per_step,
        engine=engine_info,
        drifting=lambda: drift.drifting,
        harm=harm,
        waiting=lambda: live.replayer.waiting_admission if live.replayer is not None else 0,
        draining=lambda: live.replayer.draining if live.replayer is not None else False,
        energy_j=gpu_watch.energy_j if gpu_watch is not None else lambda: None,
        limited=gpu_watch.limited if gpu_watch is not None and ccfg.scope != "host" else lambda: False,
    )
    limit_file = run_dir / LIMIT_FILE if ccfg.batch.lever == "scheduler" else None
    actuator = Actuator(
        engine, writer.event, lever=ccfg.batch.lever, limit_file=limit_file, dry_run=ccfg.dry_run
    )
    crit = cfg.criteria
    slo = Slo(
        ttft_s=None if crit.ttft_p99_ms is False else crit.ttft_p99_ms / 1000.0,
        tpot_s=None if crit.tpot_p99_ms is False else crit.tpot_p99_ms / 1000.0,
    )
    return Controller(ccfg, cfg.replay.max_concurrency, inputs, actuator, run_dir, slo=slo)


def make_forwarder(
    cfg: Config, run_dir: Path, lines: LineWriter | None, writer: SampleWriter
) -> Forwarder | None:
    if lines is None or not cfg.sinks.influx.enabled:
        return None

    def on_event(kind: str, fields: dict[str, float | int | str]) -> None:
        writer.event(kind, f"InfluxDB {kind.removeprefix('sink_')}", **fields)

    return Forwarder(run_dir / SPOOL_DIR, lines, cfg.sinks.influx.batch_lines, on_event=on_event)


def make_webhook(
    cfg: Config, run_dir: Path, sender: WebhookSender | None, writer: SampleWriter
) -> WebhookSink | None:
    if sender is None:
        return None

    def on_event(kind: str, fields: dict[str, float | int | str]) -> None:
        writer.event(kind, f"alert webhook {kind.removeprefix('webhook_')}", **fields)

    return WebhookSink(run_dir / SPOOL_DIR, sender, cfg.sinks.webhook, on_event=on_event)
