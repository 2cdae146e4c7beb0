"""The NVML collector over a real H200 recording (idle, a vLLM soak, then a matmul burn at the 700 W
cap), and the live source over a fake pynvml module: unsupported readings, old drivers, 64-bit field
values, counter resets, HwSlowdown blips; the recorder's round trip and atomicity."""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from soakd.collectors.base import RefreshingCollector
from soakd.collectors.nvml import (
    GPM_KEYS,
    GpuStatic,
    LiveNvml,
    NvmlCollector,
    RecordedNvml,
    decode_reasons,
)
from soakd.collectors.nvml_record import record
from soakd.metric import Sample
from soakd.testing import H200_MEMORY, H200_UUID, FakeNvml, ManualClock

RECORDING = Path(__file__).resolve().parents[2] / "data" / "h200" / "nvml_soak_then_matmul_burn.jsonl.gz"
FIELD_74_GROWTH_NS = 25_349_273_696  # last slow line's field 74 minus the first's (0)


# -- the real recording ----------------------------------------------------------------------------


def _replay(interval_s: float = 5.0) -> list[Sample]:
    clock = ManualClock()
    source = RecordedNvml(RECORDING, clock)
    col = NvmlCollector(source)
    per_point = round(interval_s * 10)
    points: list[Sample] = []
    k = 0
    while not source.finished:
        clock.now = k * 0.1 + 0.05  # between recorded lines (t jitters by < 3 ms)
        if source.finished:
            break
        col.sample_fast(clock.now)
        if k % 10 == 0:
            col.sample_slow()
        k += 1
        if k % per_point == 0:
            points.extend(col.collect(int(clock.now * 1e9)))
    points.extend(col.collect(int(clock.now * 1e9)))
    return points


@pytest.fixture(scope="module")
def points() -> list[Sample]:
    return _replay()


def test_recorded_source_reads_header_and_lines() -> None:
    clock = ManualClock(100.0)
    src = RecordedNvml(RECORDING, clock)
    assert src.gpu_count() == 1 and src.driver_version() == "580.159.04"
    st = src.static(0)
    assert st.name == "NVIDIA H200" and st.max_sm_mhz == 1980 and st.power_limit_mw == 700_000
    assert st.mem_total == 150_754_820_096
    assert src.fast(0)["reasons"] == 1 and src.slow(0)["fields"]["74"] == 0
    clock.now += 180.0
    assert src.fast(0)["reasons"] == 4
    assert not src.finished
    clock.now += 30.0
    assert src.finished


def test_burn_points_show_power_cap_and_clock_loss(points: list[Sample]) -> None:
    assert all(p.measurement == "gpu" and p.tags == {"gpu": "0"} for p in points)
    by_start = {round(float(p.time_ns) / 1e9 - 4.95): p.fields for p in points}
    burn = [by_start[s] for s in (175, 180, 185, 190)]
    for f in burn:
        assert f["reason_sw_power_cap_share"] == pytest.approx(1.0)
        assert f["reasons_or"] == 4
        assert isinstance(f["sm_clock_ratio"], float) and f["sm_clock_ratio"] < 0.8
        assert f["sm_clock_ratio_min"] <= f["sm_clock_ratio"]
        assert f["power_w_max"] <= 710.0 and f["power_w_mean"] > 600.0
        assert f["power_limit_w"] == 700.0
        # The power-violation counter grows by about the interval's length while capped.
        assert f["throttle_power_s"] == pytest.approx(5.0, abs=0.2)
        assert f["samples"] == 50 and f["interval_s"] == pytest.approx(5.0)
        assert f["hw_slowdown_blips"] == 0 and f["reason_hw_slowdown_share"] == 0.0
    for start in (0, 20, 50):  # idle before the engine starts
        f = by_start[start]
        assert f["reason_gpu_idle_share"] == 1.0 and f["reason_sw_power_cap_share"] == 0.0
        assert f["sm_mhz_max"] == 345 and f["throttle_power_s"] == 0.0
        assert decode_reasons(int(f["reasons_or"])) == ["gpu_idle"]


def test_throttle_power_deltas_sum_to_the_recorded_counter_growth(points: list[Sample]) -> None:
    total = sum(float(p.fields.get("throttle_power_s", 0.0)) for p in points)
    assert total == pytest.approx(FIELD_74_GROWTH_NS / 1e9, abs=1e-9)
    assert sum(int(p.fields["counter_resets"]) for p in points if "counter_resets" in p.fields) == 0
    energy = sum(float(p.fields.get("energy_j", 0.0)) for p in points)
    assert energy > 25 * 600  # at least the burn's 25 s near 700 W


def test_no_field_is_none_and_every_point_is_writable(points: list[Sample]) -> None:
    for p in points:
        assert all(v is not None for v in p.fields.values())
        assert p.to_line() is not None
    assert "hbm_temp_c_max" not in points[0].fields  # not in this recording: absent, not None


def test_collector_is_a_refreshing_collector() -> None:
    col = NvmlCollector(RecordedNvml(RECORDING, ManualClock()))
    assert isinstance(col, RefreshingCollector) and col.name == "gpu"


async def test_refresh_reads_the_slow_tier() -> None:
    clock = ManualClock()
    src = RecordedNvml(RECORDING, clock)
    col = NvmlCollector(src)
    await col.refresh()
    clock.now = 180.05
    col.sample_fast(clock.now)
    await col.refresh()
    (p,) = col.collect(1)
    assert float(p.fields["throttle_power_s"]) > 1.0


# -- the live source over a fake pynvml (soakd.testing.FakeNvml) ------------------------------------


class NewFakeNvml(FakeNvml):
    """A binding and driver with the clock-event reasons call (FakeNvml has only the old throttle one)."""

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: str) -> int:
        self.calls.append("event_reasons")
        return self.reasons.pop(0) if len(self.reasons) > 1 else self.reasons[0]


def test_not_supported_reading_is_absent_and_logged_once() -> None:
    nv = NewFakeNvml(unsupported={"power", "ecc"})
    with capture_logs() as logs:
        src = LiveNvml(nv)
        col = NvmlCollector(src)
        for k in range(5):
            col.sample_fast(k * 0.1)
            col.sample_slow()
        (p,) = col.collect(1_000)
    assert src.fast(0)["power_mw"] is None
    assert "power_w_mean" not in p.fields and "power_w_max" not in p.fields
    assert "ecc_corrected" not in p.fields and "ecc_uncorrected" not in p.fields
    assert p.fields["sm_mhz_mean"] == 1485.0 and p.fields["sm_clock_ratio"] == 0.75
    assert p.fields["hbm_temp_c_max"] == 55 and p.fields["thermal_margin_c"] == 30.0
    assert p.fields["mem_total_bytes"] == H200_MEMORY and p.fields["power_limit_w"] == 700.0
    assert all(v is not None for v in p.fields.values())
    power = [e for e in logs if e.get("reading") == "power"]
    assert len(power) == 1 and power[0]["not_supported"] is True and power[0]["gpu"] == 0
    assert len([e for e in logs if e.get("reading") == "ecc_corrected"]) == 1
    # Field 75 etc. are not reported by this fake: each logged once, then silent.
    assert len([e for e in logs if e.get("reading") == "field_75"]) == 1


def test_old_driver_falls_back_to_throttle_reasons() -> None:
    nv = FakeNvml(reasons=[4])
    assert not hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons")
    src = LiveNvml(nv)
    assert src.fast(0)["reasons"] == 4
    assert nv.calls == ["throttle_reasons"]


def test_new_binding_over_old_library_falls_back_too() -> None:
    class MissingSymbol(NewFakeNvml):
        def nvmlDeviceGetCurrentClocksEventReasons(self, h: str) -> int:
            self.calls.append("event_reasons")
            raise FakeNvml.NVMLError(13)  # NVML_ERROR_FUNCTION_NOT_FOUND

    nv = MissingSymbol(reasons=[1])
    src = LiveNvml(nv)
    assert src.fast(0)["reasons"] == 1 and src.fast(0)["reasons"] == 1
    assert nv.calls == ["event_reasons", "throttle_reasons", "throttle_reasons"]


def test_new_driver_uses_event_reasons() -> None:
    nv = NewFakeNvml(reasons=[4])
    assert LiveNvml(nv).fast(0)["reasons"] == 4 and nv.calls == ["event_reasons"]


def test_64_bit_field_values_decode_from_ullval() -> None:
    big = 2**33 + 5
    nv = NewFakeNvml(counters=[{74: big}, {74: big}, {74: big + 7_000_000_000}])
    src = LiveNvml(nv)
    col = NvmlCollector(src)
    assert src.slow(0)["fields"]["74"] == big  # not big & 0xffffffff
    col.sample_slow()
    col.sample_slow()
    (p,) = col.collect(1)
    assert p.fields["throttle_power_s"] == 7.0 and p.fields["counter_resets"] == 0


def test_fast_tier_makes_no_field_values_call_and_the_slow_tier_one() -> None:
    # A field-values call costs ~0.7 ms on an H200 whatever it asks for: never at 10 Hz, once per slow read.
    nv = NewFakeNvml(counters=[{74: 0}])
    src = LiveNvml(nv)
    for _ in range(10):
        src.fast(0)
    assert nv.field_calls == []
    r = src.slow(0)
    assert len(nv.field_calls) == 1 and 82 in nv.field_calls[0] and 83 in nv.field_calls[0]
    assert r["hbm_temp_c"] == 55 and r["energy_mj"] == 2_000_000 and r["fields"]["74"] == 0
    assert "energy" not in nv.calls  # field 83 served it


def test_fast_tier_reads_three_things_and_the_gauges_come_with_the_slow_tier() -> None:
    nv = NewFakeNvml(counters=[{74: 0}])
    src = LiveNvml(nv)
    assert set(src.fast(0)) == {"sm_mhz", "reasons", "power_mw"}
    slow = src.slow(0)
    assert (slow["temp_c"], slow["util_gpu"], slow["mem_used"], slow["pstate"]) == (60, 50, 1 << 30, 0)


def test_points_between_slow_reads_carry_the_last_gauges_but_no_counters() -> None:
    nv = NewFakeNvml(counters=[{74: 0}, {74: 10**9}])
    col = NvmlCollector(LiveNvml(nv))
    col.sample_fast(0.0)
    col.sample_slow()
    (first,) = col.collect(1)
    col.sample_fast(1.0)
    (between,) = col.collect(2)  # the slow tier (2 s) did not run in this 1 s interval
    col.sample_fast(2.0)
    col.sample_slow()
    (after,) = col.collect(3)
    for p in (first, between, after):
        assert p.fields["temp_c_max"] == 60 and p.fields["util_gpu_mean"] == 50.0
        assert p.fields["hbm_temp_c_max"] == 55 and p.fields["thermal_margin_c"] == 30.0
        assert p.fields["mem_used_bytes"] == 1 << 30 and p.fields["pstate"] == 0
    assert "counter_resets" not in between.fields and "throttle_power_s" not in between.fields
    assert after.fields["throttle_power_s"] == 1.0


def test_energy_is_read_on_every_nth_slow_read_and_its_sum_stays_exact() -> None:
    nv = NewFakeNvml(counters=[{74: 0}])
    col = NvmlCollector(LiveNvml(nv), energy_every=3)
    energy: list[float | None] = []
    for k in range(7):
        col.sample_fast(k * 1.0)
        col.sample_slow()
        (p,) = col.collect(k + 1)
        v = p.fields.get("energy_j")
        energy.append(None if v is None else float(v))
        assert p.fields["throttle_power_s"] == 0.0 if k else "throttle_power_s" not in p.fields
    assert [83 in c for c in nv.field_calls] == [True, False, False, True, False, False, True]
    # Read at slow reads 0, 3, 6: a delta on the 2nd and 3rd of those (1 J per read here), none between.
    assert energy == [None, None, None, 1.0, None, None, 1.0]
    with pytest.raises(ValueError):
        NvmlCollector(LiveNvml(NewFakeNvml()), energy_every=0)


def test_energy_falls_back_to_its_own_call_when_field_83_is_unsupported() -> None:
    nv = NewFakeNvml(unsupported={"energy_field"})
    with capture_logs() as logs:
        src = LiveNvml(nv)
        first, second = src.slow(0), src.slow(0)
    assert first["energy_mj"] == second["energy_mj"] == 1_000_000
    assert nv.calls.count("energy") == 2
    assert 83 in nv.field_calls[0] and 83 not in nv.field_calls[1]  # asked once, then not again
    assert not [e for e in logs if e.get("reading") == "field_83"]  # a fallback, not a missing reading


def test_counter_going_down_is_a_reset() -> None:
    s = 1_000_000_000
    nv = NewFakeNvml(counters=[{74: 10 * s, 270: 0}, {74: 12 * s, 270: 0}, {74: 1 * s, 270: 0}])
    col = NvmlCollector(LiveNvml(nv))
    col.sample_fast(0.0)
    col.sample_slow()
    (first,) = col.collect(1)
    assert "throttle_power_s" not in first.fields  # a baseline, no growth yet
    col.sample_fast(0.1)
    col.sample_slow()
    col.sample_slow()
    (p,) = col.collect(2)
    assert p.fields["throttle_power_s"] == 3.0  # 2 s, then 1 s since the reload
    assert p.fields["throttle_hw_thermal_s"] == 0.0
    assert p.fields["counter_resets"] == 1 and col.counter_resets_total == 1
    assert "throttle_thermal_s" not in p.fields  # field 75 unsupported here


def test_single_hw_slowdown_sample_is_a_blip_not_sustained() -> None:
    # one isolated HwSlowdown (with a power cap), then a sustained run of three
    nv = NewFakeNvml(reasons=[0, 0x8 | 0x4, 0, 0, 0x8, 0x8, 0x8, 0, 0, 0])
    col = NvmlCollector(LiveNvml(nv))
    for k in range(10):
        col.sample_fast(k * 0.1)
    (p,) = col.collect(1)
    assert p.fields["hw_slowdown_blips"] == 1
    assert p.fields["reason_hw_slowdown_share"] == pytest.approx(3 / 10)
    assert p.fields["reason_sw_power_cap_share"] == pytest.approx(1 / 10)
    assert p.fields["reasons_or"] == 0xC and p.fields["samples"] == 10


def test_hw_slowdown_run_across_intervals() -> None:
    nv = NewFakeNvml(reasons=[0, 0x8, 0x8, 0])
    col = NvmlCollector(LiveNvml(nv))
    col.sample_fast(0.0)
    col.sample_fast(0.1)
    (a,) = col.collect(1)
    assert a.fields["hw_slowdown_blips"] == 0 and a.fields["reason_hw_slowdown_share"] == 0.0
    col.sample_fast(0.2)
    col.sample_fast(0.3)
    (b,) = col.collect(2)
    assert b.fields["hw_slowdown_blips"] == 0 and b.fields["reason_hw_slowdown_share"] == 1.0


def test_watched_process_memory_and_close() -> None:
    nv = NewFakeNvml()
    src = LiveNvml(nv, pids=lambda: [42])
    assert src.slow(0)["proc_mem"] == {"42": 5 << 30}
    assert src.static(0) == GpuStatic("NVIDIA H200", H200_UUID, 1980, 3201, 700_000, H200_MEMORY)
    col = NvmlCollector(src)
    col.sample_slow()
    (p,) = col.collect(1)
    assert p.fields["proc_mem_bytes"] == 5 << 30 and p.fields["samples"] == 0
    col.close()
    assert nv.calls[-1] == "shutdown"


def test_other_processes_on_the_gpu_are_known_only_where_the_engines_own_pid_is_listed() -> None:
    """The fake lists PIDs 42 (5 GiB) and 7: with the engine as 42, 7 is a co-tenant; with the engine
    as a PID NVML does not list (a container's namespace hides the host's PIDs), who the others are is
    unknown, and no point claims none."""
    src = LiveNvml(NewFakeNvml(), pids=lambda: [42])
    r = src.slow(0)
    assert r["proc_mem"] == {"42": 5 << 30} and r["foreign_procs"] == {"7": 1}
    col = NvmlCollector(src)
    col.sample_slow()
    (p,) = col.collect(1)
    assert p.fields["foreign_procs"] == 1 and p.fields["foreign_mem_bytes"] == 1
    hidden = LiveNvml(NewFakeNvml(), pids=lambda: [99])
    assert hidden.slow(0)["foreign_procs"] is None
    col = NvmlCollector(hidden)
    col.sample_slow()
    (q,) = col.collect(1)
    assert "foreign_procs" not in q.fields and "foreign_mem_bytes" not in q.fields
    assert LiveNvml(NewFakeNvml(), pids=lambda: []).slow(0)["foreign_procs"] is None


def test_a_pid_that_is_or_was_the_engines_is_never_a_cotenant() -> None:
    """A worker started between the engine's PIDs read and NVML's list (it is the engine's when asked
    again after the list), and an engine process orphaned by a crash (no longer the engine's, still
    listed while it releases its context), are the engine's own, not another process."""
    calls = {"n": 0}

    def late_worker() -> list[int]:
        calls["n"] += 1
        return [42] if calls["n"] == 1 else [42, 7]

    assert LiveNvml(NewFakeNvml(), pids=late_worker).slow(0)["foreign_procs"] == {}
    pids = [[42, 7]]
    orphaned = LiveNvml(NewFakeNvml(), pids=lambda: pids[0])
    assert orphaned.slow(0)["foreign_procs"] == {}
    pids[0] = [42]  # 7 is no longer the engine's, but was
    r = orphaned.slow(0)
    assert r["foreign_procs"] == {} and r["proc_mem"] == {"42": 5 << 30}


# -- GPM (Hopper and newer) --------------------------------------------------------------------------


@dataclass
class GpmFakeNvml(NewFakeNvml):
    """GPM calls as pynvml names them: two sample buffers, a metrics query filled per pair of samples.
    Each metric's value is its id plus 10 x the samples taken so far, so a span's values are known."""

    NVML_GPM_METRICS_GET_VERSION = 1
    gpm_supported: bool = True
    gpm_error: int | None = None
    """Raise this NVML error from nvmlGpmSampleGet (after `gpm_ok_samples` good ones)."""
    gpm_ok_samples: int = 0
    unsupported_metrics: set[int] = field(default_factory=set)
    samples: list[str] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    taken: int = 0

    def nvmlGpmQueryDeviceSupport(self, h: str) -> Any:
        self.calls.append("gpm_support")
        if self.gpm_error is not None and self.gpm_ok_samples < 0:
            raise FakeNvml.NVMLError(self.gpm_error)
        return SimpleNamespace(version=1, isSupportedDevice=int(self.gpm_supported))

    def nvmlGpmSampleAlloc(self) -> str:
        self.samples.append(f"s{len(self.samples)}")
        return self.samples[-1]

    def nvmlGpmSampleFree(self, sample: str) -> None:
        self.freed.append(sample)

    def nvmlGpmSampleGet(self, h: str, sample: str) -> str:
        if self.gpm_error is not None and self.taken >= self.gpm_ok_samples:
            raise FakeNvml.NVMLError(self.gpm_error)
        self.taken += 1
        self.calls.append(f"gpm_sample {sample}")
        return sample

    @staticmethod
    def c_nvmlGpmMetricsGet_t() -> Any:
        metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)]
        return SimpleNamespace(version=0, numMetrics=0, sample1=None, sample2=None, metrics=metrics)

    def nvmlGpmMetricsGet(self, q: Any) -> Any:
        assert q.version == 1 and q.sample1 != q.sample2
        self.calls.append(f"gpm_metrics {q.sample1}->{q.sample2}")
        for m in q.metrics[: q.numMetrics]:
            if m.metricId in self.unsupported_metrics:
                m.nvmlReturn, m.value = self.NVML_ERROR_NOT_SUPPORTED, 0.0
            elif self.taken == 3:
                m.nvmlReturn, m.value = 0, math.nan  # a span of no time (samples moments apart)
            else:
                m.nvmlReturn, m.value = 0, float(m.metricId + 10 * self.taken)
        return q


def test_gpm_metrics_between_consecutive_slow_samples() -> None:
    nv = GpmFakeNvml(unsupported_metrics={3})
    with capture_logs() as logs:
        src = LiveNvml(nv)
        first = src.slow(0)
        second = src.slow(0)
        third = src.slow(0)
    assert {k: first[k] for k in GPM_KEYS} == dict.fromkeys(GPM_KEYS)  # no span yet
    # Two buffers, reused in turn: each span runs from the previous read's sample to this one's.
    assert [c for c in nv.calls if c.startswith("gpm")] == [
        "gpm_support",
        "gpm_sample s1",
        "gpm_sample s0",
        "gpm_metrics s1->s0",
        "gpm_sample s1",
        "gpm_metrics s0->s1",
    ]
    assert second["gpm_dram_bw_pct"] == 10.0 + 20 and second["gpm_sm_util_pct"] == 2.0 + 20
    assert second["gpm_tensor_pct"] == 5.0 + 20 and second["gpm_hmma_pct"] == 7.0 + 20
    assert second["gpm_sm_occupancy_pct"] is None and third["gpm_dram_bw_pct"] is None  # NaN: left out
    assert len([e for e in logs if e.get("reading") == "gpm_sm_occupancy_pct"]) == 1
    assert src.gpm_unavailable == {}
    col = NvmlCollector(src)
    col.sample_slow()  # the 4th sample: DRAM 10 + 40
    col.sample_slow()  # the 5th: 10 + 50
    (p,) = col.collect(1)
    assert p.fields["gpm_dram_bw_pct"] == 10.0 + 45 and p.fields["gpm_tensor_pct"] == 5.0 + 45
    assert "gpm_sm_occupancy_pct" not in p.fields and col.gpm_dram_bw_pct() == 10.0 + 50
    col.sample_fast(0.1)
    (carried,) = col.collect(2)  # no slow read in this interval: the last span's shares
    assert carried.fields["gpm_dram_bw_pct"] == 10.0 + 50 and "counter_resets" not in carried.fields
    col.close()
    assert sorted(nv.freed) == ["s0", "s1"] and nv.calls[-1] == "shutdown"


def test_gpm_not_supported_is_said_once_and_the_collector_carries_on() -> None:
    nv = GpmFakeNvml(gpm_supported=False)
    with capture_logs() as logs:
        src = LiveNvml(nv)
        col = NvmlCollector(src)
        for k in range(3):
            col.sample_fast(k * 0.1)
            col.sample_slow()
        (p,) = col.collect(1)
    off = [e for e in logs if e["event"] == "nvml_gpm_unavailable"]
    assert len(off) == 1 and "not supported" in off[0]["reason"] and off[0]["gpu"] == 0
    assert nv.calls.count("gpm_support") == 1 and nv.samples == []
    assert not any(k.startswith("gpm_") for k in p.fields) and p.fields["sm_mhz_mean"] == 1485.0
    assert col.gpm_dram_bw_pct() is None


def test_gpm_errors_turn_it_off_and_free_the_samples() -> None:
    # NOT_SUPPORTED from the sampling itself (a vGPU, MIG without the instance call): off, once, freed.
    nv = GpmFakeNvml(gpm_error=FakeNvml.NVML_ERROR_NOT_SUPPORTED, gpm_ok_samples=1)
    with capture_logs() as logs:
        src = LiveNvml(nv)
        assert src.slow(0)["gpm_dram_bw_pct"] is None
        r = src.slow(0)
        src.slow(0)
    assert r["gpm_dram_bw_pct"] is None and r["hbm_temp_c"] == 55  # the rest of the read is whole
    assert sorted(nv.freed) == ["s0", "s1"] and "NVML error 3" in src.gpm_unavailable[0]
    assert len([e for e in logs if e["event"] == "nvml_gpm_unavailable"]) == 1
    src.close()
    assert sorted(nv.freed) == ["s0", "s1"]  # not freed twice
    # The support query itself failing, and a pynvml without GPM: the same, with the reason.
    failing = GpmFakeNvml(gpm_error=FakeNvml.NVML_ERROR_NOT_SUPPORTED, gpm_ok_samples=-1)
    src = LiveNvml(failing)
    assert src.slow(0)["gpm_dram_bw_pct"] is None and failing.samples == []
    assert "NVML error 3" in src.gpm_unavailable[0]
    old = LiveNvml(NewFakeNvml())
    old.slow(0)
    assert "nvmlGpmQueryDeviceSupport" in old.gpm_unavailable[0]


# -- the recorder ----------------------------------------------------------------------------------


def test_record_round_trip(tmp_path: Path) -> None:
    clock = ManualClock()
    orig = RecordedNvml(RECORDING, clock)
    clock.now = 170.05  # idle, then the start of the burn; between recorded lines
    out = tmp_path / "rec.jsonl.gz"
    counts = record(orig, 8.0, out, clock=clock, sleep=clock.sleep, wall_ns=lambda: 7)
    assert (counts.fast_samples, counts.slow_samples, counts.missed, counts.gpus) == (80, 8, 0, 1)
    assert not list(tmp_path.glob(".*"))  # no temp file left
    with gzip.open(out, "rt") as f:
        header = json.loads(f.readline())["header"]
    assert header["driver"] == "580.159.04" and header["gpus"][0]["max_sm_mhz"] == 1980

    clock2 = ManualClock()
    back = RecordedNvml(out, clock2)
    assert back.static(0) == orig.static(0)
    for k in range(80):
        clock.now = 170.05 + k * 0.1 + 0.001
        clock2.now = k * 0.1 + 0.001
        assert back.fast(0) == orig.fast(0)
        if k % 10 == 0:
            assert back.slow(0) == orig.slow(0)
    assert back.duration_s == pytest.approx(7.9)


def test_record_plain_jsonl_and_replays_through_the_collector(tmp_path: Path) -> None:
    clock = ManualClock()
    src = RecordedNvml(RECORDING, clock)
    clock.now = 180.0
    out = tmp_path / "burn.jsonl"
    record(src, 3.0, out, fast_hz=10.0, slow_hz=2.0, clock=clock, sleep=clock.sleep)
    lines = out.read_text().splitlines()
    assert len(lines) == 31 and sum("fields" in line for line in lines) == 6
    clock2 = ManualClock()
    col = NvmlCollector(RecordedNvml(out, clock2))
    for k in range(30):
        clock2.now = k * 0.1 + 0.01
        col.sample_fast(clock2.now)
        col.sample_slow()
    (p,) = col.collect(1)
    assert p.fields["reason_sw_power_cap_share"] == 1.0
    # capped throughout: the counter grows by the span between the first and the last slow reading
    assert 2.0 < float(p.fields["throttle_power_s"]) < 3.1


def test_record_counts_missed_slots_when_reads_overrun(tmp_path: Path) -> None:
    clock = ManualClock()
    src = RecordedNvml(RECORDING, clock)

    class Slow:
        def __getattr__(self, name: str) -> Any:
            return getattr(src, name)

        def fast(self, i: int) -> dict[str, Any]:
            clock.now += 0.25  # a read that takes two and a half slots
            return src.fast(i)

    counts = record(Slow(), 2.0, tmp_path / "r.jsonl", clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert counts.missed > 0 and counts.fast_samples + counts.missed <= 21


def test_record_is_atomic(tmp_path: Path) -> None:
    clock = ManualClock()
    src = RecordedNvml(RECORDING, clock)

    class Failing:
        def __getattr__(self, name: str) -> Any:
            return getattr(src, name)

        def slow(self, i: int) -> dict[str, Any]:
            if clock.now > 2.0:
                raise RuntimeError("GPU fell off the bus")
            return src.slow(i)

    out = tmp_path / "rec.jsonl.gz"
    with pytest.raises(RuntimeError):
        record(Failing(), 10.0, out, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
