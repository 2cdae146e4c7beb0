"""Fakes for tests of soakd and of code built on it: clocks that tests move by hand, an HTTP app served on
a free loopback port, an in-process engine that streams tokens (StubEngine) with a config for a short
soak over it (stub_config), a fake pynvml module (FakeNvml), a run folder rebuilt from a recorded
run's files (recorded_run_dir), a child process whose peak RSS is read (measured, PeakRss), and the
least time of a few calls (least_time), for costs compared with a reference timed alongside. (The
replay's virtual-time clock, which wakes sleepers in order, is soakd.clock.FakeClock.)

This module may import any other soakd module (it sits in the top layer of the import graph); nothing in
the package imports it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

from aiohttp import web

from soakd.collectors.engine import EngineCollector
from soakd.config import Config, load
from soakd.engine.base import EngineInfo, GenerationRequest
from soakd.engine.stats import StepStats
from soakd.errors import EngineError


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """`app` on 127.0.0.1 at a port the kernel picks; yields its base URL ("http://127.0.0.1:PORT"), and
    closes every connection when the block ends."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def least_time(fn: Callable[[], object], runs: int = 5, calls: int = 5) -> float:
    """The least seconds per call of `fn` over `runs` runs of `calls` calls each, the collector off: a
    cost to compare with a reference's, timed the same way alongside (never with a fixed bound: a busy
    machine slows both)."""
    best = float("inf")
    gc_was = gc.isenabled()
    gc.disable()  # a collection's pause is not the call's cost
    try:
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls)
    finally:
        if gc_was:
            gc.enable()
    return best


class ManualClock:
    """A monotonic clock (call it) that moves only when told: `now` is set, or `sleep` advances it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class ManualTime(ManualClock):
    """A ManualClock with the asyncio sleep a component awaits: backoffs and timeouts pass at once,
    and every sleep still yields to the event loop, as a real one does."""

    async def sleep(self, seconds: float) -> None:  # type: ignore[override]
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


# -- an engine and a soak's config --------------------------------------------------------------------


class StubEngine:
    """An in-process engine for a whole soak without a GPU: streams tokens (up to 4 a step, 1 ms apart)
    and reports one step per delta to the engine collector, as vLLM's stat logger does, with speculative
    decoding counts; `start` pushes one warm-up step first. `seen` holds the request ids it was sent.
    The allocator and /metrics calls fail (EngineError), as on an engine without them."""

    def __init__(self, collector: EngineCollector) -> None:
        self.collector = collector
        self.started = False
        self.stopped = False
        self.prepared: list[int] = []  # prepare_replay's concurrency, per call
        self.seen: list[str] = []

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            "stub",
            "1",
            "m",
            "cfg1",
            vocab_size=300,
            reserved_ids=(0,),
            max_model_len=4096,
            signals=("per_step", "spec_per_pos"),
        )

    async def start(self) -> None:
        self.collector.push(StepStats(time_ns=1, has_iteration=True, generation_tokens=99))  # warm-up noise
        self.started = True

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        self.seen.append(request.request_id)
        left = request.max_tokens
        while left:
            await asyncio.sleep(0.001)
            n = min(4, left)
            left -= n
            self.collector.push(
                StepStats(
                    time_ns=1,
                    has_iteration=True,
                    generation_tokens=n,
                    has_spec=True,
                    spec_drafts=1,
                    spec_draft_tokens=3,
                    spec_accepted=n - 1,
                    spec_accepted_per_pos=(1, 1, 0),
                    spec_draft_tokens_per_pos=(1, 1, 1),
                )
            )
            yield n

    def process_ids(self) -> list[int]:
        return [os.getpid()]

    def alive(self) -> bool:
        return self.started and not self.stopped

    async def memory_stats(self) -> list[Any]:
        raise EngineError("no worker extension")

    async def metrics_text(self) -> str:
        raise EngineError("no /metrics")

    def telemetry_summary(self) -> dict[str, object]:
        return {}

    async def prepare_replay(self, concurrency: int) -> None:
        self.prepared.append(concurrency)

    async def stop(self) -> None:
        self.stopped = True


def stub_config(tmp_path: Path, **overrides: object) -> Config:
    """The config of a short soak for StubEngine: a 3 s run over a 2 s synthetic trace at 20 requests/s
    (8 output tokens on average), 3 warm-up requests, host and engine telemetry every 0.5 s, runs under
    tmp_path/runs and an empty model folder made at tmp_path/model. `overrides` are dotted keys
    ("run.duration": "60s"), applied last."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "w.safetensors").write_text("")
    base: dict[str, object] = {
        "run.duration": "3s",
        "run.output_dir": str(tmp_path / "runs"),
        "trace.format": "synthetic",
        "trace.arrivals.rate_rps": 20.0,
        "trace.synthetic.duration": "2s",
        "trace.synthetic.output_tokens_mean": 8,
        "trace.synthetic.output_tokens_max": 16,
        "engine.model": str(tmp_path / "model"),
        "replay.warmup_requests": 3,
        "telemetry.interval": "0.5s",
        "telemetry.collectors": ["host", "engine"],
    }
    base.update(overrides)
    return load(None, base)


def recorded_gpu(path: Path, gpu: int = 0) -> Iterator[tuple[float, float, dict[str, Any], dict[str, Any]]]:
    """One GPU of an NVML recording (`soakd telemetry record`), as the throttle watch is fed: per fast
    sample, (seconds from the recording's start, wall seconds, the fast reading, the latest slow one)."""
    slow: dict[str, Any] = {}
    with gzip.open(path, "rt") as f:
        f.readline()
        for line in f:
            row = json.loads(line)
            g = row["gpus"][gpu]
            if g.get("fields") is not None:
                slow = g
            yield float(row["t"]), row["wall_ns"] / 1e9, g, slow


def load_script(path: Path, name: str) -> ModuleType:
    """A script that is not in a package (a benchmark's figures), imported under `name`: registered in
    sys.modules first, as its dataclasses look their module up there."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def recorded_run_dir(root: Path, name: str, *, data: Path) -> Path:
    """A run folder as soakd leaves it, at root/name, from a recorded run's files in `data` (the layout
    of tests/data/h200): for "soak", data/soak_{meta,summary,verdict}.json and data/soak_spool.lp.gz;
    for any other name, data/NAME/{meta,summary,verdict}.json and data/NAME/spool.lp.gz. The spool is
    unpacked into one segment."""
    out = root / name
    (out / "spool").mkdir(parents=True)
    if name == "soak":
        for f in ("meta", "summary", "verdict"):
            shutil.copy(data / f"soak_{f}.json", out / f"{f}.json")
        spool = data / "soak_spool.lp.gz"
    else:
        for f in ("meta", "summary", "verdict"):
            shutil.copy(data / name / f"{f}.json", out / f"{f}.json")
        spool = data / name / "spool.lp.gz"
    with gzip.open(spool, "rb") as src:
        (out / "spool" / "seg-00000001.lp").write_bytes(src.read())
    return out


# -- a fake pynvml -------------------------------------------------------------------------------------

H200_UUID = "GPU-11111111-2222-3333-4444-555555555555"
"""The UUID FakeNvml gives every GPU."""
H200_MEMORY = 150_754_820_096
"""The memory FakeNvml's GPUs have, in bytes: what NVML reports on an H200 (141 GB)."""


class FakeNvmlError(Exception):
    """FakeNvml's NVMLError: `value` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def _nvml_field(fid: int, value_type: int, value: int, ret: int = 0) -> Any:
    """An nvmlFieldValue_t. A C union: the 32-bit members hold the low bits of the 64-bit one."""
    union = SimpleNamespace(
        ullVal=value, uiVal=value & 0xFFFFFFFF, ulVal=value, sllVal=value, siVal=value & 0x7FFFFFFF, usVal=0
    )
    return SimpleNamespace(fieldId=fid, nvmlReturn=ret, valueType=value_type, value=union, dVal=0.0)


@dataclass
class FakeNvml:
    """The pynvml calls soakd.probe and soakd.collectors.nvml.LiveNvml make, for `count` GPUs with an
    H200's static facts (driver 580.159.04, CUDA driver 13.0, "NVIDIA H200", H200_UUID, H200_MEMORY
    bytes, 1980 MHz SM and 3201 MHz memory at most, a 5120-bit bus, 700 W power limit, PCIe gen 5 x16,
    compute capability 9.0) and scriptable readings.

    Readings: the SM clock at 1485 MHz (3/4 of its maximum), memory at 3201 MHz, 250 W, 60 C (HBM 55 C,
    30 C margin), 50 % busy, 1 GiB of memory used, P0, no ECC errors or remapped rows, two processes
    (pid 42 with 5 GiB, pid 7). `reasons` are the clock-event reason masks read in turn (the last one
    repeats), `counters` the field values (id -> value) of each field-values call in turn (the last
    repeats); field 82 (HBM temperature) always answers, field 83 (energy) grows by 1 J per read of it.

    `unsupported` names readings that raise NotSupported: "bus", "max_clock", "pcie" and "power_limit"
    (the probe's), "power" (the power draw), "energy" (its own call), "energy_field" (field 83) and
    "ecc". `init_error` makes nvmlInit raise that code. `name_bytes` returns the name as bytes, as old
    bindings do. `calls` logs the reasons, energy and shutdown calls, `field_calls` the ids of each
    field-values call, and `shutdown` is set by nvmlShutdown.

    Like an old binding, it has no nvmlDeviceGetCurrentClocksEventReasons (a subclass adds it)."""

    NVMLError: ClassVar[type[FakeNvmlError]] = FakeNvmlError
    NVML_ERROR_NOT_SUPPORTED: ClassVar[int] = 3
    NVML_CLOCK_SM: ClassVar[int] = 1
    NVML_CLOCK_MEM: ClassVar[int] = 2
    NVML_TEMPERATURE_GPU: ClassVar[int] = 0
    NVML_VOLATILE_ECC: ClassVar[int] = 0
    nvmlMemory_v2: ClassVar[int] = 0x02000028

    reasons: list[int] = field(default_factory=lambda: [0])
    counters: list[dict[int, int]] = field(default_factory=lambda: [{}])
    unsupported: set[str] = field(default_factory=set)
    count: int = 1
    init_error: int | None = None
    name_bytes: bool = False
    calls: list[str] = field(default_factory=list)
    field_calls: list[list[int]] = field(default_factory=list)
    shutdown: bool = False

    def _fail(self, what: str) -> None:
        if what in self.unsupported:
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)

    # -- the library and static facts

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown = True
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetName(self, h: str) -> str | bytes:
        return b"NVIDIA H200" if self.name_bytes else "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: str) -> str:
        return H200_UUID

    def nvmlDeviceGetMemoryInfo(self, h: str, version: int = 1) -> Any:
        used = 1 << 30
        return SimpleNamespace(total=H200_MEMORY, used=used, free=H200_MEMORY - used, reserved=0)

    def nvmlDeviceGetMemoryBusWidth(self, h: str) -> int:
        self._fail("bus")
        return 5120

    def nvmlDeviceGetMaxClockInfo(self, h: str, kind: int) -> int:
        self._fail("max_clock")
        return 1980 if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: str) -> int:
        self._fail("pcie")
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: str) -> int:
        self._fail("pcie")
        return 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: str) -> int:
        self._fail("pcie")
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: str) -> int:
        self._fail("pcie")
        return 16

    def nvmlDeviceGetEnforcedPowerLimit(self, h: str) -> int:
        self._fail("power_limit")
        return 700_000

    def nvmlDeviceGetCudaComputeCapability(self, h: str) -> tuple[int, int]:
        return (9, 0)

    # -- readings

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        return SimpleNamespace(gpu=50, memory=20)

    def nvmlDeviceGetClockInfo(self, h: str, kind: int) -> int:
        return 1485 if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: str) -> int:
        self.calls.append("throttle_reasons")
        return self.reasons.pop(0) if len(self.reasons) > 1 else self.reasons[0]

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        self._fail("power")
        return 250_000

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        return 60

    def nvmlDeviceGetPerformanceState(self, h: str) -> int:
        return 0

    def nvmlDeviceGetTotalEnergyConsumption(self, h: str) -> int:
        self.calls.append("energy")
        self._fail("energy")
        return 1_000_000

    def nvmlDeviceGetMarginTemperature(self, h: str) -> int:
        return 30

    def nvmlDeviceGetTotalEccErrors(self, h: str, kind: int, counter: int) -> int:
        self._fail("ecc")
        return 0

    def nvmlDeviceGetRemappedRows(self, h: str) -> tuple[int, int, int, int]:
        return (0, 0, 0, 0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[Any]:
        return [SimpleNamespace(pid=42, usedGpuMemory=5 << 30), SimpleNamespace(pid=7, usedGpuMemory=1)]

    def nvmlDeviceGetFieldValues(self, h: str, ids: list[int]) -> list[Any]:
        self.field_calls.append(list(ids))
        current = self.counters.pop(0) if len(self.counters) > 1 else self.counters[0]
        out: list[Any] = []
        for fid in ids:
            if fid == 82:
                out.append(_nvml_field(fid, 1, 55))  # unsigned int
            elif fid == 83 and "energy_field" not in self.unsupported:
                # 1 J more on every read of the counter
                reads = sum(83 in c for c in self.field_calls[:-1])
                out.append(_nvml_field(fid, 3, 2_000_000 + 1000 * reads))
            elif fid in current:
                out.append(_nvml_field(fid, 3, current[fid]))  # unsigned long long
            else:
                out.append(_nvml_field(fid, 3, 0, ret=self.NVML_ERROR_NOT_SUPPORTED))
        return out


# The small parent `measured` puts between a test and the process it measures. Linux counts the RSS of
# the process that forks a child into the child's peak (a forked copy starts at its parent's size, and a
# vforked or spawned one's exec records the parent's high-water mark), so a child of pytest, itself
# hundreds of MB after a thousand tests, would report pytest's peak; a child of this one starts small.
# It is transparent to the test: the stop signals sent to its process group reach the child alone (this
# parent ignores them), a SIGKILL of this parent takes the child with it (PR_SET_PDEATHSIG), and it ends
# as the child did (its exit code, or the same signal). It writes {"pid", "maxrss_kib"} to RSS_FILE.
_MEASURE = """
import ctypes, json, os, signal, sys
rss_file, *argv = sys.argv[1:]
stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
for s in stops:
    signal.signal(s, signal.SIG_IGN)
parent = os.getpid()
pid = os.fork()
if pid == 0:
    for s in stops:
        signal.signal(s, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(137)  # the parent was killed before prctl took effect
    os.execv(argv[0], argv)
_, status, usage = os.wait4(pid, 0)
with open(rss_file, "w") as f:
    json.dump({"pid": pid, "maxrss_kib": usage.ru_maxrss}, f)
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
sys.exit(os.waitstatus_to_exitcode(status))
"""

PEAK_RSS_LIMIT_MB = 500
"""What a case of hostile or careless input may cost soakd at most."""


def measured(argv: list[str], rss_file: Path) -> list[str]:
    """`argv` run under a small parent that writes the child's peak RSS to `rss_file` when it ends (Linux):
    give the result to subprocess.Popen as the command, then read it with `PeakRss.read(rss_file)`."""
    return [sys.executable, "-c", _MEASURE, str(rss_file), *argv]


@dataclass(frozen=True)
class PeakRss:
    """What `measured` wrote: the measured process's pid and its peak RSS."""

    pid: int
    mb: float

    @classmethod
    def read(cls, rss_file: Path) -> PeakRss:
        doc = json.loads(rss_file.read_text())
        return cls(int(doc["pid"]), int(doc["maxrss_kib"]) / 1024)

    def note(self, case: str) -> None:
        """Append this case's figure to the file $SOAKD_RSS_LOG names, when set: how
        benchmarks/bench_hostile_rss.py collects the figures of the tests that measure a process."""
        log = os.environ.get("SOAKD_RSS_LOG")
        if log:
            with Path(log).open("a", encoding="utf-8") as f:
                f.write(json.dumps({"case": case, "peak_rss_mb": round(self.mb, 1)}) + "\n")
