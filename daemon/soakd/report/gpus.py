"""The GPUs in a report's environment: meta.json's facts of each device, which were the engine's
(`gpu.engine`), how far apart a parallel engine's GPUs ran with the straggler (summary.json's
`gpu_spread`: the printout's words too), and what the GPU series say."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from soakd.report.series import at_path


def spread_text(group: str, g: Mapping[str, Any]) -> str:
    """A parallel engine's GPUs against each other over the run (summary.json's `gpu_spread`): how far
    apart their clocks ran and which GPU held the others back."""
    gpus = ", ".join(map(str, g.get("gpus", [])))
    who = "across the replicas" if group == "all" else f"replica {group}"
    p50, top = g.get("sm_spread_p50"), g.get("sm_spread_max")
    if p50 is None or top is None:
        return f"GPUs {gpus} ({who}): no interval with all of them busy"
    slow = g.get("straggler")
    named = (
        f"straggler GPU {slow} in {g.get('straggler_intervals')} of {g.get('intervals')} intervals"
        if slow is not None
        else "no straggler (clocks within 2 %)"
    )
    return f"GPUs {gpus} ({who}): clock spread p50 {p50:.1%}, max {top:.1%}; {named}"


def cotenant_text(episodes: int) -> str:
    """Another process on one of the engine's GPUs (summary.json's `cotenant_episodes`, when not 0): the
    printout's words too."""
    return f"came {episodes} time(s) (cotenant_enter events); the figures are not the engine's alone"


def cotenant_rows(summary: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Whether another process computed on the engine's GPUs (summary.json's `gpu_throttle`): a soak's
    figures are the engine's alone only where none did; unsaid where NVML's process list was not known."""
    throttle = summary.get("gpu_throttle")
    if not isinstance(throttle, Mapping):
        return []
    counts = {g: t.get("cotenant_episodes") for g, t in throttle.items() if isinstance(t, Mapping)}
    known = {g: n for g, n in counts.items() if isinstance(n, int)}
    if not known:
        return []
    came = {g: n for g, n in known.items() if n}
    if not came:
        return [("other processes", f"none on GPU(s) {', '.join(known)}")]
    return [(f"other processes, GPU {g}", cotenant_text(n)) for g, n in came.items()]


def engine_gpu_rows(gpu_meta: Mapping[str, Any], summary: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Which GPUs were the engine's (meta.json) and, for a parallel engine, its straggler (summary.json)."""
    engine = gpu_meta.get("engine")
    rows: list[tuple[str, Any]] = []
    if isinstance(engine, Mapping):
        gpus = ", ".join(map(str, engine.get("gpus") or [])) or "none"
        if engine.get("known"):
            replicas = len(engine.get("replicas") or [])
            rows.append(
                (
                    "the engine's GPUs",
                    f"{gpus}: {engine.get('gpus_per_replica')} per replica, {replicas} replica(s) "
                    f"({engine.get('found_by')})",
                )
            )
        else:
            rows.append(("the engine's GPUs", f"not told apart, every GPU judged ({engine.get('found_by')})"))
    rows += cotenant_rows(summary)
    spread = summary.get("gpu_spread")
    if isinstance(spread, Mapping):
        for group, g in spread.items():
            if isinstance(g, Mapping):
                rows.append(("GPU spread", spread_text(str(group), g)))
    return rows


def gpu_rows(
    meta: Mapping[str, Any],
    cfg: Mapping[str, Any],
    data: Mapping[str, Any],
    summary: Mapping[str, Any],
) -> list[tuple[str, Any]]:
    """The GPUs: meta.json's facts (driver, each device, the engine's), then what the GPU series say."""
    gpu_meta = meta.get("gpu") if isinstance(meta.get("gpu"), Mapping) else None
    gpu: list[tuple[str, Any]] = []
    collectors = at_path(cfg, "telemetry.collectors")
    if gpu_meta is not None and gpu_meta.get("source") == "none":
        gpu.append(("GPU", f"none: {gpu_meta.get('reason') or 'no GPU found'} (GPU telemetry was off)"))
    elif gpu_meta is not None:
        assert isinstance(gpu_meta, Mapping)
        gpu.append(("driver", gpu_meta.get("driver")))
        gpu.append(("CUDA (driver)", gpu_meta.get("cuda_driver")))
        if gpu_meta.get("source") == "recording":
            gpu.append(("read from", f"an NVML recording ({at_path(cfg, 'telemetry.gpu_recording')})"))
        for i, dev in enumerate(gpu_meta.get("devices") or []):
            if isinstance(dev, Mapping):
                facts = [str(dev.get("name") or "unnamed")]
                if dev.get("mem_total"):
                    facts.append(f"{dev['mem_total'] / 2**30:.1f} GiB")
                if dev.get("max_sm_mhz"):
                    facts.append(f"SM clock up to {dev['max_sm_mhz']} MHz")
                if dev.get("power_limit_mw"):
                    facts.append(f"power limit {dev['power_limit_mw'] / 1000:g} W")
                gpu.append((f"GPU {i}", ", ".join(facts)))
        gpu += engine_gpu_rows(gpu_meta, summary)
    elif (
        isinstance(collectors, list)
        and "gpu" not in collectors
        and not at_path(cfg, "telemetry.gpu_recording")
    ):
        gpu.append(("GPU", "not read: the gpu collector was off (telemetry.collectors)"))
    elif at_path(meta, "engine.details.platform") == "cpu":
        gpu.append(("GPU", "none: the engine ran on the CPU platform"))
    else:
        gpu.append(("name, driver, CUDA", "not recorded in meta.json (runs before soakd wrote them)"))
    for g in data.get("gpus", []):
        facts = []
        if g.get("mem_total_bytes"):
            facts.append(f"{g['mem_total_bytes'] / 2**30:.1f} GiB")
        if g.get("power_limit_w"):
            facts.append(f"power limit {g['power_limit_w']:g} W")
        gpu.append((f"GPU {g['index']} (from its series)", ", ".join(facts) or "seen"))
    if not data.get("gpus"):
        gpu.append(("GPU series", "none in this run"))
    return gpu
