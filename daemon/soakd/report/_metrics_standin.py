"""Stand-in for soakd.report.metrics.load_metrics until it lands: a run's flat metrics from its files.

Same contract ({criteria-DSL name: float | None}); deleted once the real module is merged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from soakd.sinks.spool import iter_samples


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def load_metrics(run_dir: Path) -> dict[str, float | None]:
    verdict = _json(run_dir / "verdict.json")
    summary = _json(run_dir / "summary.json")
    meta = _json(run_dir / "meta.json")
    req: dict[str, Any] = verdict.get("requests", {})
    ran = _num(verdict.get("ran_s")) or _num(summary.get("ran_s"))
    out: dict[str, float | None] = {}
    for series in ("ttft", "tpot", "e2e"):
        for q in ("p50", "p99"):
            out[f"{q}({series}_ms)"] = _num(req.get(series, {}).get(f"{q}_ms"))
    tokens = _num(req.get("output_tokens"))
    out["tokens_per_s"] = tokens / ran if tokens is not None and ran else None
    out["requests"] = _num(req.get("scheduled"))
    out["errors"] = _num(req.get("failed"))
    out["error_rate"] = _num(req.get("error_rate"))
    out["completed_ratio"] = _num(req.get("completed_ratio"))
    tele = summary.get("engine_telemetry") or {}
    graphs = tele.get("cudagraphs") or {}
    out["graph_hit_rate"] = _num(graphs.get("hit_rate")) if graphs.get("applicable") else None
    spec = summary.get("spec_decode") or {}
    k = _num((meta.get("engine") or {}).get("speculative_tokens"))
    drafts, accepted = _num(spec.get("drafts")), _num(spec.get("accepted"))
    out["spec_acceptance"] = accepted / (drafts * k) if drafts and k and accepted is not None else None
    out["engine_restarts"] = _num((tele.get("lifecycle") or {}).get("restarts"))
    out["interruptions"] = float(len(verdict.get("interruptions", [])))
    peaks: dict[str, float | None] = {"peak_gpu_mem_bytes": None, "peak_engine_rss_bytes": None}
    fields = {
        "gpu": ("mem_used_bytes", "peak_gpu_mem_bytes"),
        "host": ("engine_rss_bytes", "peak_engine_rss_bytes"),
    }
    for s in iter_samples(run_dir / "spool"):
        if s.measurement in fields:
            field, name = fields[s.measurement]
            v = _num(s.fields.get(field))
            if v is not None:
                old = peaks[name]
                peaks[name] = v if old is None else max(old, v)
    out.update(peaks)
    out["duration_s"] = ran
    return out
