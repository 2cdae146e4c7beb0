"""NVIDIA GPU telemetry through NVML: a source protocol, the live and recorded sources, the collector.

Two tiers, because NVML calls differ in cost by three orders of magnitude:

- fast (default 10 Hz, `NvmlCollector.sample_fast`): what moves within a second and what the
  throttle detector judges: SM clock, clock-event reasons, power. Three calls, ~16 us of CPU per
  sample measured in a running daemon on an H200 (memory clock, temperature, memory v2,
  utilization and pstate cost ~125 us more there, for values that move on a scale of seconds).
  Folded into running per-interval aggregates, nothing kept per sample.
- slow (`NvmlCollector.refresh`, `gpu_slow_interval`, 2 s by default): memory clock, temperature,
  memory v2, utilization and pstate, and the millisecond calls. One field-values call
  carries the violation/throttle nanosecond counters (74-81, 269-271, decoded by their value type:
  they are unsigned 64-bit), HBM temperature (82) and total energy (83): a field-values call costs
  ~0.7 ms whatever it asks for, so HBM temperature rides here rather than costing one per fast
  sample. Then thermal margin, ECC and remapped rows, the memory of watched processes. Counters
  become deltas between slow reads. Total energy (field 83) costs ~3 ms of CPU on an H200 (NVML
  spins in the call), more than everything else together: it is asked on every `energy_every`-th
  slow read only (`telemetry.gpu_energy_interval`, 10 s by default); being a cumulative counter,
  its deltas stay exact, just coarser.

On Hopper and newer the slow tier also takes a GPM sample (NVML's GPU performance monitoring) and
turns each pair of consecutive samples into DRAM bandwidth, SM and tensor activity over that span: the
measured counterpart of soakd.collectors.ceiling's computed decode bandwidth. Where GPM is missing (an
older GPU, driver or pynvml) that is logged once per GPU with the reason, and the fields are absent.

PCIe throughput (which blocks ~21 ms) is not read at all.

A reading the GPU does not support is None in the source's dicts, logged once per (gpu, reading),
and simply absent from the samples.

Over 500 lines because the live source, the recorded source and the collector share one Reading type and one
field table, and are read together when a field is added.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from soakd.metric import FieldValue, Sample, counter_growth
from soakd.nvml_fields import REASON_BITS, THROTTLE_COUNTERS

log = structlog.get_logger(__name__)

Reading = dict[str, Any]
"""One GPU's readings of one tier: plain JSON-able values, None where unsupported."""

FAST_KEYS = ("sm_mhz", "reasons", "power_mw")
"""Keys of a fast-tier reading (the recording format's names)."""

GAUGE_KEYS = ("mem_mhz", "temp_c", "mem_used", "mem_total", "util_gpu", "util_mem", "pstate")
"""Cheap readings that move on a scale of seconds: read with the slow tier."""

GPM_METRICS: tuple[tuple[str, int], ...] = (
    ("gpm_dram_bw_pct", 10),  # NVML_GPM_METRIC_DRAM_BW_UTIL: % of the DRAM bandwidth's theoretical peak
    ("gpm_sm_util_pct", 2),  # NVML_GPM_METRIC_SM_UTIL: % of SMs busy
    ("gpm_sm_occupancy_pct", 3),  # NVML_GPM_METRIC_SM_OCCUPANCY: % of the maximum warps resident
    ("gpm_tensor_pct", 5),  # NVML_GPM_METRIC_ANY_TENSOR_UTIL: % of time SMs ran any tensor op
    ("gpm_hmma_pct", 7),  # NVML_GPM_METRIC_HMMA_TENSOR_UTIL: % of time SMs ran FP16/BF16 tensor ops
)
"""GPM metrics the slow tier computes between consecutive samples: reading key (= point field), metric id."""

GPM_KEYS = tuple(key for key, _ in GPM_METRICS)

SLOW_KEYS = (
    *GAUGE_KEYS,
    *GPM_KEYS,
    "energy_mj",
    "hbm_temp_c",
    "margin_c",
    "fields",
    "ecc_corrected",
    "ecc_uncorrected",
    "remapped_correctable",
    "remapped_uncorrectable",
    "remap_pending",
    "remap_failure",
    "proc_mem",
    "foreign_procs",
)
"""Keys of a slow-tier reading. `fields` maps a field id (as a string) to its decoded value;
`proc_mem` maps a watched PID (as a string) to its GPU memory in bytes; `foreign_procs` maps every other
process computing on the GPU the same way (None: unknown, see `LiveNvml._procs`); the `gpm_*` keys are
None on the first read and wherever GPM is unavailable."""

HBM_TEMP_FIELD = 82  # NVML_FI_DEV_MEMORY_TEMP
ENERGY_FIELD = 83  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, mJ since the driver loaded

HW_SLOWDOWN = 0x8

COUNTER_FIELD_IDS = tuple(fid for fid, _ in THROTTLE_COUNTERS)
SLOW_FIELD_IDS = (*COUNTER_FIELD_IDS, HBM_TEMP_FIELD, ENERGY_FIELD)

# nvmlValueType_t -> the c_nvmlValue_t union member holding it (NVML ABI values).
_VALUE_MEMBER = {1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_VALUE_TYPE_DOUBLE = 0
_NVML_SUCCESS = 0
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_FUNCTION_NOT_FOUND = 13


def decode_reasons(mask: int) -> list[str]:
    """The named clock-event reasons set in `mask` (unknown bits are left out)."""
    return [name for bit, name in REASON_BITS if mask & bit]


@dataclass(frozen=True, slots=True)
class GpuStatic:
    """What does not change while the driver is loaded; read once per GPU."""

    name: str | None = None
    uuid: str | None = None
    max_sm_mhz: int | None = None
    """Maximum SM clock, MHz: the denominator of `sm_clock_ratio`."""
    max_mem_mhz: int | None = None
    power_limit_mw: int | None = None
    """Enforced power limit, milliwatts."""
    mem_total: int | None = None
    """Device memory, bytes."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuStatic:
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


class NvmlSource(Protocol):
    """Where the collector and the recorder read GPUs from (live NVML or a recording)."""

    def gpu_count(self) -> int: ...

    def driver_version(self) -> str: ...

    def static(self, i: int) -> GpuStatic:
        """Name, UUID, max clocks, power limit and memory size of GPU `i`; cached after the first call."""
        ...

    def fast(self, i: int) -> Reading:
        """The microsecond readings of GPU `i` (keys FAST_KEYS), None where unsupported."""
        ...

    def slow(self, i: int, energy: bool = True) -> Reading:
        """The millisecond readings of GPU `i` (keys SLOW_KEYS), None where unsupported; with
        `energy=False` the total-energy counter is not read (None)."""
        ...

    def close(self) -> None: ...


class LiveNvml:
    """NvmlSource over pynvml. The module is passed in (`import pynvml; LiveNvml(pynvml)`), so tests
    hand in a fake; `nvmlInit` is called here and `nvmlShutdown` in `close`.

    Any NVMLError of one reading (NotSupported on most GeForce and Jetson parts, NoPermission, ...)
    makes that reading None and is logged once per (gpu, reading). Old drivers lacking
    nvmlDeviceGetCurrentClocksEventReasons fall back to nvmlDeviceGetCurrentClocksThrottleReasons.
    """

    def __init__(self, nvml: Any, pids: Callable[[], Iterable[int]] | None = None) -> None:
        self._nvml = nvml
        self._pids = pids
        """The processes whose GPU memory the slow tier reports (the engine's), asked on each read."""
        self._own_ever: set[int] = set()
        """Every PID ever the engine's: never taken for another process's."""
        self._error = nvml.NVMLError
        self._reported: set[tuple[int, str]] = set()
        self._static: dict[int, GpuStatic] = {}
        event = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._throttle_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        self._reasons_fn: Callable[[Any], int] | None = event or self._throttle_fn
        self._mem_v2 = getattr(nvml, "nvmlMemory_v2", None)
        self._energy_field_ok: dict[int, bool] = {}
        """Per GPU: whether field 83 gave the energy (else nvmlDeviceGetTotalEnergyConsumption)."""
        self._gpm: dict[int, _GpmState] = {}
        self.gpm_unavailable: dict[int, str] = {}
        """Per GPU without GPM: why (said once in the log; its slow readings carry no GPM values)."""
        nvml.nvmlInit()
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(int(nvml.nvmlDeviceGetCount()))]

    def gpu_count(self) -> int:
        return len(self._handles)

    def driver_version(self) -> str:
        try:
            return str(self._nvml.nvmlSystemGetDriverVersion())
        except self._error:
            return ""

    def _unsupported(self, i: int, what: str, err: object) -> None:
        key = (i, what)
        if key not in self._reported:
            self._reported.add(key)
            code = getattr(err, "value", None)
            log.info(
                "nvml_reading_unavailable",
                gpu=i,
                reading=what,
                not_supported=code == _NVML_ERROR_NOT_SUPPORTED,
                error=str(err),
            )

    def _call(self, i: int, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._error as err:
            self._unsupported(i, what, err)
            return None

    def _decode(self, i: int, fid: int, v: Any, quiet: bool = False) -> int | float | None:
        """One nvmlFieldValue_t by its valueType: 64-bit counters must come from `ullVal`."""
        if v.nvmlReturn != _NVML_SUCCESS:
            if not quiet:
                self._unsupported(i, f"field_{fid}", f"nvmlReturn {v.nvmlReturn}")
            return None
        kind = int(v.valueType)
        if kind == _VALUE_TYPE_DOUBLE:
            return float(v.value.dVal)
        return int(getattr(v.value, _VALUE_MEMBER.get(kind, "ullVal")))

    def _fields(
        self, i: int, ids: Sequence[int], quiet: frozenset[int] | set[int] = frozenset()
    ) -> list[int | float | None]:
        """Field values by id, None where not returned; ids in `quiet` are not logged when missing."""
        read = self._nvml.nvmlDeviceGetFieldValues
        values = self._call(i, "field_values", read, self._handles[i], list(ids))
        if values is None:
            return [None] * len(ids)
        out = [self._decode(i, fid, v, fid in quiet) for fid, v in zip(ids, values, strict=False)]
        return out + [None] * (len(ids) - len(out))

    def _reasons(self, i: int) -> int | None:
        fn = self._reasons_fn
        if fn is None:
            self._unsupported(i, "reasons", "no clock-event reasons call in this NVML binding")
            return None
        try:
            return int(fn(self._handles[i]))
        except self._error as err:
            # A new binding over an old driver: the event-reasons symbol is missing from the library.
            fallback = self._throttle_fn
            if getattr(err, "value", None) == _NVML_ERROR_FUNCTION_NOT_FOUND and fallback not in (None, fn):
                self._reasons_fn = fallback
                return self._reasons(i)
            self._unsupported(i, "reasons", err)
            return None

    def static(self, i: int) -> GpuStatic:
        cached = self._static.get(i)
        if cached is not None:
            return cached
        nv, h = self._nvml, self._handles[i]
        name = self._call(i, "name", nv.nvmlDeviceGetName, h)
        uuid = self._call(i, "uuid", nv.nvmlDeviceGetUUID, h)
        mem = self._call(i, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        st = GpuStatic(
            name=None if name is None else str(name),
            uuid=None if uuid is None else str(uuid),
            max_sm_mhz=self._call(i, "max_sm_mhz", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
            max_mem_mhz=self._call(i, "max_mem_mhz", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM),
            power_limit_mw=self._call(i, "power_limit", nv.nvmlDeviceGetEnforcedPowerLimit, h),
            mem_total=None if mem is None else int(mem.total),
        )
        self._static[i] = st
        return st

    def fast(self, i: int) -> Reading:
        nv, h = self._nvml, self._handles[i]
        return {
            "sm_mhz": self._call(i, "sm_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
            "reasons": self._reasons(i),
            "power_mw": self._call(i, "power", nv.nvmlDeviceGetPowerUsage, h),
        }

    def _gauges(self, i: int) -> Reading:
        nv, h = self._nvml, self._handles[i]
        if self._mem_v2 is not None:
            mem = self._call(i, "memory", nv.nvmlDeviceGetMemoryInfo, h, version=self._mem_v2)
        else:
            mem = self._call(i, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        util = self._call(i, "utilization", nv.nvmlDeviceGetUtilizationRates, h)
        return {
            "mem_mhz": self._call(i, "mem_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
            "temp_c": self._call(i, "temp", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            "mem_used": None if mem is None else int(mem.used),
            "mem_total": None if mem is None else int(mem.total),
            "util_gpu": None if util is None else int(util.gpu),
            "util_mem": None if util is None else int(util.memory),
            "pstate": self._call(i, "pstate", nv.nvmlDeviceGetPerformanceState, h),
        }

    def slow(self, i: int, energy: bool = True) -> Reading:
        nv, h = self._nvml, self._handles[i]
        gauges = self._gauges(i)
        margin = self._call(i, "margin", nv.nvmlDeviceGetMarginTemperature, h)
        if margin is not None:  # older bindings return the struct, newer ones the integer
            margin = int(getattr(margin, "marginTemperature", getattr(margin, "margin", margin)))
        use_field = energy and self._energy_field_ok.get(i, True)
        ids = SLOW_FIELD_IDS if use_field else SLOW_FIELD_IDS[:-1]
        values = self._fields(i, ids, quiet={ENERGY_FIELD})
        *counters, hbm = values[: len(COUNTER_FIELD_IDS) + 1]
        energy_mj = values[-1] if use_field else None
        if energy and energy_mj is None:
            # Field 83 unsupported (older drivers): the dedicated call, and no more asking for 83.
            self._energy_field_ok[i] = False
            energy_mj = self._call(i, "energy", nv.nvmlDeviceGetTotalEnergyConsumption, h)
        elif energy:
            self._energy_field_ok[i] = True
        out: Reading = {
            **gauges,
            "energy_mj": energy_mj,
            "hbm_temp_c": hbm,
            "margin_c": margin,
            "fields": {str(fid): v for fid, v in zip(COUNTER_FIELD_IDS, counters, strict=True)},
        }
        volatile = getattr(nv, "NVML_VOLATILE_ECC", 0)
        for key, kind in (("ecc_corrected", 0), ("ecc_uncorrected", 1)):
            out[key] = self._call(i, key, nv.nvmlDeviceGetTotalEccErrors, h, kind, volatile)
        rows = self._call(i, "remapped_rows", nv.nvmlDeviceGetRemappedRows, h)
        for n, key in enumerate(
            ("remapped_correctable", "remapped_uncorrectable", "remap_pending", "remap_failure")
        ):
            out[key] = None if rows is None else int(rows[n])
        out["proc_mem"], out["foreign_procs"] = self._procs(i) if self._pids is not None else (None, None)
        out.update(self._gpm_read(i))
        return out

    # -- GPM (Hopper and newer) ----------------------------------------------------------------------

    def _gpm_read(self, i: int) -> Reading:
        """The GPM metrics between this slow read and the previous one; None on the first read and
        once GPM is known unavailable. Never raises: an NVML error turns GPM off for that GPU."""
        out: Reading = dict.fromkeys(GPM_KEYS)
        if i in self.gpm_unavailable:
            return out
        st = self._gpm.get(i) or self._gpm_open(i)
        if st is None:
            return out
        nv = self._nvml
        try:
            nv.nvmlGpmSampleGet(self._handles[i], st.cur)
            if st.primed:
                q = st.query
                q.sample1, q.sample2 = st.prev, st.cur
                nv.nvmlGpmMetricsGet(q)
                for n, (key, _) in enumerate(GPM_METRICS):
                    m = q.metrics[n]
                    value = float(m.value)
                    # Two samples taken moments apart give 0/0: NaN with NVML_SUCCESS (seen on an H200).
                    if int(m.nvmlReturn) == _NVML_SUCCESS and math.isfinite(value):
                        out[key] = value
                    elif int(m.nvmlReturn) != _NVML_SUCCESS:
                        self._unsupported(i, key, f"nvmlReturn {m.nvmlReturn}")
        except self._error as err:
            self._gpm_off(i, f"GPM sampling failed: {err}")
            return dict.fromkeys(GPM_KEYS)
        # The sample just taken is the next span's start; the older buffer is overwritten next time.
        st.prev, st.cur = st.cur, st.prev
        st.primed = True
        return out

    def _gpm_open(self, i: int) -> _GpmState | None:
        nv, h = self._nvml, self._handles[i]
        needed = (
            "nvmlGpmQueryDeviceSupport",
            "nvmlGpmSampleAlloc",
            "nvmlGpmSampleGet",
            "nvmlGpmMetricsGet",
            "nvmlGpmSampleFree",
            "c_nvmlGpmMetricsGet_t",
        )
        missing = [name for name in needed if not hasattr(nv, name)]
        if missing:
            self._gpm_off(i, f"this pynvml has no {missing[0]} (nvidia-ml-py 11.525 or newer has GPM)")
            return None
        samples: list[Any] = []
        try:
            support = nv.nvmlGpmQueryDeviceSupport(h)
            if not int(support.isSupportedDevice):
                self._gpm_off(
                    i, "nvmlGpmQueryDeviceSupport: not supported on this GPU (GPM needs Hopper or newer)"
                )
                return None
            samples.append(nv.nvmlGpmSampleAlloc())
            samples.append(nv.nvmlGpmSampleAlloc())
        except self._error as err:
            for sample in samples:
                self._gpm_free(sample)
            self._gpm_off(i, f"GPM unavailable: {err}")
            return None
        query = nv.c_nvmlGpmMetricsGet_t()
        query.version = getattr(nv, "NVML_GPM_METRICS_GET_VERSION", 1)
        query.numMetrics = len(GPM_METRICS)
        for n, (_, metric_id) in enumerate(GPM_METRICS):
            query.metrics[n].metricId = metric_id
        st = _GpmState(samples[0], samples[1], query)
        self._gpm[i] = st
        return st

    def _gpm_off(self, i: int, reason: str) -> None:
        """GPM is unavailable on GPU `i`: said once, its samples freed, never asked again."""
        self.gpm_unavailable[i] = reason
        log.info("nvml_gpm_unavailable", gpu=i, reason=reason)
        st = self._gpm.pop(i, None)
        if st is not None:
            self._gpm_free(st.prev)
            self._gpm_free(st.cur)

    def _gpm_free(self, sample: Any) -> None:
        try:
            self._nvml.nvmlGpmSampleFree(sample)
        except self._error as err:
            log.warning("nvml_gpm_free_failed", error=str(err))

    def _procs(self, i: int) -> tuple[dict[str, int] | None, dict[str, int] | None]:
        """The watched processes' GPU memory, and that of every other process with a compute context on
        the GPU (a co-tenant: its SM time and power are taken from the engine's). The others are known
        only when a process of the engine is in the list: then its PIDs are the ones this process sees
        (in a container whose PID namespace hides the host's, NVML lists host PIDs and the engine's own
        process would read as a stranger). A PID once the engine's stays its own (an engine process
        orphaned by a crash, still releasing its context), and a PID not known is checked against the
        engine's processes read again after the list (a worker started in between)."""
        assert self._pids is not None
        wanted = set(self._pids())
        self._own_ever |= wanted
        if not wanted:
            return {}, None
        procs = self._call(i, "processes", self._nvml.nvmlDeviceGetComputeRunningProcesses, self._handles[i])
        if procs is None:
            return None, None
        if any(p.pid not in self._own_ever for p in procs):
            self._own_ever |= set(self._pids())
        own: dict[str, int] = {}
        foreign: dict[str, int] = {}
        for p in procs:
            # usedGpuMemory is None where the driver cannot tell (Windows WDDM, some vGPU).
            mem = int(p.usedGpuMemory or 0)
            if p.pid in wanted and p.usedGpuMemory is not None:
                own[str(p.pid)] = own.get(str(p.pid), 0) + mem
            elif p.pid not in self._own_ever:  # the engine's own PIDs (`wanted` among them) are never others
                foreign[str(p.pid)] = foreign.get(str(p.pid), 0) + mem
        if not any(p.pid in self._own_ever for p in procs):
            return own, None
        return own, foreign

    def close(self) -> None:
        for st in self._gpm.values():
            self._gpm_free(st.prev)
            self._gpm_free(st.cur)
        self._gpm.clear()
        try:
            self._nvml.nvmlShutdown()
        except self._error as err:
            log.warning("nvml_shutdown_failed", error=str(err))


class _GpmState:
    """One GPU's two GPM sample buffers (the previous read and the one being taken) and its query."""

    __slots__ = ("cur", "prev", "primed", "query")

    def __init__(self, prev: Any, cur: Any, query: Any) -> None:
        self.prev = prev
        self.cur = cur
        self.query = query
        self.primed = False
        """True once `prev` holds a sample: the next read has a span to compute metrics over."""


class RecordedNvml:
    """NvmlSource replaying a recording (`soakd telemetry record`, scripts/record_nvml.py; JSONL,
    gzip when the name ends .gz) on an injected clock, so tests drive time.

    Each fast()/slow() returns the recorded reading whose `t` is the latest at or before the time
    elapsed on `clock` since this source was built (the first one before that). `finished` says
    when that time is past the last line.
    """

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if not lines or "header" not in lines[0]:
            raise ValueError(f"{path}: not an NVML recording (no header line)")
        header = lines[0]["header"]
        self._driver = str(header.get("driver", ""))
        self._fast_t: list[float] = []
        self._fast: list[list[Reading]] = []
        self._slow_t: list[float] = []
        self._slow: list[list[Reading]] = []
        for row in lines[1:]:
            t = float(row["t"])
            gpus = row["gpus"]
            self._fast_t.append(t)
            self._fast.append([{k: g.get(k) for k in FAST_KEYS} for g in gpus])
            if any("fields" in g or "energy_mj" in g for g in gpus):
                self._slow_t.append(t)
                self._slow.append([{k: g.get(k) for k in SLOW_KEYS} for g in gpus])
        if not self._fast:
            raise ValueError(f"{path}: recording has no readings")
        first = lines[1]["gpus"] if len(lines) > 1 else []
        self._static = [
            GpuStatic.from_dict({"mem_total": first[i].get("mem_total") if i < len(first) else None, **g})
            for i, g in enumerate(header.get("gpus", []))
        ]
        self._clock = clock
        self._t0 = clock()

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    @property
    def finished(self) -> bool:
        """True once the replay time is past the recording's last line."""
        return self.elapsed_s > self._fast_t[-1]

    @property
    def duration_s(self) -> float:
        return self._fast_t[-1]

    def gpu_count(self) -> int:
        return len(self._static)

    def driver_version(self) -> str:
        return self._driver

    def static(self, i: int) -> GpuStatic:
        return self._static[i]

    def fast(self, i: int) -> Reading:
        k = bisect_right(self._fast_t, self.elapsed_s) - 1
        return self._fast[max(k, 0)][i]

    def slow(self, i: int, energy: bool = True) -> Reading:
        if not self._slow:
            return {}
        k = bisect_right(self._slow_t, self.elapsed_s) - 1
        return self._slow[max(k, 0)][i]

    def close(self) -> None:
        return None


class _Interval:
    """One GPU's running aggregates for the current interval: scalars only, nothing per sample."""

    __slots__ = (
        "counter_ns",
        "counter_resets",
        "energy_mj",
        "gpm_n",
        "gpm_sum",
        "hbm_max",
        "hw_blips",
        "hw_sustained",
        "masks",
        "mem_mhz_n",
        "mem_mhz_sum",
        "mem_total",
        "mem_used",
        "n",
        "power_max",
        "power_n",
        "power_sum",
        "pstate",
        "reasons_n",
        "slow_seen",
        "sm_max",
        "sm_min",
        "sm_n",
        "sm_sum",
        "temp_max",
        "util_n",
        "util_sum",
    )

    def __init__(self) -> None:
        self.n = 0
        self.sm_n = 0
        self.sm_sum = 0
        self.sm_min = 1 << 62
        self.sm_max = -1
        self.mem_mhz_n = 0
        self.mem_mhz_sum = 0
        self.power_n = 0
        self.power_sum = 0
        self.power_max = -1
        self.temp_max: int | None = None
        self.hbm_max: int | float | None = None
        self.mem_used: int | None = None
        self.mem_total: int | None = None
        self.util_n = 0
        self.util_sum = 0
        self.pstate: int | None = None
        self.reasons_n = 0
        self.masks: dict[int, int] = {}
        self.hw_sustained = 0
        self.hw_blips = 0
        # Slow tier: growth since the previous slow read, summed over the interval.
        self.slow_seen = False
        self.counter_ns: dict[int, int] = {}
        self.counter_resets = 0
        self.energy_mj: int | None = None
        self.gpm_sum: dict[str, float] = {}
        self.gpm_n: dict[str, int] = {}


class _GpuState:
    """Per-GPU state that outlives an interval: the previous slow read and the HwSlowdown run."""

    __slots__ = ("acc", "hw_run", "last_slow", "prev_counters", "prev_energy", "static")

    def __init__(self, static: GpuStatic) -> None:
        self.static = static
        self.acc = _Interval()
        self.hw_run = 0
        self.prev_counters: dict[int, int] = {}
        self.prev_energy: int | None = None
        self.last_slow: Reading = {}


class NvmlCollector:
    """One `gpu` point per GPU per interval (tags `gpu` = NVML index, `uuid` where known), from a NvmlSource.

    The app calls `sample_fast` at the fast rate (10 Hz by default), awaits `refresh` on the slow
    tier, and calls `collect` once per interval. Fields (absent when the GPU does not report them):

    - samples: fast samples in the interval
    - sm_mhz_min / sm_mhz_mean / sm_mhz_max: SM clock, MHz
    - sm_clock_ratio / sm_clock_ratio_min: mean / min SM clock over the GPU's max SM clock
    - mem_mhz: mean memory clock, MHz
    - power_w_mean / power_w_max, power_limit_w: board power and enforced limit, W
    - temp_c_max, hbm_temp_c_max: GPU and HBM temperature, C
    - mem_used_bytes / mem_total_bytes: device memory (v2: "used" includes "reserved"), last sample
    - util_gpu_mean: % of time a kernel ran; pstate: last P-state
    - reasons_or: bitwise OR of the clock-event reasons of the interval's samples (raw)
    - reason_<name>_share: fraction of samples with that reason (REASON_BITS). A HwSlowdown seen in a
      single isolated sample (it flags on P-state and clock changes) counts in `hw_slowdown_blips`, not
      in `reason_hw_slowdown_share`; a run is decided when it ends, so it may land in the next point.
    - energy_j: energy used since the previous energy read, J, on the points where energy was read
      (every `energy_every`-th slow read): the sum over any span is exact; thermal_margin_c: last
      margin to slowdown, C
    - throttle_<name>_s: growth of each throttle-time counter (THROTTLE_COUNTERS), s
    - counter_resets: counters (or energy) that went down (a driver reload) since the previous point
    - ecc_corrected / ecc_uncorrected (volatile), remapped_* rows; proc_mem_bytes: watched processes;
      foreign_procs / foreign_mem_bytes: other processes with a compute context on the GPU, where known
    - gpm_dram_bw_pct, gpm_sm_util_pct, gpm_sm_occupancy_pct, gpm_tensor_pct, gpm_hmma_pct (GPM_METRICS,
      Hopper+): mean over the interval's slow reads of each span's GPM share, %; carried like the gauges
    - interval_s: time since the previous point (absent on the first)
    """

    name = "gpu"

    def __init__(
        self,
        source: NvmlSource,
        gpus: Sequence[int] | None = None,
        on_fast: Callable[[int, float, Reading, Reading], None] | None = None,
        energy_every: int = 1,
    ) -> None:
        if energy_every < 1:
            raise ValueError("energy_every must be >= 1")
        self.source = source
        self.energy_every = energy_every
        """Read the energy counter on every this-many-th slow read (the first included)."""
        self._slow_reads = 0
        self.on_fast = on_fast
        """Called with (gpu, time, fast reading, latest slow reading) for every fast sample: the
        throttle detector's feed."""
        self.gpus = list(range(source.gpu_count())) if gpus is None else list(gpus)
        self._state = [_GpuState(source.static(i)) for i in self.gpus]
        self._last_ns: int | None = None
        self.last_fast_s: float | None = None
        self.fast_samples_total = 0
        self.counter_resets_total = 0

    # -- fast tier ---------------------------------------------------------------------------------

    def sample_fast(self, now_s: float) -> None:
        """Read every GPU's fast tier and fold it into the current interval."""
        self.last_fast_s = now_s
        self.fast_samples_total += 1
        fast = self.source.fast
        for i, st in zip(self.gpus, self._state, strict=True):
            r = fast(i)
            self._fold_fast(st, r)
            if self.on_fast is not None:
                self.on_fast(i, now_s, r, st.last_slow)

    def _fold_fast(self, st: _GpuState, r: Reading) -> None:
        a = st.acc
        a.n += 1
        sm = r.get("sm_mhz")
        if sm is not None:
            a.sm_n += 1
            a.sm_sum += sm
            a.sm_min = min(a.sm_min, sm)
            a.sm_max = max(a.sm_max, sm)
        v = r.get("power_mw")
        if v is not None:
            a.power_n += 1
            a.power_sum += v
            a.power_max = max(a.power_max, v)
        mask = r.get("reasons")
        if mask is None:
            return
        a.reasons_n += 1
        a.masks[mask] = a.masks.get(mask, 0) + 1
        if mask & HW_SLOWDOWN:
            st.hw_run += 1
            if st.hw_run == 2:
                a.hw_sustained += 2  # the run's first sample too, now that it is not isolated
            elif st.hw_run > 2:
                a.hw_sustained += 1
        elif st.hw_run:
            if st.hw_run == 1:
                a.hw_blips += 1
            st.hw_run = 0

    # -- slow tier ---------------------------------------------------------------------------------

    def read_slow(self) -> list[Reading]:
        """The slow tier of every GPU (blocking: milliseconds per GPU on real hardware)."""
        slow = self.source.slow
        energy = self._slow_reads % self.energy_every == 0
        self._slow_reads += 1
        return [slow(i, energy) for i in self.gpus]

    def fold_slow(self, readings: Sequence[Reading]) -> None:
        """Turn one slow read of every GPU into counter growth since the previous slow read."""
        for st, r in zip(self._state, readings, strict=True):
            self._fold_slow(st, r)

    def sample_slow(self) -> None:
        """`read_slow` and `fold_slow` in one call (the synchronous form of `refresh`)."""
        self.fold_slow(self.read_slow())

    async def refresh(self) -> None:
        """Slow tier: the NVML reads run in a worker thread, the folding on the loop."""
        self.fold_slow(await asyncio.to_thread(self.read_slow))

    def _fold_slow(self, st: _GpuState, r: Reading) -> None:
        if not r:
            return
        a = st.acc
        a.slow_seen = True
        st.last_slow = r
        v = r.get("hbm_temp_c")
        if v is not None and (a.hbm_max is None or v > a.hbm_max):
            a.hbm_max = v
        v = r.get("mem_mhz")
        if v is not None:
            a.mem_mhz_n += 1
            a.mem_mhz_sum += v
        v = r.get("temp_c")
        if v is not None and (a.temp_max is None or v > a.temp_max):
            a.temp_max = v
        v = r.get("mem_used")
        if v is not None:
            a.mem_used = v
        v = r.get("mem_total")
        if v is not None:
            a.mem_total = v
        v = r.get("util_gpu")
        if v is not None:
            a.util_n += 1
            a.util_sum += v
        v = r.get("pstate")
        if v is not None:
            a.pstate = v
        for key in GPM_KEYS:
            v = r.get(key)
            if v is not None:
                a.gpm_sum[key] = a.gpm_sum.get(key, 0.0) + float(v)
                a.gpm_n[key] = a.gpm_n.get(key, 0) + 1
        fields = r.get("fields") or {}
        for fid in COUNTER_FIELD_IDS:
            cur = fields.get(str(fid))
            if cur is None:
                continue
            cur = int(cur)
            prev = st.prev_counters.get(fid)
            st.prev_counters[fid] = cur
            if prev is None:
                continue
            delta, reset = counter_growth(prev, cur)
            a.counter_resets += reset
            self.counter_resets_total += reset
            a.counter_ns[fid] = a.counter_ns.get(fid, 0) + delta
        energy = r.get("energy_mj")
        if energy is not None:
            energy = int(energy)
            prev_e, st.prev_energy = st.prev_energy, energy
            if prev_e is not None:
                delta, reset = counter_growth(prev_e, energy)
                a.counter_resets += reset
                self.counter_resets_total += reset
                a.energy_mj = (a.energy_mj or 0) + delta

    # -- points ------------------------------------------------------------------------------------

    def collect(self, now_ns: int) -> Sequence[Sample]:
        last, self._last_ns = self._last_ns, now_ns
        out: list[Sample] = []
        for i, st in zip(self.gpus, self._state, strict=True):
            a, st.acc = st.acc, _Interval()
            if a.n == 0 and not a.slow_seen:
                continue
            fields = self._fields(st, a)
            if last is not None:
                fields["interval_s"] = (now_ns - last) / 1e9
            # The UUID beside the index: an index names another GPU under another CUDA_VISIBLE_DEVICES or
            # after a node's GPUs change; a UUID is the same board all night and across runs.
            tags = {"gpu": str(i), "uuid": st.static.uuid} if st.static.uuid else {"gpu": str(i)}
            out.append(Sample("gpu", fields, now_ns, tags=tags))
        return out

    def _fields(self, st: _GpuState, a: _Interval) -> dict[str, FieldValue]:
        f: dict[str, FieldValue] = {"samples": a.n}
        static = st.static
        if a.sm_n:
            mean = a.sm_sum / a.sm_n
            f["sm_mhz_min"] = int(a.sm_min)
            f["sm_mhz_mean"] = float(mean)
            f["sm_mhz_max"] = int(a.sm_max)
            if static.max_sm_mhz:
                f["sm_clock_ratio"] = mean / static.max_sm_mhz
                f["sm_clock_ratio_min"] = a.sm_min / static.max_sm_mhz
        if a.mem_mhz_n:
            f["mem_mhz"] = a.mem_mhz_sum / a.mem_mhz_n
        if a.power_n:
            f["power_w_mean"] = a.power_sum / a.power_n / 1000.0
            f["power_w_max"] = a.power_max / 1000.0
        if static.power_limit_mw is not None:
            f["power_limit_w"] = static.power_limit_mw / 1000.0
        if a.temp_max is not None:
            f["temp_c_max"] = int(a.temp_max)
        if a.hbm_max is not None:
            f["hbm_temp_c_max"] = int(a.hbm_max)
        if a.mem_used is not None:
            f["mem_used_bytes"] = int(a.mem_used)
        total = a.mem_total if a.mem_total is not None else static.mem_total
        if total is not None:
            f["mem_total_bytes"] = int(total)
        if a.util_n:
            f["util_gpu_mean"] = a.util_sum / a.util_n
        if a.pstate is not None:
            f["pstate"] = int(a.pstate)
        if a.reasons_n:
            mask_or = 0
            for mask in a.masks:
                mask_or |= mask
            f["reasons_or"] = int(mask_or)
            for bit, name in REASON_BITS:
                if bit == HW_SLOWDOWN:
                    count = a.hw_sustained
                else:
                    count = sum(c for mask, c in a.masks.items() if mask & bit)
                f[f"reason_{name}_share"] = count / a.reasons_n
            f["hw_slowdown_blips"] = a.hw_blips
        if a.slow_seen:
            f.update(self._slow_fields(st, a))
        else:
            f.update(self._carried(st))
        return f

    @staticmethod
    def _carried(st: _GpuState) -> dict[str, FieldValue]:
        """An interval without a slow read (the slow tier is slower than the interval): the gauges of the
        last slow read, so every point has them; counters and energy wait for the next read."""
        r = st.last_slow
        f: dict[str, FieldValue] = {}
        for key, field in (
            ("mem_mhz", "mem_mhz"),
            ("temp_c", "temp_c_max"),
            ("hbm_temp_c", "hbm_temp_c_max"),
            ("mem_used", "mem_used_bytes"),
            ("util_gpu", "util_gpu_mean"),
            ("pstate", "pstate"),
            ("margin_c", "thermal_margin_c"),
        ):
            v = r.get(key)
            if v is not None:
                f[field] = float(v) if field in ("mem_mhz", "util_gpu_mean", "thermal_margin_c") else int(v)
        for key in GPM_KEYS:
            v = r.get(key)
            if v is not None:
                f[key] = float(v)  # a share over the last slow span, like the utilization gauge
        return f

    def _slow_fields(self, st: _GpuState, a: _Interval) -> dict[str, FieldValue]:
        f: dict[str, FieldValue] = {}
        r = st.last_slow
        if a.energy_mj is not None:
            f["energy_j"] = a.energy_mj / 1000.0
        margin = r.get("margin_c")
        if margin is not None:
            f["thermal_margin_c"] = float(margin)
        for fid, name in THROTTLE_COUNTERS:
            ns = a.counter_ns.get(fid)
            if ns is not None:
                f[f"throttle_{name}_s"] = ns / 1e9
        f["counter_resets"] = a.counter_resets
        for key, n in a.gpm_n.items():
            f[key] = a.gpm_sum[key] / n
        for key in (
            "ecc_corrected",
            "ecc_uncorrected",
            "remapped_correctable",
            "remapped_uncorrectable",
            "remap_pending",
            "remap_failure",
        ):
            v = r.get(key)
            if v is not None:
                f[key] = int(v)
        procs = r.get("proc_mem")
        if procs is not None:
            f["proc_mem_bytes"] = int(sum(procs.values()))
        foreign = r.get("foreign_procs")
        if foreign is not None:
            f["foreign_procs"] = len(foreign)
            f["foreign_mem_bytes"] = int(sum(foreign.values()))
        return f

    def gpm_dram_bw_pct(self) -> float | None:
        """GPM's DRAM bandwidth share of the latest slow read, mean over the GPUs that gave one."""
        values = [float(v) for st in self._state if (v := st.last_slow.get("gpm_dram_bw_pct")) is not None]
        return sum(values) / len(values) if values else None

    def close(self) -> None:
        self.source.close()
