"""Cost of soakd's GPU telemetry on a real GPU: per NVML call, and the collector as the daemon runs it.

Prints (and with --json writes) three things:
1. each NVML call soakd makes: median wall time and mean CPU time per call, over repeated calls;
2. the collector in the daemon's shape for --seconds: APScheduler interval jobs on an asyncio loop,
   the fast tier every 1/--fast-hz s on the loop timer the daemon uses, feeding the throttle detector,
   the slow tier every 1/--slow-hz s as an APScheduler job reading in a worker thread, one `collect`
   per second, and the XID/ECC event listener's thread; reported
   as CPU seconds of this process per wall second (% of one core), next to the same scheduler with
   empty jobs (what the loop costs without NVML), so the difference is NVML's and soakd's work;
3. `nvidia-smi -q -x` per sample (wall, and CPU of the child), the tool people poll otherwise.

Needs NVML (nvidia-ml-py and a GPU). Run by hand:
`python benchmarks/bench_nvml.py --seconds 60 [--json out.json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.nvml import COUNTER_FIELD_IDS, SLOW_FIELD_IDS, LiveNvml, NvmlCollector
from soakd.collectors.nvml_events import GpuEventListener
from soakd.ticker import Ticker


def per_call(nv: Any, reps: int) -> list[dict[str, Any]]:
    """Median wall and mean CPU microseconds of each NVML call on GPU 0."""
    h = nv.nvmlDeviceGetHandleByIndex(0)
    mem_v2 = getattr(nv, "nvmlMemory_v2", None)
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
        nv.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    calls: list[tuple[str, str, Callable[[], object]]] = [
        ("fast", "clock SM", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
        ("fast", "clock MEM", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
        ("fast", "clock-event reasons", lambda: reasons(h)),
        ("fast", "power usage", lambda: nv.nvmlDeviceGetPowerUsage(h)),
        ("fast", "temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        ("fast", "memory info v2", lambda: nv.nvmlDeviceGetMemoryInfo(h, version=mem_v2)),
        ("fast", "utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h)),
        ("fast", "pstate", lambda: nv.nvmlDeviceGetPerformanceState(h)),
        (
            "slow",
            f"field values x{len(SLOW_FIELD_IDS)}",
            lambda: nv.nvmlDeviceGetFieldValues(h, list(SLOW_FIELD_IDS)),
        ),
        ("slow", "margin temperature", lambda: nv.nvmlDeviceGetMarginTemperature(h)),
        ("slow", "ECC total (corrected)", lambda: nv.nvmlDeviceGetTotalEccErrors(h, 0, nv.NVML_VOLATILE_ECC)),
        (
            "slow",
            "ECC total (uncorrected)",
            lambda: nv.nvmlDeviceGetTotalEccErrors(h, 1, nv.NVML_VOLATILE_ECC),
        ),
        ("slow", "remapped rows", lambda: nv.nvmlDeviceGetRemappedRows(h)),
        ("slow", "compute processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h)),
        ("ref", "field value HBM temp (82) alone", lambda: nv.nvmlDeviceGetFieldValues(h, [82])),
        (
            "ref",
            f"field values counters x{len(COUNTER_FIELD_IDS)}",
            lambda: nv.nvmlDeviceGetFieldValues(h, list(COUNTER_FIELD_IDS)),
        ),
        ("ref", "total energy call", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h)),
    ]
    rows = []
    for tier, name, fn in calls:
        walls: list[float] = []
        err = ""
        cpu0 = time.process_time()
        n = 0
        for _ in range(reps):
            t0 = time.perf_counter()
            try:
                fn()
            except nv.NVMLError as e:  # reported, not fatal: a GPU may not support one call
                err = str(e)
                break
            walls.append(time.perf_counter() - t0)
            n += 1
        cpu = time.process_time() - cpu0
        rows.append(
            {
                "tier": tier,
                "call": name,
                "n": n,
                "wall_us_median": 1e6 * statistics.median(walls) if walls else None,
                "cpu_us_mean": 1e6 * cpu / n if n else None,
                "error": err,
            }
        )
    return rows


PARTS = ("fast", "slow", "xid")


class _CachedFast:
    """The fast tier's Python work alone: every fast read returns the first real one (no NVML call)."""

    def __init__(self, src: LiveNvml) -> None:
        self._src = src
        self._fast = {i: src.fast(i) for i in range(src.gpu_count())}

    def fast(self, i: int) -> dict[str, Any]:
        return self._fast[i]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._src, name)


def daemon_shape(
    nv: Any | None, seconds: float, fast_hz: float, slow_hz: float, energy_every: int, parts: tuple[str, ...]
) -> dict[str, Any]:
    """CPU share of this process running the GPU jobs as the daemon schedules them. Jobs of the tiers not
    in `parts` (fast, slow, xid) run empty, so the differences between runs break the cost down;
    `fast-cached` runs the fast tier's Python work on a cached reading (no NVML call)."""

    async def main() -> dict[str, Any]:
        scheduler = AsyncIOScheduler(
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30}
        )
        counts = {"fast": 0, "slow": 0, "collect": 0, "events": 0}
        listener: GpuEventListener | None = None
        col: NvmlCollector | None = None
        watch: GpuThrottleWatch | None = None
        if nv is not None:
            src: Any = LiveNvml(nv)
            if "fast-cached" in parts:
                src = _CachedFast(src)
            watch = GpuThrottleWatch(
                {i: src.static(i).max_sm_mhz for i in range(src.gpu_count())}, lambda *a, **k: None
            )
            col = NvmlCollector(src, on_fast=watch.observe, energy_every=energy_every)
            if "xid" in parts:

                def on_event(*a: object, **k: object) -> None:
                    counts["events"] += 1

                listener = GpuEventListener(nv, range(src.gpu_count()), on_event)
                listener.start()

        def fast() -> None:
            if col is not None and any(p.startswith("fast") for p in parts):
                col.sample_fast(time.monotonic())
            counts["fast"] += 1

        async def slow() -> None:
            if col is not None and "slow" in parts:
                await col.refresh()
            else:
                await asyncio.to_thread(lambda: None)
            counts["slow"] += 1

        async def collect() -> None:
            now = time.time_ns()
            if col is not None and watch is not None:
                col.collect(now)
                watch.collect(now)
            if listener is not None:
                listener.collect(now)
            counts["collect"] += 1

        ticker = Ticker("gpu_fast", 1 / fast_hz, fast)
        scheduler.add_job(slow, "interval", seconds=1 / slow_hz)
        scheduler.add_job(collect, "interval", seconds=1.0)
        await asyncio.sleep(0.5)  # imports and NVML init are not the steady state
        scheduler.start()
        ticker.start()
        await asyncio.sleep(2.0)  # past the first slow read and the thread pool's start
        c0, w0 = time.process_time(), time.perf_counter()
        base = dict(counts)
        await asyncio.sleep(seconds)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        done = {k: counts[k] - base[k] for k in counts}
        scheduler.shutdown(wait=False)
        ticker.stop()
        out: dict[str, Any] = {
            "parts": list(parts) if nv is not None else [],
            "wall_s": wall,
            "cpu_s": cpu,
            "cpu_share_pct": 100 * cpu / wall,
            **done,
        }
        if listener is not None:
            out["xid_listening"] = listener.available
            out["xid_reason"] = listener.reason
            out["xid_registered"] = listener.summary()["registered"]
            listener.stop()
        if col is not None:
            col.close()
        return out

    return asyncio.run(main())


def nvidia_smi(samples: int) -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    walls = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(samples):
        t0 = time.perf_counter()
        subprocess.run([exe, "-q", "-x"], capture_output=True, check=False)
        walls.append(time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "samples": samples,
        "wall_ms_median": 1e3 * statistics.median(walls),
        "wall_ms_min": 1e3 * min(walls),
        "cpu_ms_mean": 1e3 * cpu / samples,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="length of each daemon-shape measurement")
    ap.add_argument("--fast-hz", type=float, default=10.0)
    ap.add_argument("--slow-hz", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=200, help="calls per NVML function in the per-call table")
    ap.add_argument("--smi-samples", type=int, default=10)
    ap.add_argument("--energy-interval", type=float, default=10.0, help="seconds between energy reads")
    ap.add_argument("--breakdown", action="store_true", help="also run fast only and fast + slow")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # noqa: BLE001 - any failure here means: no GPU to measure
        print(f"bench_nvml: NVML unavailable: {err}", file=sys.stderr)
        return 2
    calls = per_call(pynvml, args.reps)
    print(f"{'tier':5} {'call':38} {'wall us (median)':>17} {'cpu us (mean)':>14}")
    for r in calls:
        wall = "-" if r["wall_us_median"] is None else f"{r['wall_us_median']:.1f}"
        cpu = "-" if r["cpu_us_mean"] is None else f"{r['cpu_us_mean']:.1f}"
        print(f"{r['tier']:5} {r['call']:38} {wall:>17} {cpu:>14} {r['error']}")
    every = max(1, round(args.energy_interval * args.slow_hz))
    variants: list[tuple[str, ...]] = [PARTS]
    if args.breakdown:
        variants = [("fast-cached",), ("fast",), ("fast", "slow"), ("fast", "slow", "xid")]
    empty = daemon_shape(None, args.seconds, args.fast_hz, args.slow_hz, every, ())
    shapes = [daemon_shape(pynvml, args.seconds, args.fast_hz, args.slow_hz, every, v) for v in variants if v]
    pynvml.nvmlShutdown()
    full = shapes[-1]
    net = full["cpu_share_pct"] - empty["cpu_share_pct"]
    print(
        f"\ndaemon shape, {args.fast_hz:g} Hz fast + {args.slow_hz:g} Hz slow (energy every {every} slow "
        f"reads), {args.seconds:g} s each, % of one core:"
    )
    print(f"  empty jobs (loop timer + scheduler only): {empty['cpu_share_pct']:.3f}")
    for shape in shapes:
        net_part = shape["cpu_share_pct"] - empty["cpu_share_pct"]
        print(
            f"  {' + '.join(shape['parts']):18}: {shape['cpu_share_pct']:.3f} "
            f"(net {net_part:.3f}; {shape['fast']} fast, {shape['slow']} slow)"
        )
    print(f"  XID listening: {full.get('xid_listening')} {full.get('xid_reason', '')}")
    print(f"  attributable to GPU telemetry: {net:.3f} % of one core")
    smi = nvidia_smi(args.smi_samples)
    if smi is not None:
        print(
            f"nvidia-smi -q -x: {smi['wall_ms_median']:.1f} ms wall median (min {smi['wall_ms_min']:.1f}), "
            f"{smi['cpu_ms_mean']:.1f} ms CPU per sample"
        )
    if args.json:
        with Path(args.json).open("w", encoding="utf-8") as f:
            json.dump(
                {"calls": calls, "empty": empty, "shapes": shapes, "net_pct": net, "nvidia_smi": smi},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
