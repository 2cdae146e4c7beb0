"""Record raw NVML readings of every GPU to JSONL, for replaying real GPU behaviour in tests.

Fast tier (default 10 Hz): the microsecond calls (clocks, clock-event reasons, power, temperature,
memory, utilization, pstate). Slow tier (default 1 Hz): energy, thermal margin and the violation
counters (field values 74-81, 269-271, decoded by their value type). Unsupported readings are null.

    python scripts/record_nvml.py --seconds 120 --out nvml.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import pynvml

FIELD_IDS = [74, 75, 76, 77, 78, 79, 80, 81, 269, 270, 271]


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except pynvml.NVMLError:
        return None


def _field_value(v: Any) -> int | float | None:
    if v.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    kind = v.valueType
    if kind == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(v.value.dVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return int(v.value.uiVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(v.value.ulVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(v.value.sllVal)
    return int(v.value.ullVal)


def fast(h: Any) -> dict[str, Any]:
    mem = _try(lambda: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2))
    util = _try(lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
    return {
        "sm_mhz": _try(lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
        "mem_mhz": _try(lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
        "reasons": _try(lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
        "power_mw": _try(lambda: pynvml.nvmlDeviceGetPowerUsage(h)),
        "temp_c": _try(lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
        "mem_used": mem.used if mem else None,
        "mem_total": mem.total if mem else None,
        "util_gpu": util.gpu if util else None,
        "util_mem": util.memory if util else None,
        "pstate": _try(lambda: pynvml.nvmlDeviceGetPerformanceState(h)),
    }


def _margin(h: Any) -> int:
    # Older bindings return the struct, newer ones the plain integer.
    value = pynvml.nvmlDeviceGetMarginTemperature(h)
    return int(getattr(value, "margin", value))


def slow(h: Any) -> dict[str, Any]:
    values = _try(lambda: pynvml.nvmlDeviceGetFieldValues(h, FIELD_IDS)) or []
    return {
        "energy_mj": _try(lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h)),
        "margin_c": _try(lambda: _margin(h)),
        "fields": {str(f): _field_value(v) for f, v in zip(FIELD_IDS, values, strict=False)},
    }


def static(h: Any) -> dict[str, Any]:
    return {
        "name": _try(lambda: pynvml.nvmlDeviceGetName(h)),
        "max_sm_mhz": _try(lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
        "max_mem_mhz": _try(lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)),
        "power_limit_mw": _try(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--hz", type=float, default=10.0)
    p.add_argument("--slow-every", type=int, default=10, help="slow tier every N fast samples")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        with open(args.out, "w", encoding="utf-8") as out:  # noqa: PTH123
            header = {
                "driver": pynvml.nvmlSystemGetDriverVersion(),
                "gpus": [static(h) for h in handles],
            }
            out.write(json.dumps({"header": header}) + "\n")
            period = 1.0 / args.hz
            t0 = time.monotonic()
            n = 0
            # Sleep to absolute deadlines so the sampling rate does not drift.
            while (now := time.monotonic()) - t0 < args.seconds:
                row: dict[str, Any] = {"t": round(now - t0, 4), "wall_ns": time.time_ns()}
                row["gpus"] = [fast(h) for h in handles]
                if n % args.slow_every == 0:
                    for g, h in zip(row["gpus"], handles, strict=True):
                        g.update(slow(h))
                out.write(json.dumps(row) + "\n")
                n += 1
                time.sleep(max(0.0, t0 + n * period - time.monotonic()))
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    main()
