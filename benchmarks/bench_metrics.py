"""Cost of the verdict's metrics fold: per point on the event loop, and the verdict of an 8-hour run.

Run by hand:  .venv/bin/python benchmarks/bench_metrics.py [--hours 8] [--json]

1. Per-point cost: the points of the H200 runs in tests/data/h200 (every measurement a default soak
   writes) folded by `RunMetrics.add` many times over; reported as microseconds per point, and per
   second of a soak at the recorded rate (26-44 points/s).
2. An 8-hour run synthesised at the recorded mix (per second: 12 requests, one engine, spec_decode,
   gpu, throttle and host point; an allocator point every 10 s), folded; then `scalars()` and the
   verdict of eight checks timed (what the run's end does while systemd's stop timeout runs), and the
   fold's memory (tracemalloc peak of the fold alone).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "daemon"))

from soakd.config import CriteriaConfig  # noqa: E402
from soakd.judge.criteria import evaluate  # noqa: E402
from soakd.judge.metrics import METRIC_MEASUREMENTS, RunMetrics  # noqa: E402
from soakd.metric import Sample, parse_line  # noqa: E402

DATA = ROOT / "tests" / "data" / "h200"
CHECKS = [
    "p99(ttft_ms) < 500",
    "throttle_time_pct < 5",
    "sustained_ratio(tokens_per_s, last=1h, first=1h) > 0.9",
    "min(spec_acceptance) > 0.6",
    "graph_hit_rate > 0.9",
    "fragmentation_growth < 0.05",
    "errors == 0",
    "engine_restarts == 0",
]


def recorded_points() -> list[Sample]:
    out: list[Sample] = []
    for path in ("live_soak/spool.lp.gz", "control/spool.lp.gz", "soak_spool.lp.gz", "rebuild/spool.lp.gz"):
        with gzip.open(DATA / path, "rt") as fh:
            out.extend(parse_line(line) for line in fh)
    return out


def per_point(points: list[Sample], rounds: int = 20) -> dict[str, Any]:
    folded = [p for p in points if p.measurement in METRIC_MEASUREMENTS]
    t0 = time.perf_counter()
    for _ in range(rounds):
        m = RunMetrics()
        for p in points:
            m.add(p)
    dt = time.perf_counter() - t0
    us = dt / (rounds * len(points)) * 1e6
    return {
        "points": len(points),
        "folded_share": round(len(folded) / len(points), 3),
        "us_per_point": round(us, 2),
        "ms_per_soak_second_at_44_points": round(us * 44 / 1000, 3),
    }


def synthetic_night(hours: float) -> RunMetrics:
    t0 = 1_800_000_000 * 10**9
    m = RunMetrics()
    for sec in range(int(hours * 3600)):
        ns = t0 + sec * 10**9
        for k in range(12):
            m.add(
                Sample(
                    "requests",
                    {
                        "output_tokens": 128,
                        "input_tokens": 300,
                        "ttft_s": 0.02 + k * 1e-3,
                        "tpot_s": 0.004,
                        "e2e_s": 0.6,
                        "lateness_s": 3e-4,
                    },
                    ns + k * 80_000_000,
                    {"status": "ok"},
                )
            )
        m.add(
            Sample(
                "engine",
                {
                    "cg_steps": 40,
                    "cg_graph_steps": 39,
                    "prefix_queries": 900,
                    "prefix_hits": 200,
                    "kv_cache_usage_max": 0.3,
                },
                ns,
            )
        )
        m.add(Sample("spec_decode", {"draft_tokens": 300, "accepted": 240}, ns))
        m.add(
            Sample(
                "gpu",
                {
                    "sm_clock_ratio": 0.97,
                    "power_w_mean": 420.0,
                    "temp_c_max": 61.0,
                    "mem_used_bytes": 46_000_000_000,
                },
                ns,
                {"gpu": "0"},
            )
        )
        m.add(Sample("throttle", {"throttled_s": 0.0}, ns, {"gpu": "0"}))
        m.add(Sample("host", {"engine_rss_bytes": 2_800_000_000}, ns))
        if sec % 10 == 0:
            m.add(
                Sample(
                    "allocator",
                    {"fragmentation": 0.001, "reserved_bytes_peak": 44_000_000_000},
                    ns,
                    {"worker": "0"},
                )
            )
    return m


def night(hours: float) -> dict[str, Any]:
    tracemalloc.start()
    t0 = time.perf_counter()
    m = synthetic_night(hours)
    fold_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    t1 = time.perf_counter()
    m.scalars()
    scalars_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    results = evaluate(
        CriteriaConfig(checks=CHECKS), m.summary(), ran_s=hours * 3600, planned_s=hours * 3600, metrics=m
    )
    verdict_s = time.perf_counter() - t2
    return {
        "hours": hours,
        "points": int(hours * 3600) * 18 + int(hours * 360),
        "fold_s": round(fold_s, 2),
        "fold_peak_mib": round(peak / 2**20, 1),
        "scalars_ms": round(scalars_s * 1000, 1),
        "verdict_ms": round(verdict_s * 1000, 1),
        "checks_passed": sum(r.passed for r in results if r.expr),
        "checks": len(CHECKS),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=8.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = {"per_point": per_point(recorded_points()), "night": night(args.hours)}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for section, values in out.items():
        print(section)
        for k, v in values.items():
            print(f"  {k:34} {v}")


if __name__ == "__main__":
    main()
