"""Which way is better for each run metric, which are totals (not judged), the rates derived from those
totals, and the order a comparison lists them in."""

from __future__ import annotations

from typing import Literal

Direction = Literal["lower", "higher", "none"]

# Names whose better side is not readable off their form (see `direction`).
HIGHER = {
    "tokens_per_s",
    "input_tokens_per_s",
    "requests_per_s",
    "completed_ratio",
    "graph_hit_rate",
    "spec_acceptance",
    "min(spec_acceptance)",
    "prefix_hit_rate",
    "min(sm_clock_ratio)",
}
LOWER = {
    "error_rate",
    "shed_ratio",
    "lost_in_flight_ratio",
    "throttle_time_pct",
    "host_throttle_time_pct",
    "throttle_episodes_per_h",
    "max(temp_c)",
    "fragmentation_growth",
    "engine_restarts_per_h",
    "interruptions_per_h",
    "soakd_cpu_pct",
    "harness_saturated_pct",
    "admission_wait_share",
}
# Totals: a run twice as long has twice as many, so their deltas say nothing about the change under test.
# The first ones, in this order, end a comparison's table (ORDER); the rest follow by name.
_TOTALS_LISTED = (
    "replay_s",
    "duration_s",
    "requests",
    "completed",
    "errors",
    "incomplete",
    "shed",
    "output_tokens",
    "input_tokens",
)
TOTALS = {
    *_TOTALS_LISTED,
    "engine_restarts",
    "engine_rebuilds",
    "throttle_episodes",
    "recaptures",
    "interruptions",
    "lost_in_flight",
    "harness_saturated_s",
}
# Rates and ratios derived from the totals, so that runs of different lengths can be judged:
# name -> (total, per what: "s" of the replay, "h" of the run, "requests", or "pct" of the replay).
RATES: dict[str, tuple[str, str]] = {
    "input_tokens_per_s": ("input_tokens", "s"),
    "shed_ratio": ("shed", "requests"),
    "lost_in_flight_ratio": ("lost_in_flight", "requests"),
    "engine_restarts_per_h": ("engine_restarts", "h"),
    "throttle_episodes_per_h": ("throttle_episodes", "h"),
    "interruptions_per_h": ("interruptions", "h"),
    "harness_saturated_pct": ("harness_saturated_s", "pct"),
}
# Ratios of whole counts have no rounding noise: 0 -> 1 error in 10,000 requests is a change.
EXACT = {"error_rate", "shed_ratio", "lost_in_flight_ratio"}


def is_total(name: str) -> bool:
    """A count over the whole run (it grows with the run's length): shown, never judged."""
    return name in TOTALS or name.startswith("events(")


def direction(name: str) -> Direction:
    """Which way is better for a metric of the criteria language's names (judge.metrics); totals
    (requests, errors, output_tokens, replay_s, engine_restarts, events(KIND) ...) have no better side:
    their rates do."""
    if is_total(name):
        return "none"
    if name in HIGHER:
        return "higher"
    # Latency distributions (p50(ttft_ms), max(e2e_ms), ...) and peaks of memory.
    if name in LOWER or name.startswith("peak_") or name.endswith("_ms)"):
        return "lower"
    return "none"


# The table's order: what a reviewer reads first (throughput, latency, outcome), then the rest by name
# (verdict.json keeps its metrics sorted by name, which would put `completed` first).
ORDER = [
    # The latencies as offered (from each request's due time), where the run has them.
    *(
        f"{q}({d})"
        for d in ("ttft_offered_ms", "e2e_offered_ms", "queue_ms")
        for q in ("p50", "p90", "p99", "max")
    ),
    "admission_wait_share",
    "tokens_per_s",
    "requests_per_s",
    *(
        f"{q}({d})"
        for d in ("ttft_ms", "tpot_ms", "e2e_ms", "lateness_ms")
        for q in ("p50", "p90", "p99", "max")
    ),
    "input_tokens_per_s",
    "error_rate",
    "completed_ratio",
    "shed_ratio",
    "lost_in_flight_ratio",
    "engine_restarts_per_h",
    "interruptions_per_h",
    "throttle_episodes_per_h",
    "spec_acceptance",
    "min(spec_acceptance)",
    "graph_hit_rate",
    "prefix_hit_rate",
    "peak_gpu_mem_bytes",
    "peak_engine_rss_bytes",
    "peak_allocator_reserved_bytes",
    "soakd_cpu_pct",
    "fragmentation_growth",
    "throttle_time_pct",
    "host_throttle_time_pct",
    "harness_saturated_pct",
    # Totals last: shown, not judged.
    *_TOTALS_LISTED,
]
RANK = {name: i for i, name in enumerate(ORDER)}


def with_rates(metrics: dict[str, float | None]) -> dict[str, float | None]:
    """The metrics plus the rates of their totals (`RATES`), where the total and its base are known."""
    out = dict(metrics)
    replay = metrics.get("replay_s") or metrics.get("duration_s")
    hours = (metrics.get("duration_s") or replay or 0.0) / 3600.0
    base = {
        "s": replay,
        "pct": replay / 100.0 if replay else None,
        "h": hours,
        "requests": metrics.get("requests"),
    }
    for name, (total, per) in RATES.items():
        value, over = metrics.get(total), base[per]
        if name not in out and value is not None and over:
            out[name] = value / over
    return out
