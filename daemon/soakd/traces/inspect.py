"""Describe a trace before replaying it: volume, rate over time, length percentiles, reuse, sessions.

Memory stays flat on traces of tens of millions of rows: lengths are counted per distinct value
(exact percentiles, one counter entry per distinct length), the rate per fixed time bucket.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict
from typing import Any

from soakd.traces.loader import Trace

RATE_BUCKETS = 24
_PERCENTILES = (50, 90, 99)


def _percentiles(counts: Counter[int]) -> dict[str, float]:
    """Exact nearest-rank percentiles, mean and max of a value -> count table."""
    total = sum(counts.values())
    if not total:
        return {}
    out: dict[str, float] = {"mean": sum(v * n for v, n in counts.items()) / total}
    ranks = {p: max(1, math.ceil(p / 100 * total)) for p in _PERCENTILES}
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        for p, rank in list(ranks.items()):
            if seen >= rank:
                out[f"p{p}"] = value
                del ranks[p]
    out["max"] = max(counts)
    return out


def inspect_trace(trace: Trace, buckets: int = RATE_BUCKETS) -> dict[str, Any]:
    """A JSON-ready description of a validated trace (one more pass over it)."""
    s = trace.summary
    width = s.span_s / buckets if s.span_s > 0 else 1.0
    per_bucket = [0] * buckets
    inputs: Counter[int] = Counter()
    outputs: Counter[int] = Counter()
    turns: Counter[str] = Counter()
    images = 0
    for spec in trace:
        per_bucket[min(int(spec.arrival_s / width), buckets - 1)] += 1
        inputs[spec.input_tokens] += 1
        outputs[spec.output_tokens] += 1
        if spec.session:
            turns[spec.session] += 1
        images += spec.images
    rates = [n / width for n in per_bucket]
    multi = [n for n in turns.values() if n > 1]
    doc: dict[str, Any] = {
        **asdict(s),
        "mean_rate_rps": s.requests / s.span_s if s.span_s > 0 else None,
        "rate_over_time": {
            "bucket_s": width,
            "rps": rates,
            "min_rps": min(rates),
            "max_rps": max(rates),
            "peak_to_mean": max(rates) / (s.requests / (width * buckets)),
        },
        "input_tokens_pct": _percentiles(inputs),
        "output_tokens_pct": _percentiles(outputs),
        "session_turns": {
            "sessions": len(multi),
            "requests_in_sessions": sum(multi),
            "mean_turns": sum(multi) / len(multi) if multi else 0.0,
            "max_turns": max(multi, default=0),
        },
        "images": images,
    }
    return doc


def inspect_lines(doc: dict[str, Any]) -> list[str]:
    """The description as aligned text lines."""

    def pct(d: dict[str, float]) -> str:
        if not d:
            return "-"
        parts = [f"mean {d['mean']:.0f}"] + [f"{k} {d[k]:.0f}" for k in ("p50", "p90", "p99", "max")]
        return ", ".join(parts)

    rate = doc["rate_over_time"]
    spark = " ".join(f"{r:.3g}" for r in rate["rps"])
    mean = doc["mean_rate_rps"]
    sess = doc["session_turns"]
    lines = [
        f"trace     {doc['path']}",
        f"format    {doc['format']} (sha256 {doc['sha256'][:16]}), token counts {doc['token_counts']}",
        f"requests  {doc['requests']} over {doc['span_s']:.1f} s"
        + (f", {mean:.3g} req/s mean" if mean is not None else ""),
        f"rate      per {rate['bucket_s']:.3g} s: min {rate['min_rps']:.3g}, max {rate['max_rps']:.3g} req/s "
        f"(peak/mean {rate['peak_to_mean']:.2f})",
        f"          {spark}",
        f"input     {pct(doc['input_tokens_pct'])} tokens",
        f"output    {pct(doc['output_tokens_pct'])} tokens",
        f"prefix    block {doc['block_size']} tokens, {doc['unique_blocks']} distinct blocks, "
        f"reuse ratio {doc['block_reuse_ratio']:.3f}",
        f"sessions  {sess['sessions']} multi-turn ({sess['requests_in_sessions']} requests), "
        f"mean {sess['mean_turns']:.2f} turns, max {sess['max_turns']}",
    ]
    if doc["images"]:
        lines.append(f"images    {doc['images']}")
    left_out = []
    if doc["bad_rows"]:
        left_out.append(f"{doc['bad_rows']} bad rows skipped")
    left_out += [f"{n} {reason}" for reason, n in doc["skipped_rows"].items()]
    if left_out:
        lines.append(f"left out  {'; '.join(left_out)}")
    if doc["sorted_on_read"]:
        lines.append("order     timestamps went backwards; sorted on read")
    if doc["transforms"]:
        lines.append(f"transform {doc['transforms']}")
    return lines
