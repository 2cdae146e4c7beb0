"""Host telemetry through psutil: CPU, frequency, temperatures, memory, and the engine's RSS.

For CPU-only soaks it also reads sysfs (root injectable, for tests): the per-CPU thermal-throttle
counters, the CPU clocks, the thermal zones with their trip points and the RAPL energy counters. An
`on_read` hook hands each pass's throttle signals to the host throttle detector.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import structlog

from soakd.metric import FieldValue, Sample, counter_growth

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _RaplZone:
    key: str
    """Directory name, e.g. intel-rapl:0 or intel-rapl:0:1."""
    name: str
    """Domain name from the `name` file, e.g. package-0, core, dram."""
    energy: Path
    max_range_uj: int | None
    top_level: bool


@dataclass(frozen=True, slots=True)
class _ThermalZone:
    name: str
    """Directory name, e.g. thermal_zone0."""
    kind: str
    """Contents of the `type` file, e.g. x86_pkg_temp, acpitz."""
    temp: Path
    trip_c: float | None
    """The zone's lowest passive trip (C), else its lowest critical one; None when it has neither."""


@dataclass(frozen=True, slots=True)
class SysfsReadings:
    """What one pass over sysfs found; a signal the machine does not offer is None / empty."""

    core_throttle_total: int | None = None
    """Sum over CPUs of core_throttle_count (events since boot)."""
    package_throttle_total: int | None = None
    """Sum over packages of package_throttle_count (events since boot; once per package if known)."""
    core_throttle_delta: int | None = None
    """Growth of core_throttle_total since the previous pass (events; None on the first pass)."""
    package_throttle_delta: int | None = None
    """Growth of package_throttle_total since the previous pass (events; None on the first pass)."""
    zone_temps_c: dict[str, tuple[str, float]] = field(default_factory=dict)
    """thermal_zoneN -> (type, degrees C)."""
    thermal_margin_c: float | None = None
    """Minimum over zones of (passive trip, else critical trip) - temperature (C); None without trips."""
    cpu_mhz: float | None = None
    """Mean over CPUs of cpufreq's scaling_cur_freq (MHz)."""
    cpu_max_mhz: float | None = None
    """Mean over CPUs of cpufreq's scaling_max_freq (MHz)."""
    rapl_energy_j: dict[str, tuple[str, float]] = field(default_factory=dict)
    """intel-rapl:N[:M] -> (domain name, joules since the previous pass, wrap-around handled)."""
    rapl_top_level: frozenset[str] = frozenset()
    """The RAPL zones that are packages/psys (not sub-domains, whose energy their package includes)."""
    interval_s: float | None = None
    """Seconds since the previous pass (None on the first)."""


class HostSysfs:
    """Reads the host's throttle counters, CPU clocks, thermal zones and RAPL energy under a sysfs root.

    Files are discovered once at construction, and the trip points read then (they are set by firmware
    or the driver, not during a run); a file that cannot be read (RAPL energy is root-only on recent
    kernels) is simply absent from the readings, logged once, and not retried.
    """

    def __init__(self, root: str | Path = "/") -> None:
        self._root = Path(root)
        self._unreadable: set[Path] = set()
        cpu_dir = self._root / "sys/devices/system/cpu"
        self._core_files: list[Path] = sorted(cpu_dir.glob("cpu[0-9]*/thermal_throttle/core_throttle_count"))
        # package_throttle_count is per package but repeated in every CPU's directory: read one per package
        # where the topology says which package a CPU is in, else sum them all.
        self._package_files: list[Path] = []
        seen: set[str] = set()
        for path in sorted(cpu_dir.glob("cpu[0-9]*/thermal_throttle/package_throttle_count")):
            pkg = self._read_text(path.parent.parent / "topology/physical_package_id", quiet=True)
            if pkg is not None:
                if pkg in seen:
                    continue
                seen.add(pkg)
            self._package_files.append(path)
        # Read here rather than through psutil.cpu_freq(), which always reads the real /sys.
        self._cur_freq_files = sorted(cpu_dir.glob("cpu[0-9]*/cpufreq/scaling_cur_freq"))
        self._max_freq_files = sorted(cpu_dir.glob("cpu[0-9]*/cpufreq/scaling_max_freq"))
        self._zones: list[_ThermalZone] = []
        for zone in sorted((self._root / "sys/class/thermal").glob("thermal_zone*")):
            kind = self._read_text(zone / "type", quiet=True) or zone.name
            self._zones.append(_ThermalZone(zone.name, kind, zone / "temp", self._trip_c(zone)))
        self._rapl: list[_RaplZone] = []
        for zone in sorted((self._root / "sys/class/powercap").glob("intel-rapl:*")):
            if not (zone / "energy_uj").exists():
                continue
            name = self._read_text(zone / "name", quiet=True) or zone.name
            max_range = self._read_int(zone / "max_energy_range_uj", quiet=True)
            top = zone.name.count(":") == 1
            self._rapl.append(_RaplZone(zone.name, name, zone / "energy_uj", max_range, top))
        self._prev_core: int | None = None
        self._prev_package: int | None = None
        self._prev_energy: dict[str, int] = {}
        self._prev_ns: int | None = None

    def _read_text(self, path: Path, *, quiet: bool = False) -> str | None:
        if path in self._unreadable:
            return None
        try:
            return path.read_text().strip()
        except OSError as exc:
            if not quiet:
                self._unreadable.add(path)
                log.info("host sysfs file unreadable, leaving it out", path=str(path), error=str(exc))
            return None

    def _read_int(self, path: Path, *, quiet: bool = False) -> int | None:
        text = self._read_text(path, quiet=quiet)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            return None

    def _trip_c(self, zone: Path) -> float | None:
        trips: dict[str, list[float]] = {}
        for type_file in zone.glob("trip_point_*_type"):
            kind = self._read_text(type_file, quiet=True)
            milli = self._read_int(
                type_file.with_name(type_file.name.removesuffix("_type") + "_temp"), quiet=True
            )
            # A disabled trip reads 0 (x86_pkg_temp's default) or THERMAL_TEMP_INVALID (-274000).
            if kind in ("passive", "critical") and milli is not None and milli > 0:
                trips.setdefault(kind, []).append(milli / 1000.0)
        # Passive is where the kernel starts cooling by slowing the CPU; critical is the shutdown point.
        for kind in ("passive", "critical"):
            if kind in trips:
                return min(trips[kind])
        return None

    def _sum(self, files: list[Path]) -> int | None:
        values = [v for v in (self._read_int(p) for p in files) if v is not None]
        return sum(values) if values else None

    def _mean_mhz(self, files: list[Path]) -> float | None:
        khz = [v for v in (self._read_int(p) for p in files) if v is not None and v > 0]
        return statistics.fmean(khz) / 1000.0 if khz else None

    def read(self, now_ns: int) -> SysfsReadings:
        core = self._sum(self._core_files)
        package = self._sum(self._package_files)
        core_delta = _growth(self._prev_core, core)
        package_delta = _growth(self._prev_package, package)
        self._prev_core, self._prev_package = core, package
        temps: dict[str, tuple[str, float]] = {}
        margins: list[float] = []
        for zone in self._zones:
            milli = self._read_int(zone.temp)
            if milli is not None:
                temps[zone.name] = (zone.kind, milli / 1000.0)
                if zone.trip_c is not None:
                    margins.append(zone.trip_c - milli / 1000.0)
        energy: dict[str, tuple[str, float]] = {}
        for rz in self._rapl:
            uj = self._read_int(rz.energy)
            if uj is None:
                continue
            prev = self._prev_energy.get(rz.key)
            self._prev_energy[rz.key] = uj
            if prev is None:
                continue
            delta = uj - prev
            if delta < 0:  # the counter wrapped at max_energy_range_uj
                if rz.max_range_uj is None:
                    continue
                delta += rz.max_range_uj
            energy[rz.key] = (rz.name, delta / 1e6)
        interval = None if self._prev_ns is None else (now_ns - self._prev_ns) / 1e9
        self._prev_ns = now_ns
        return SysfsReadings(
            core_throttle_total=core,
            package_throttle_total=package,
            core_throttle_delta=core_delta,
            package_throttle_delta=package_delta,
            zone_temps_c=temps,
            thermal_margin_c=min(margins) if margins else None,
            cpu_mhz=self._mean_mhz(self._cur_freq_files),
            cpu_max_mhz=self._mean_mhz(self._max_freq_files),
            rapl_energy_j=energy,
            rapl_top_level=frozenset(rz.key for rz in self._rapl if rz.top_level),
            interval_s=interval,
        )


def _growth(prev: int | None, cur: int | None) -> int | None:
    return None if prev is None or cur is None else counter_growth(prev, cur)[0]


def sysfs_fields(readings: SysfsReadings) -> dict[str, FieldValue]:
    """The `host` measurement's fields from one sysfs pass."""
    fields: dict[str, FieldValue] = {}
    if readings.core_throttle_total is not None:
        fields["cpu_core_throttle_total"] = readings.core_throttle_total
    if readings.package_throttle_total is not None:
        fields["cpu_package_throttle_total"] = readings.package_throttle_total
    if readings.core_throttle_delta is not None:
        fields["cpu_core_throttle_delta"] = readings.core_throttle_delta
    if readings.package_throttle_delta is not None:
        fields["cpu_package_throttle_delta"] = readings.package_throttle_delta
    if readings.zone_temps_c:
        kind, temp = max(readings.zone_temps_c.values(), key=lambda kt: kt[1])
        fields["thermal_zone_max_c"] = temp
        fields["thermal_zone_max_type"] = kind
    if readings.thermal_margin_c is not None:
        fields["thermal_margin_c"] = readings.thermal_margin_c
    top = [j for key, (_, j) in readings.rapl_energy_j.items() if key in readings.rapl_top_level]
    if top:
        fields["rapl_energy_j"] = float(sum(top))
        if readings.interval_s:
            fields["rapl_power_w"] = float(sum(top)) / readings.interval_s
    return fields


@dataclass(frozen=True, slots=True)
class HostThrottleReading:
    """The throttle signals of one host pass, as the `on_read` hook receives them."""

    cpu_mhz: float | None
    """Mean current CPU clock (MHz)."""
    core_throttle_total: int | None
    """Sum over CPUs of core_throttle_count (events since boot)."""
    package_throttle_total: int | None
    """Sum over packages of package_throttle_count (events since boot)."""
    thermal_margin_c: float | None
    """Degrees C left before the nearest passive (else critical) trip point."""
    cpu_percent: float | None
    """Machine-wide CPU utilization since the previous pass (%)."""


HostReadFn = Callable[[float, HostThrottleReading], None]


def _cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of one process (all its threads)."""
    t = proc.cpu_times()
    return float(t.user + t.system)


class _Processes:
    """A changing set of processes read each pass: RSS now, CPU seconds used since the last pass."""

    def __init__(self, skip_cpu: int | None = None) -> None:
        self._skip_cpu = skip_cpu
        self._procs: dict[int, psutil.Process] = {}
        self._cpu: dict[int, float] = {}  # CPU seconds of each process at the last pass

    def read(self, pids: list[int]) -> tuple[int, int, float]:
        """(RSS, live processes, CPU seconds since the last pass) of `pids`."""
        total = 0
        alive = 0
        cpu = 0.0
        for pid in pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                total += proc.memory_info().rss
                if pid != self._skip_cpu:
                    used = _cpu_s(proc)
                    # A process seen for the first time counts from now (its start-up is not this pass's).
                    cpu += used - self._cpu.get(pid, used)
                    self._cpu[pid] = used
                alive += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                self._procs.pop(pid, None)
        for gone in set(self._procs) - set(pids):
            del self._procs[gone]
        for gone in set(self._cpu) - set(self._procs):
            del self._cpu[gone]
        return total, alive, cpu


class HostCollector:
    """CPU and memory of the machine, RSS of the engine's processes, free space under the spool.

    soakd's own figures include its helper processes (`helper_pids`: the HTTP sender).

    `on_read(t_s, reading)`, when given, is called at the end of every `collect` with `clock()`'s time.
    """

    name = "host"

    def __init__(
        self,
        engine_pids: Callable[[], list[int]],
        spool_dir: Path,
        root: str | Path = "/",
        *,
        on_read: HostReadFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        helper_pids: Callable[[], list[int]] = lambda: [],
    ) -> None:
        self._engine_pids = engine_pids
        self._helper_pids = helper_pids
        self._spool_dir = spool_dir
        self._sysfs = HostSysfs(root)
        self._on_read = on_read
        self._clock = clock
        self._self = psutil.Process()
        self._engine_procs = _Processes(skip_cpu=self._self.pid)
        self._helpers = _Processes()
        self._helper_cpu = 0.0  # CPU seconds the helpers used since the collector started
        self._self_cpu = _cpu_s(self._self)
        self._last_t: float | None = None  # the clock at the last pass; the first pass only primes
        # cpu_percent(None) measures since the previous call; the first call only primes it.
        psutil.cpu_percent(None)

    def _engine(self, pids: list[int]) -> tuple[int, int, float]:
        """RSS and count of the engine's live processes, and the CPU seconds they used since the last pass.

        An in-process engine counts soakd's own process among its own (its front end lives there): its
        RSS is counted here, its CPU is not (that is `soakd_cpu_percent`, never counted twice)."""
        return self._engine_procs.read(pids)

    def collect(self, now_ns: int) -> Sequence[Sample]:
        cpu_percent = float(psutil.cpu_percent(None))
        fields: dict[str, FieldValue] = {"cpu_percent": cpu_percent}
        sysfs = self._sysfs.read(now_ns)
        cur_mhz, max_mhz = sysfs.cpu_mhz, sysfs.cpu_max_mhz
        if cur_mhz is None:  # no cpufreq under the root (some VMs): psutil, which falls back to /proc/cpuinfo
            freq = psutil.cpu_freq()
            if freq is not None:
                cur_mhz, max_mhz = float(freq.current) or None, float(freq.max) or None
        if cur_mhz is not None:
            fields["cpu_freq_mhz"] = cur_mhz
        if max_mhz is not None:
            fields["cpu_freq_max_mhz"] = max_mhz
        load1, _, _ = os.getloadavg()
        fields["load1"] = float(load1)
        mem = psutil.virtual_memory()
        fields["mem_used_bytes"] = int(mem.used)
        fields["mem_available_bytes"] = int(mem.available)
        fields["mem_percent"] = float(mem.percent)
        fields["swap_used_bytes"] = int(psutil.swap_memory().used)
        temps = getattr(psutil, "sensors_temperatures", None)
        if temps is not None:
            readings = [t.current for group in temps().values() for t in group if t.current]
            if readings:
                fields["temp_max_c"] = float(max(readings))
        rss, procs, engine_cpu = self._engine(self._engine_pids())
        fields["engine_rss_bytes"] = rss
        fields["engine_procs"] = procs
        helper_rss, _, helper_cpu = self._helpers.read(self._helper_pids())
        self._helper_cpu += helper_cpu
        fields["soakd_rss_bytes"] = int(self._self.memory_info().rss) + helper_rss
        # soakd's own process: with engine.kind = "vllm-local" it also hosts vLLM's front end (AsyncLLM's
        # output processing); the engine's other processes (core, workers) are engine_cpu_percent.
        self_cpu = _cpu_s(self._self) + self._helper_cpu
        now = self._clock()
        fields["soakd_cpu_seconds"] = self_cpu
        if self._last_t is not None and now > self._last_t:
            elapsed = now - self._last_t
            fields["soakd_cpu_percent"] = 100.0 * (self_cpu - self._self_cpu) / elapsed
            fields["engine_cpu_percent"] = 100.0 * engine_cpu / elapsed
        self._self_cpu, self._last_t = self_cpu, now
        fields["spool_disk_free_bytes"] = int(psutil.disk_usage(str(self._spool_dir)).free)
        fields.update(sysfs_fields(sysfs))
        out = [Sample("host", fields, now_ns)]
        for zone, (kind, temp) in sysfs.zone_temps_c.items():
            out.append(Sample("host_thermal", {"temp_c": temp}, now_ns, {"zone": zone, "type": kind}))
        for key, (name, joules) in sysfs.rapl_energy_j.items():
            rapl: dict[str, FieldValue] = {"energy_j": joules}
            if sysfs.interval_s:
                rapl["power_w"] = joules / sysfs.interval_s
            out.append(Sample("host_rapl", rapl, now_ns, {"zone": key, "domain": name}))
        if self._on_read is not None:
            reading = HostThrottleReading(
                cpu_mhz=cur_mhz,
                core_throttle_total=sysfs.core_throttle_total,
                package_throttle_total=sysfs.package_throttle_total,
                thermal_margin_c=sysfs.thermal_margin_c,
                cpu_percent=cpu_percent,
            )
            self._on_read(now, reading)
        return out

    def close(self) -> None:
        self._engine_procs = _Processes(skip_cpu=self._self.pid)
        self._helpers = _Processes()
