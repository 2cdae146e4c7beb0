"""The host collector's sysfs signals over a fake sysfs tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from structlog.testing import capture_logs

from soakd.collectors.host import HostCollector, HostSysfs, HostThrottleReading, sysfs_fields

S = 10**9


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _tree(root: Path) -> None:
    cpu = root / "sys/devices/system/cpu"
    for n, pkg in enumerate([0, 0, 1, 1]):
        _write(cpu / f"cpu{n}/thermal_throttle/core_throttle_count", str(10 * n))
        _write(cpu / f"cpu{n}/thermal_throttle/package_throttle_count", str(100 + pkg))
        _write(cpu / f"cpu{n}/topology/physical_package_id", str(pkg))
    _write(cpu / "cpufreq/boost", "1")  # not a cpuN directory
    thermal = root / "sys/class/thermal"
    _write(thermal / "thermal_zone0/type", "acpitz")
    _write(thermal / "thermal_zone0/temp", "27800")
    _write(thermal / "thermal_zone1/type", "x86_pkg_temp")
    _write(thermal / "thermal_zone1/temp", "71500")
    rapl = root / "sys/class/powercap"
    _write(rapl / "intel-rapl:0/name", "package-0")
    _write(rapl / "intel-rapl:0/energy_uj", "262142000000")
    _write(rapl / "intel-rapl:0/max_energy_range_uj", "262143328850")
    _write(rapl / "intel-rapl:0:0/name", "dram")
    _write(rapl / "intel-rapl:0:0/energy_uj", "1000000")
    _write(rapl / "intel-rapl:0:0/max_energy_range_uj", "65712999613")
    _write(rapl / "intel-rapl:1/name", "package-1")
    _write(rapl / "intel-rapl:1/energy_uj", "5000000")
    _write(rapl / "intel-rapl:1/max_energy_range_uj", "262143328850")


def test_sysfs_counters_zones_and_rapl_wraparound(tmp_path: Path) -> None:
    _tree(tmp_path)
    sysfs = HostSysfs(tmp_path)
    first = sysfs.read(0)
    assert first.core_throttle_total == 0 + 10 + 20 + 30
    assert first.package_throttle_total == 100 + 101  # once per package
    assert first.core_throttle_delta is None
    assert first.zone_temps_c == {"thermal_zone0": ("acpitz", 27.8), "thermal_zone1": ("x86_pkg_temp", 71.5)}
    assert first.rapl_energy_j == {}
    assert first.interval_s is None

    cpu = tmp_path / "sys/devices/system/cpu"
    _write(cpu / "cpu2/thermal_throttle/core_throttle_count", "25")
    _write(cpu / "cpu0/thermal_throttle/package_throttle_count", "103")
    rapl = tmp_path / "sys/class/powercap"
    # package-0 wraps: 262142000000 -> max 262143328850 -> 2671150: 1328850 + 2671150 uJ = 4 J.
    _write(rapl / "intel-rapl:0/energy_uj", "2671150")
    _write(rapl / "intel-rapl:0:0/energy_uj", "2500000")
    _write(rapl / "intel-rapl:1/energy_uj", "11000000")
    second = sysfs.read(2 * S)
    assert second.core_throttle_delta == 5
    assert second.package_throttle_delta == 3
    assert second.interval_s == 2.0
    assert second.rapl_energy_j["intel-rapl:0"] == ("package-0", pytest.approx(4.0))
    assert second.rapl_energy_j["intel-rapl:0:0"] == ("dram", pytest.approx(1.5))
    assert second.rapl_energy_j["intel-rapl:1"] == ("package-1", pytest.approx(6.0))

    fields = sysfs_fields(second)
    assert fields["cpu_core_throttle_total"] == 65
    assert fields["cpu_core_throttle_delta"] == 5
    assert fields["cpu_package_throttle_total"] == 204
    assert fields["cpu_package_throttle_delta"] == 3
    assert fields["thermal_zone_max_c"] == 71.5
    assert fields["thermal_zone_max_type"] == "x86_pkg_temp"
    assert fields["rapl_energy_j"] == pytest.approx(10.0)  # packages only; dram is inside package-0
    assert fields["rapl_power_w"] == pytest.approx(5.0)


def test_empty_root_gives_no_sysfs_fields(tmp_path: Path) -> None:
    sysfs = HostSysfs(tmp_path)
    sysfs.read(0)
    assert sysfs_fields(sysfs.read(S)) == {}


def test_unreadable_energy_is_absent(tmp_path: Path) -> None:
    _tree(tmp_path)
    energy = tmp_path / "sys/class/powercap/intel-rapl:1/energy_uj"
    energy.chmod(0)
    try:
        if os.access(energy, os.R_OK):
            pytest.skip("running as root: a mode-000 file is still readable")
        sysfs = HostSysfs(tmp_path)
        sysfs.read(0)
        readings = sysfs.read(S)
        assert "intel-rapl:1" not in readings.rapl_energy_j
        assert "intel-rapl:0" in readings.rapl_energy_j
        assert energy in sysfs._unreadable
    finally:
        energy.chmod(0o644)


def test_host_collector_reports_sysfs_signals(tmp_path: Path) -> None:
    _tree(tmp_path)
    spool = tmp_path / "spool"
    spool.mkdir()
    collector = HostCollector(list, spool, root=tmp_path)
    first = collector.collect(10 * S)
    host = next(s for s in first if s.measurement == "host")
    # Existing fields stay.
    for key in ("cpu_percent", "load1", "mem_used_bytes", "engine_rss_bytes", "spool_disk_free_bytes"):
        assert key in host.fields
    assert host.fields["engine_procs"] == 0
    assert host.fields["cpu_core_throttle_total"] == 60
    assert "cpu_core_throttle_delta" not in host.fields
    zones = {s.tags["zone"]: s for s in first if s.measurement == "host_thermal"}
    assert zones["thermal_zone1"].tags["type"] == "x86_pkg_temp"
    assert zones["thermal_zone1"].fields["temp_c"] == 71.5

    _write(tmp_path / "sys/devices/system/cpu/cpu3/thermal_throttle/core_throttle_count", "31")
    _write(tmp_path / "sys/class/powercap/intel-rapl:1/energy_uj", "7000000")
    second = collector.collect(11 * S)
    host = next(s for s in second if s.measurement == "host")
    assert host.fields["cpu_core_throttle_delta"] == 1
    rapl = {s.tags["zone"]: s for s in second if s.measurement == "host_rapl"}
    assert rapl["intel-rapl:1"].tags["domain"] == "package-1"
    assert rapl["intel-rapl:1"].fields["power_w"] == pytest.approx(2.0)
    assert all(s.to_line() is not None for s in second)
    collector.close()


def test_energy_that_cannot_be_read_is_absent_and_logged_once(tmp_path: Path) -> None:
    # Works as root too: a read that raises OSError (here a directory in place of the file).
    _tree(tmp_path)
    energy = tmp_path / "sys/class/powercap/intel-rapl:1/energy_uj"
    energy.unlink()
    energy.mkdir()
    sysfs = HostSysfs(tmp_path)
    with capture_logs() as logs:
        for i in range(3):
            readings = sysfs.read(i * S)
    assert "intel-rapl:1" not in readings.rapl_energy_j
    assert "intel-rapl:0" in readings.rapl_energy_j
    assert [entry["path"] for entry in logs] == [str(energy)]


def _trips_and_clocks(root: Path) -> None:
    """Trip points on the zones of `_tree`, a zone without trips, and cpufreq for its four CPUs."""
    thermal = root / "sys/class/thermal"
    _write(thermal / "thermal_zone0/trip_point_0_type", "critical")
    _write(thermal / "thermal_zone0/trip_point_0_temp", "105000")
    # x86_pkg_temp: a disabled passive trip (0), two passive trips (the lowest counts) and a critical one.
    for k, (kind, milli) in enumerate(
        [
            ("passive", "0"),
            ("passive", "95000"),
            ("passive", "90000"),
            ("critical", "100000"),
            ("hot", "80000"),
        ]
    ):
        _write(thermal / f"thermal_zone1/trip_point_{k}_type", kind)
        _write(thermal / f"thermal_zone1/trip_point_{k}_temp", milli)
    _write(thermal / "thermal_zone2/type", "iwlwifi_1")
    _write(thermal / "thermal_zone2/temp", "88000")  # hotter than the others, but no trip to measure from
    cpu = root / "sys/devices/system/cpu"
    for n, khz in enumerate([2400000, 2600000, 3000000, 3000000]):
        _write(cpu / f"cpu{n}/cpufreq/scaling_cur_freq", str(khz))
        _write(cpu / f"cpu{n}/cpufreq/scaling_max_freq", "4500000")


def test_thermal_margin_from_trip_points_and_cpufreq(tmp_path: Path) -> None:
    _tree(tmp_path)
    _trips_and_clocks(tmp_path)
    sysfs = HostSysfs(tmp_path)
    first = sysfs.read(0)
    # acpitz: 105 - 27.8 = 77.2; x86_pkg_temp: lowest enabled passive 90 - 71.5 = 18.5; iwlwifi: none.
    assert first.thermal_margin_c == pytest.approx(18.5)
    assert first.cpu_mhz == pytest.approx((2400 + 2600 + 3000 + 3000) / 4)
    assert first.cpu_max_mhz == pytest.approx(4500.0)

    _write(tmp_path / "sys/class/thermal/thermal_zone1/temp", "87250")
    _write(tmp_path / "sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq", "800000")
    second = sysfs.read(S)
    assert second.thermal_margin_c == pytest.approx(2.75)
    assert second.cpu_mhz == pytest.approx((800 + 2600 + 3000 + 3000) / 4)
    assert sysfs_fields(second)["thermal_margin_c"] == pytest.approx(2.75)


def test_critical_trip_counts_only_without_a_passive_one(tmp_path: Path) -> None:
    thermal = tmp_path / "sys/class/thermal"
    _write(thermal / "thermal_zone0/type", "acpitz")
    _write(thermal / "thermal_zone0/temp", "60000")
    _write(thermal / "thermal_zone0/trip_point_0_type", "critical")
    _write(thermal / "thermal_zone0/trip_point_0_temp", "100000")
    assert HostSysfs(tmp_path).read(0).thermal_margin_c == pytest.approx(40.0)
    # A passive trip above the critical one still wins: it is where the CPU gets slowed down.
    _write(thermal / "thermal_zone0/trip_point_1_type", "passive")
    _write(thermal / "thermal_zone0/trip_point_1_temp", "102000")
    assert HostSysfs(tmp_path).read(0).thermal_margin_c == pytest.approx(42.0)


def test_zones_without_usable_trips_give_no_margin(tmp_path: Path) -> None:
    _tree(tmp_path)  # two zones, no trip points at all
    thermal = tmp_path / "sys/class/thermal"
    _write(thermal / "thermal_zone2/type", "x86_pkg_temp")
    _write(thermal / "thermal_zone2/temp", "50000")
    _write(thermal / "thermal_zone2/trip_point_0_type", "passive")
    _write(thermal / "thermal_zone2/trip_point_0_temp", "0")  # disabled
    _write(thermal / "thermal_zone2/trip_point_1_type", "active")  # a fan step, not a throttle point
    _write(thermal / "thermal_zone2/trip_point_1_temp", "70000")
    sysfs = HostSysfs(tmp_path)
    readings = sysfs.read(0)
    assert len(readings.zone_temps_c) == 3
    assert readings.thermal_margin_c is None
    assert readings.cpu_mhz is None
    assert "thermal_margin_c" not in sysfs_fields(readings)


def test_host_collector_uses_sysfs_clock_and_calls_on_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tree(tmp_path)
    _trips_and_clocks(tmp_path)
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 62.5)
    reads: list[tuple[float, HostThrottleReading]] = []
    ticks = iter([100.0, 101.5])
    collector = HostCollector(
        list, spool, root=tmp_path, on_read=lambda t, r: reads.append((t, r)), clock=lambda: next(ticks)
    )
    host = next(s for s in collector.collect(10 * S) if s.measurement == "host")
    assert host.fields["cpu_freq_mhz"] == pytest.approx(2750.0)
    assert host.fields["cpu_freq_max_mhz"] == pytest.approx(4500.0)
    assert host.fields["thermal_margin_c"] == pytest.approx(18.5)
    _write(tmp_path / "sys/devices/system/cpu/cpu1/thermal_throttle/core_throttle_count", "14")
    collector.collect(11 * S)
    # Exact in binary: 90.0 - 71.5 and 2750000 kHz / 1000.
    assert reads == [
        (100.0, HostThrottleReading(2750.0, 60, 201, 18.5, 62.5)),
        (101.5, HostThrottleReading(2750.0, 64, 201, 18.5, 62.5)),
    ]


def test_host_collector_falls_back_to_psutil_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(
        psutil, "cpu_freq", lambda percpu=False: SimpleNamespace(current=1234.0, min=0.0, max=0.0)
    )
    reads: list[HostThrottleReading] = []
    collector = HostCollector(list, spool, root=tmp_path, on_read=lambda _t, r: reads.append(r))
    host = next(s for s in collector.collect(S) if s.measurement == "host")
    assert host.fields["cpu_freq_mhz"] == 1234.0
    assert "cpu_freq_max_mhz" not in host.fields
    assert "thermal_margin_c" not in host.fields
    assert reads[0].cpu_mhz == 1234.0
    assert reads[0].core_throttle_total is None
    assert reads[0].thermal_margin_c is None


def test_host_collector_reports_its_own_and_the_engines_cpu(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    # A real child process that burns CPU stands in for the engine; soakd's own share is this process.
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t = [0.0]
        # As an in-process engine reports them: soakd's own pid among the engine's.
        pids = [os.getpid(), burner.pid]
        collector = HostCollector(lambda: pids, spool, root=tmp_path, clock=lambda: t[0])
        wall0 = time.monotonic()
        collector.collect(1 * S)  # primes; first sight of the engine process: its CPU counts from here
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        time.sleep(0.5)
        t[0] = 1.0
        host = next(s for s in collector.collect(2 * S) if s.measurement == "host")
        # One process can use at most one core for the real time the two reads spanned (more than the
        # fake second on a busy machine); the 1 % is psutil's tick rounding.
        most = 100.0 * (time.monotonic() - wall0) + 1.0
        # 0.3 s of this process's CPU in one (fake) second; the burner ran flat out for ~0.8 s.
        assert 25.0 <= float(host.fields["soakd_cpu_percent"]) <= most
        assert float(host.fields["soakd_cpu_seconds"]) >= 0.3
        # The burner alone: this process's 0.3 s are soakd's, not counted twice. On a busy machine the
        # burner gets less than a core: at least a tenth of the span it had.
        assert 10.0 <= float(host.fields["engine_cpu_percent"]) <= most
        assert host.fields["engine_procs"] == 2
        collector.close()
    finally:
        burner.kill()
        burner.wait()


def test_soakd_cpu_pct_sums_each_process_and_skips_the_gap_of_a_resume() -> None:
    from soakd.judge.metrics import RunMetrics
    from soakd.metric import Sample

    m = RunMetrics()
    # First process: 10 s of CPU over 20 s. A crash, 30 s down; the resumed process starts with 25 s of
    # CPU already (imports, its engine start): more than the first one had, so only the gap tells.
    for t, cpu in [(0, 5.0), (10, 10.0), (20, 15.0), (50, 40.0), (60, 42.0), (70, 44.0)]:
        m.add(Sample("host", {"soakd_cpu_seconds": cpu}, t * 10**9))
    # (10 + 4) CPU seconds over (20 + 20) wall seconds; the 30 s down and its 25 s jump are not counted.
    assert m.scalar("soakd_cpu_pct") == pytest.approx(100.0 * 14 / 40)


def test_soakds_helper_processes_count_as_soakds_own(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    # A real child burning CPU stands in for the HTTP sender process: soakd's, not the engine's.
    helper = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t = [0.0]
        collector = HostCollector(
            list, spool, root=tmp_path, clock=lambda: t[0], helper_pids=lambda: [helper.pid]
        )
        first = next(s for s in collector.collect(1 * S) if s.measurement == "host")
        # The helper's own CPU between the two reads, by psutil beside the collector: however busy the
        # machine, it is what soakd's figure must hold at least.
        burner = psutil.Process(helper.pid)
        c1 = sum(burner.cpu_times()[:2])
        deadline = time.monotonic() + 120  # a hang guard only
        while sum(burner.cpu_times()[:2]) - c1 < 0.2 and time.monotonic() < deadline:
            time.sleep(0.01)
        c2 = sum(burner.cpu_times()[:2])
        t[0] = 1.0
        host = next(s for s in collector.collect(2 * S) if s.measurement == "host")
        own = psutil.Process().memory_info().rss
        assert int(host.fields["soakd_rss_bytes"]) > own  # this process's and the helper's
        assert c2 - c1 >= 0.2
        # Equal is possible (CPU times come in 10 ms ticks, this process may add none): a float sum's
        # rounding (0.8 - 0.6000000000000001 against 0.2) is not a shortfall.
        helper_s = c2 - c1 - 1e-9
        assert float(host.fields["soakd_cpu_seconds"]) - float(first.fields["soakd_cpu_seconds"]) >= helper_s
        assert float(host.fields["soakd_cpu_percent"]) >= 100.0 * helper_s  # over the one (fake) second
        assert host.fields["engine_procs"] == 0 and "engine_cpu_percent" in host.fields
        assert float(host.fields["engine_cpu_percent"]) == 0.0
        collector.close()
    finally:
        helper.kill()
        helper.wait()
