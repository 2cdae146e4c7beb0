"""NVML's constant tables soakd reads: the clock-event (throttle) reason bits and the cumulative
throttle-time counters. Pure data with no imports, shared by the GPU collector that reads them and the
throttle policy that judges them."""

from __future__ import annotations

REASON_BITS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
"""Clock-event (throttle) reason bits, as nvmlDeviceGetCurrentClocksEventReasons reports them."""

THROTTLE_COUNTERS: tuple[tuple[int, str], ...] = (
    (74, "power"),  # NVML_FI_DEV_PERF_POLICY_POWER (= ..._CLOCKS_EVENT_REASON_SW_POWER_CAP)
    (75, "thermal"),  # NVML_FI_DEV_PERF_POLICY_THERMAL
    (76, "sync_boost"),  # NVML_FI_DEV_PERF_POLICY_SYNC_BOOST
    (77, "board_limit"),  # NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT
    (78, "low_util"),  # NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION
    (79, "reliability"),  # NVML_FI_DEV_PERF_POLICY_RELIABILITY
    (80, "total_app_clocks"),  # NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS
    (81, "total_base_clocks"),  # NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS
    (269, "sw_thermal"),  # NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN
    (270, "hw_thermal"),  # NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN
    (271, "hw_power_brake"),  # NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN
)
"""Cumulative throttle-time counters (ns, monotonic until the driver reloads): field id, name.
The collector writes each one's growth per interval as `throttle_<name>_s`."""
