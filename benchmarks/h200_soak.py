"""The figures of one GPU soak from its run folder: what benchmarks/RESULTS.md records for a soak on real
hardware (engine starts, tokens/s, CUDA-graph hit rate and padding per engine config, speculative
acceptance per position and its drift, allocator fragmentation, throttle time per reason against
nvidia-smi's counters, every control action with tokens/s before and after it, soakd's own CPU).

    python benchmarks/h200_soak.py RUN_DIR [--smi-before FILE --smi-after FILE] [--window 20] [--json]

RUN_DIR holds summary.json and spool/ (a fixture's spool.lp.gz is read too). The nvidia-smi files are
`nvidia-smi -q -d PERFORMANCE` before and after the run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
import tempfile
from bisect import bisect_left, bisect_right
from collections import defaultdict
from pathlib import Path
from typing import Any

from soakd.metric import Sample
from soakd.sinks.spool import iter_samples

ACTIONS = (
    "downscale",
    "upscale",
    "recapture",
    "engine_rebuild",
    "throttle_enter",
    "throttle_leave",
    "spec_drift",
)
_SMI_COUNTER = re.compile(
    r"^\s+(SW Power Capping|Sync Boost|SW Thermal Slowdown|HW Thermal Slowdown|HW Power Braking)"
    r"\s+:\s+(\d+) us"
)


def smi_counters(path: Path) -> dict[str, float]:
    """nvidia-smi's clock-event reason counters (seconds) from `nvidia-smi -q -d PERFORMANCE`."""
    out: dict[str, float] = {}
    for line in path.read_text().splitlines():
        m = _SMI_COUNTER.match(line)
        if m:
            out[m.group(1)] = int(m.group(2)) / 1e6
    return out


def load(run_dir: Path) -> list[Sample]:
    spool = run_dir / "spool"
    if spool.is_dir():
        return list(iter_samples(spool))
    packed = run_dir / "spool.lp.gz"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "seg-00000001.lp").write_bytes(gzip.decompress(packed.read_bytes()))
        return list(iter_samples(Path(tmp)))


def _f(s: Sample, key: str) -> float:
    v = s.fields.get(key, 0)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def figures(
    run_dir: Path, window_s: float, smi_before: Path | None, smi_after: Path | None
) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = load(run_dir)
    by: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by[s.measurement].append(s)
    engine = sorted(by["engine"], key=lambda s: s.time_ns)
    starts = [s for s in by["events"] if s.tags.get("kind") == "warmup"]
    t0 = starts[0].time_ns if starts else engine[0].time_ns

    def rel(ns: int) -> float:
        return (ns - t0) / 1e9

    # tokens/s from the engine's own per-interval counts (generation tokens over the interval).
    times = [rel(s.time_ns) for s in engine]
    gen = [_f(s, "generation_tokens") for s in engine]
    dur = [_f(s, "interval_s") or 1.0 for s in engine]

    def tps(a: float, b: float) -> float | None:
        i, j = bisect_left(times, a), bisect_right(times, b)
        span = sum(dur[i:j])
        return sum(gen[i:j]) / span if span else None

    busy = [g / d for g, d in zip(gen, dur, strict=True) if g > 0]
    out: dict[str, Any] = {"run_id": summary.get("run_id"), "verdict": summary.get("verdict")}
    life = summary["engine_telemetry"]["lifecycle"]
    out["engine_starts_s"] = [round(c["start_s"], 1) for c in life["configs"]]
    out["rebuild_downtime_s"] = round(life["downtime_s"], 1)
    out["tokens_per_s"] = {
        "mean_over_replay": round(sum(gen) / sum(dur), 1),
        "p50_busy_interval": round(statistics.median(busy), 1) if busy else None,
        "max_interval": round(max(busy), 1) if busy else None,
        "output_tokens": summary["replay"]["output_tokens"],
        "requests": summary["replay"]["completed"],
    }
    # CUDA graphs per engine config: steps and tokens under a graph, and padding waste.
    cg: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in engine:
        c = cg[s.tags.get("config", "")]
        for k in (
            "cg_steps",
            "cg_graph_steps",
            "cg_steps_full",
            "cg_steps_piecewise",
            "cg_steps_none",
            "cg_unpadded_tokens",
            "cg_graph_tokens",
            "cg_padded_tokens",
            "cg_paddings",
        ):
            c[k] += _f(s, k)
        c["first_s"] = min(c.get("first_s", 1e18), rel(s.time_ns))
        c["last_s"] = max(c.get("last_s", -1e18), rel(s.time_ns))
    out["cuda_graphs"] = {
        cfg: {
            "from_s": round(c["first_s"], 1),
            "to_s": round(c["last_s"], 1),
            "steps": int(c["cg_steps"]),
            "FULL": int(c["cg_steps_full"]),
            "PIECEWISE": int(c["cg_steps_piecewise"]),
            "NONE": int(c["cg_steps_none"]),
            "hit_rate_steps": round(c["cg_graph_steps"] / c["cg_steps"], 4) if c["cg_steps"] else None,
            "hit_rate_tokens": round(c["cg_graph_tokens"] / c["cg_unpadded_tokens"], 4)
            if c["cg_unpadded_tokens"]
            else None,
            "padding_waste": round(c["cg_paddings"] / c["cg_padded_tokens"], 4)
            if c["cg_padded_tokens"]
            else None,
        }
        for cfg, c in cg.items()
        if c["cg_steps"]
    }
    # Speculative acceptance per draft position, per engine config, and per minute (the drift).
    spec = sorted(by["spec_decode"], key=lambda s: s.time_ns)
    pos: dict[str, list[list[float]]] = {}
    minute: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in spec:
        k = sum(1 for f in s.fields if f.startswith("accepted_pos"))
        p = pos.setdefault(s.tags.get("config", ""), [[0.0, 0.0] for _ in range(k)])
        for i in range(min(k, len(p))):
            p[i][0] += _f(s, f"accepted_pos{i}")
            p[i][1] += _f(s, f"draft_tokens_pos{i}")
        m = minute[int(rel(s.time_ns) // 60)]
        m[0] += _f(s, "accepted")
        m[1] += _f(s, "draft_tokens")
    out["spec_acceptance_by_position"] = {
        cfg: [round(a / d, 5) if d else None for a, d in p] for cfg, p in pos.items()
    }
    out["spec_acceptance_by_minute"] = {m: round(a / d, 5) for m, (a, d) in sorted(minute.items()) if d}
    out["spec_drift"] = summary["engine_telemetry"]["spec_decode"].get("drift")
    # Allocator fragmentation over the run (worst worker), first / min / max / last.
    frag = [
        (rel(s.time_ns), _f(s, "fragmentation")) for s in sorted(by["allocator"], key=lambda s: s.time_ns)
    ]
    if frag:
        values = [v for _, v in frag]
        out["fragmentation"] = {
            "points": len(frag),
            "first": values[0],
            "min": min(values),
            "max": max(values),
            "last": values[-1],
            "reserved_peak_gib": round(max(_f(s, "reserved_bytes_peak") for s in by["allocator"]) / 2**30, 2),
        }
    # Throttle time per reason: soakd's NVML counters (and the detector's time), nvidia-smi's.
    gpu_t = summary.get("gpu_throttle", {}).get("0", {})
    out["throttle"] = {
        "detector_throttled_s": gpu_t.get("throttled_s"),
        "episodes": gpu_t.get("enters"),
        "nvml_counter_s": gpu_t.get("per_reason_s"),
    }
    if smi_before and smi_after:
        a, b = smi_counters(smi_before), smi_counters(smi_after)
        out["throttle"]["nvidia_smi_counter_s"] = {k: round(b[k] - a.get(k, 0.0), 6) for k in b}
    # Every action, with the engine's tokens/s in the window before and after it.
    events = sorted((s for s in by["events"] if s.tags.get("kind") in ACTIONS), key=lambda s: s.time_ns)
    out["actions"] = [
        {
            "t_s": round(rel(s.time_ns), 1),
            "kind": s.tags["kind"],
            "what": str(s.fields.get("message", ""))[:160],
            "tps_before": None if (v := tps(rel(s.time_ns) - window_s, rel(s.time_ns))) is None else round(v),
            "tps_after": None if (v := tps(rel(s.time_ns), rel(s.time_ns) + window_s)) is None else round(v),
        }
        for s in events
    ]
    # soakd's own CPU (its process: with vllm-local that includes vLLM's front end) and the engine's.
    host = [s for s in by["host"] if "soakd_cpu_percent" in s.fields and 0 <= rel(s.time_ns) <= times[-1]]
    if host:
        mine = [_f(s, "soakd_cpu_percent") for s in host]
        eng = [_f(s, "engine_cpu_percent") for s in host]
        cpu_s = _f(host[-1], "soakd_cpu_seconds") - _f(host[0], "soakd_cpu_seconds")
        out["cpu"] = {
            "soakd_pct_mean": round(statistics.fmean(mine), 1),
            "soakd_pct_p90": round(sorted(mine)[int(0.9 * (len(mine) - 1))], 1),
            # As recorded: before soakd stopped counting its own process there (in-process engines list
            # it among theirs), this included soakd_pct too.
            "engine_pct_mean_recorded": round(statistics.fmean(eng), 1),
            "soakd_cpu_us_per_output_token": round(1e6 * cpu_s / max(1.0, sum(gen)), 1),
        }
    out["loop_health"] = {
        "tickers": summary.get("tickers"),
        "scheduler": summary.get("scheduler"),
        "lateness_max_s": summary["replay"].get("lateness_max_s"),
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--smi-before", type=Path)
    ap.add_argument("--smi-after", type=Path)
    ap.add_argument("--window", type=float, default=20.0, help="seconds before/after an action for tokens/s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    fig = figures(args.run_dir, args.window, args.smi_before, args.smi_after)
    if args.json:
        json.dump(fig, sys.stdout, indent=1)
        print()
        return 0
    for key, value in fig.items():
        if key == "actions":
            print("actions (t from the end of warm-up, tokens/s in the window before -> after):")
            for a in value:
                print(
                    f"  {a['t_s']:7.1f} s  {a['kind']:<15} {a['tps_before']} -> {a['tps_after']}  {a['what']}"
                )
        else:
            print(f"{key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
