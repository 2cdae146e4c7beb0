"""The collector registry (node_exporter's pattern): `register(name, factory)`, where `name` is what
`telemetry.collectors` lists. A factory gets the build context and returns collectors; `at="engine"`
factories run once the engine is up, and only when it offers `signal`. A new collector is one module
plus one `register` line here (and its name in config's `CollectorName`, the schema users see; a test
keeps the two in step).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog

from soakd.collectors.allocator import AllocatorCollector
from soakd.collectors.base import Collector
from soakd.collectors.ceiling import CeilingTracker
from soakd.collectors.engine import EngineCollector
from soakd.collectors.engine_gpus import for_config
from soakd.collectors.gpu import probe_nvml
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.host import HostCollector
from soakd.collectors.host_throttle import HostThrottleWatch
from soakd.collectors.nvml import LiveNvml, NvmlCollector, NvmlSource, RecordedNvml
from soakd.collectors.nvml_events import GpuEventListener
from soakd.collectors.prom import MetricsScraper
from soakd.collectors.spec import SpecProfile
from soakd.config import Config
from soakd.engine.base import EngineInfo
from soakd.engine.sender import sender_pids
from soakd.engine.supervisor import EngineSupervisor
from soakd.live import LiveRun
from soakd.policies.throttle import HarmSettings
from soakd.sinks.writer import SampleWriter
from soakd.ticker import Ticker

log = structlog.get_logger(__name__)


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
    return [
        HostCollector(b.engine.process_ids, b.run_dir, on_read=watch.observe, helper_pids=sender_pids),
        watch,
    ]


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
            # meta.json says so, and the report then says why it shows no GPU.
            b.gpu_meta = {"source": "none", "reason": gpu.reason or "no GPU found", "devices": []}
            return []
        import pynvml

        source = LiveNvml(pynvml, pids=b.engine.process_ids)
        with contextlib.suppress(pynvml.NVMLError):
            version = int(pynvml.nvmlSystemGetCudaDriverVersion())  # 13000 for CUDA 13.0
            cuda = f"{version // 1000}.{version % 1000 // 10}"
        extra.append(GpuEventListener(pynvml, range(source.gpu_count()), b.writer.event))
    devices = [source.static(i) for i in range(source.gpu_count())]
    # Every GPU is recorded; the engine's are judged (a GPU beside it, busy with other work, is not its harm).
    mine = for_config(b.cfg, [d.uuid for d in devices], os.environ)
    judged = list(mine.gpus) if mine is not None else list(range(len(devices)))
    groups: dict[str, tuple[int, ...]] = {}
    if mine is not None and mine.known:
        groups = {str(r): g for r, g in enumerate(mine.replicas) if len(g) >= 2}
        if len(mine.replicas) >= 2:
            groups["all"] = mine.gpus
    b.gpu_meta = {
        "source": "recording" if tcfg.gpu_recording else "nvml",
        "driver": source.driver_version(),
        "cuda_driver": cuda,
        "devices": [d.to_dict() for d in devices],
        "engine": mine.to_dict()
        if mine is not None
        else {"gpus": judged, "known": False, "found_by": "engine elsewhere"},
    }
    watch = GpuThrottleWatch(
        {i: devices[i].max_sm_mhz for i in judged},
        on_event=b.writer.event,
        harm=HarmSettings.from_config(b.cfg.control.harm),
        groups=groups,
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
