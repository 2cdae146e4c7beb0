"""The host collector's sysfs signals over a fake sysfs tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from soakd.collectors.host import HostCollector, HostSysfs, sysfs_fields

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
