"""Compare two finished runs: their metrics side by side with deltas, verdicts, criteria and environments.

Run A is the baseline, run B the candidate. A metric's delta is judged by its direction (latency and
memory: lower is better; throughput and hit rates: higher is better) and a tolerance, so that
run-to-run noise reads as "same". Totals (requests, tokens, errors, restarts) grow with a run's length:
they are shown but never judged; their rates and ratios are. Before any figure, the runs' likeness:
different traces make the comparison meaningless (the CLI refuses it unless told otherwise), a
different length or engine config is warned of on the first lines.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from soakd.redact import redacted
from soakd.report.metric_kinds import EXACT, RANK, Direction, direction, is_total, with_rates
from soakd.report.runs import load_metrics, read_json
from soakd.rundir import META_FILE, VERDICT_FILE

Status = Literal["better", "worse", "same", "changed", "n/a"]

DEFAULT_TOLERANCE_PCT = 5.0
ZERO_NOISE = 1e-3

# Replayed durations further apart than this (percent of A's) are warned of.
LENGTH_TOLERANCE_PCT = 10.0
# Differences in these config keys are expected between any two runs and say nothing about them.
_CONFIG_NOISE = {"run.name", "run.output_dir", "run.host"}


@dataclass(frozen=True, slots=True)
class MetricDelta:
    name: str
    a: float | None
    b: float | None
    delta: float | None
    """b - a, in the metric's unit."""
    rel: float | None
    """(b - a) / |a|; None when a is 0 (and b is not) or either side has no value."""
    direction: Direction
    status: Status

    def worse_by_pct(self) -> float | None:
        """How much worse B is, in percent of A (inf from a zero A); None unless the status is worse."""
        if self.status != "worse":
            return None
        return math.inf if self.rel is None else abs(self.rel) * 100.0


def compare_metrics(
    a: dict[str, float | None], b: dict[str, float | None], tolerance_pct: float = DEFAULT_TOLERANCE_PCT
) -> list[MetricDelta]:
    """Deltas of every metric either side has: the main ones first, then the rest by name."""
    names = sorted(set(a) | set(b), key=lambda n: (RANK.get(n, len(RANK)), n))
    return [_delta(n, a.get(n), b.get(n), tolerance_pct) for n in names]


def _delta(name: str, a: float | None, b: float | None, tolerance_pct: float) -> MetricDelta:
    way = direction(name)
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b):
        return MetricDelta(name, a, b, None, None, way, "n/a")
    delta = b - a
    rel = delta / abs(a) if a != 0 else (0.0 if delta == 0 else None)
    # Within the tolerance (relative to A) is noise, and so is a change of at most ZERO_NOISE in the
    # metric's unit (ms, ratio, %, count, byte) around zero: a fragmentation growth of -5e-5 -> 0
    # (+100 %) is not a change. Ratios of counts (EXACT) have no such floor: an error rate of 0 -> 1e-4
    # is one error in 10,000 requests.
    floor = 0.0 if name in EXACT else ZERO_NOISE
    if (rel is not None and abs(rel) * 100.0 <= tolerance_pct) or abs(delta) <= floor:
        return MetricDelta(name, a, b, delta, rel, way, "same")
    if way == "none":
        return MetricDelta(name, a, b, delta, rel, way, "changed")
    better = delta < 0 if way == "lower" else delta > 0
    return MetricDelta(name, a, b, delta, rel, way, "better" if better else "worse")


@dataclass(frozen=True, slots=True)
class RunSide:
    """One run as the comparison reads it."""

    run_dir: str
    run_id: str
    verdict: str
    """PASS, FAIL, or "not judged" (no verdict.json: `soakd report` writes one)."""
    criteria: dict[str, dict[str, Any]]
    meta: dict[str, Any] = field(repr=False)
    ran_s: float | None = None
    """How long the replay ran (verdict.json's `ran_s`), None when unknown."""


@dataclass(frozen=True, slots=True)
class EnvItem:
    key: str
    a: Any
    b: Any

    @property
    def differs(self) -> bool:
        return bool(self.a != self.b)


@dataclass(frozen=True, slots=True)
class Comparison:
    a: RunSide
    b: RunSide
    metrics: list[MetricDelta]
    criteria: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]
    environment: list[EnvItem]
    """The facts that make runs comparable (model, engine, vLLM, platform, trace), both sides."""
    config_changes: list[EnvItem]
    """Every config key that differs (beyond run name and output folder)."""
    comparable: bool
    """False when the runs replayed different traces (or a trace hash is unknown)."""
    warnings: list[str]
    tolerance_pct: float

    def regressions(self, pct: float) -> list[MetricDelta]:
        """Metrics worse by more than `pct` percent of A (any worsening from a zero A counts)."""
        return [m for m in self.metrics if (w := m.worse_by_pct()) is not None and w > pct]

    def to_dict(self) -> dict[str, Any]:
        def side(s: RunSide) -> dict[str, Any]:
            return {
                "run_dir": s.run_dir,
                "run_id": s.run_id,
                "verdict": s.verdict,
                "ran_s": s.ran_s,
                "criteria": s.criteria,
            }

        return {
            "a": side(self.a),
            "b": side(self.b),
            "comparable": self.comparable,
            "warnings": self.warnings,
            "tolerance_pct": self.tolerance_pct,
            "metrics": [asdict(m) for m in self.metrics],
            "criteria": [{"name": n, "a": ca, "b": cb} for n, ca, cb in self.criteria],
            "environment": [
                {"key": e.key, "a": e.a, "b": e.b, "differs": e.differs} for e in self.environment
            ],
            "config_changes": [{"key": e.key, "a": e.a, "b": e.b} for e in self.config_changes],
        }


def read_side(run_dir: Path) -> RunSide:
    """A run's metadata and verdict (a run that was never judged has none)."""
    meta = read_json(run_dir / META_FILE)
    verdict = read_json(run_dir / VERDICT_FILE) if (run_dir / VERDICT_FILE).exists() else {}
    criteria = {
        str(c["name"]): {k: c.get(k) for k in ("value", "op", "threshold", "passed")}
        for c in verdict.get("criteria", [])
        if isinstance(c, dict) and "name" in c
    }
    ran_s = verdict.get("ran_s")
    return RunSide(
        run_dir=str(run_dir),
        run_id=str(meta.get("run_id") or verdict.get("run_id") or run_dir.name),
        verdict=str(verdict.get("verdict", "not judged")),
        criteria=criteria,
        meta=meta,
        ran_s=float(ran_s) if isinstance(ran_s, int | float) and math.isfinite(ran_s) else None,
    )


def _get(doc: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def environment(meta: dict[str, Any]) -> dict[str, Any]:
    """The facts of a run's meta.json that decide whether two runs measure the same thing."""
    engine = meta.get("engine") or {}
    gpu: dict[str, Any] = meta["gpu"] if isinstance(meta.get("gpu"), dict) else {}
    names = [str(d.get("name")) for d in gpu.get("devices") or [] if isinstance(d, dict)]
    return {
        "model": engine.get("model") or _get(meta, "config", "engine", "model"),
        "engine kind": engine.get("kind") or _get(meta, "config", "engine", "kind"),
        "engine config id": engine.get("config_id"),
        "vLLM version": engine.get("version"),
        "platform": _get(engine, "details", "platform"),
        # meta.json's `gpu` is written when the gpu collector runs: a run without it names no GPU.
        "GPU": " + ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names)) or None,
        "GPU driver": gpu.get("driver"),
        "CUDA graphs": engine.get("cudagraphs"),
        "speculative tokens": engine.get("speculative_tokens"),
        "trace sha256": _get(meta, "trace", "sha256"),
        "trace format": _get(meta, "trace", "format"),
        "trace requests": _get(meta, "trace", "requests"),
        "soakd version": meta.get("soakd_version"),
        "host": meta.get("host"),
    }


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(doc, dict):
        return {prefix: doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> list[EnvItem]:
    # Redacted again: a meta.json from an older soakd, or edited by hand, may hold what today's would not.
    a = _flatten(redacted(meta_a.get("config") or {}))
    b = _flatten(redacted(meta_b.get("config") or {}))
    keys = sorted(set(a) | set(b))
    return [EnvItem(k, a.get(k), b.get(k)) for k in keys if k not in _CONFIG_NOISE and a.get(k) != b.get(k)]


def trace_warning(sha_a: Any, sha_b: Any) -> str | None:
    """The loud line for runs that did not replay the same trace (None when they did)."""
    if not sha_a or not sha_b:
        return "NOT COMPARABLE: a run's trace hash is unknown (no trace.sha256 in its meta.json)"
    if sha_a != sha_b:
        return (
            f"NOT COMPARABLE: the runs replayed different traces (sha256 {str(sha_a)[:12]} vs "
            f"{str(sha_b)[:12]}); their deltas mix the traffic with the change"
        )
    return None


def length_warning(a_s: float | None, b_s: float | None) -> str | None:
    """The line for runs whose replays differ in length by more than LENGTH_TOLERANCE_PCT of A's."""
    if not a_s or b_s is None:
        return None
    rel = (b_s - a_s) / a_s
    if abs(rel) * 100.0 <= LENGTH_TOLERANCE_PCT:
        return None
    return (
        f"DIFFERENT LENGTHS: A replayed {a_s:,.0f} s, B {b_s:,.0f} s ({rel * 100:+.0f} %, beyond "
        f"{LENGTH_TOLERANCE_PCT:g} %): a short run's tails and peaks are not a long one's; "
        "totals are not judged"
    )


def engine_warning(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> str | None:
    """The line for runs whose engine sections differ (the keys named; the values are in the config
    differences), or, without a recorded config, whose engine config ids differ."""
    a = _flatten(redacted(_get(meta_a, "config", "engine") or {}), "engine")
    b = _flatten(redacted(_get(meta_b, "config", "engine") or {}), "engine")
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if not keys and not (a and b):
        ida, idb = _get(meta_a, "engine", "config_id"), _get(meta_b, "engine", "config_id")
        keys = ["engine config id"] if ida and idb and ida != idb else []
    if not keys:
        return None
    shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    return f"DIFFERENT ENGINE CONFIG: {shown} (values under config differences)"


def compare_runs(a_dir: Path, b_dir: Path, tolerance_pct: float = DEFAULT_TOLERANCE_PCT) -> Comparison:
    """Baseline A against candidate B, from their run directories."""
    a, b = read_side(a_dir), read_side(b_dir)
    ma, mb = with_rates(load_metrics(a_dir)), with_rates(load_metrics(b_dir))
    metrics = compare_metrics(ma, mb, tolerance_pct)
    names = list(a.criteria) + [n for n in b.criteria if n not in a.criteria]
    criteria = [(n, a.criteria.get(n), b.criteria.get(n)) for n in names]
    env_a, env_b = environment(a.meta), environment(b.meta)
    env = [EnvItem(k, env_a[k], env_b[k]) for k in env_a]
    # Most serious first: the first line a reader sees is why the figures below may not be like for like.
    trace = trace_warning(env_a["trace sha256"], env_b["trace sha256"])
    length = length_warning(
        a.ran_s if a.ran_s is not None else ma.get("duration_s") or ma.get("replay_s"),
        b.ran_s if b.ran_s is not None else mb.get("duration_s") or mb.get("replay_s"),
    )
    warnings = [w for w in (trace, length, engine_warning(a.meta, b.meta)) if w]
    for key in ("model", "vLLM version", "platform", "GPU"):
        if env_a[key] is not None and env_b[key] is not None and env_a[key] != env_b[key]:
            warnings.append(f"different {key}: {env_a[key]} vs {env_b[key]}")
    return Comparison(
        a=a,
        b=b,
        metrics=metrics,
        criteria=criteria,
        environment=env,
        config_changes=config_changes(a.meta, b.meta),
        comparable=trace is None,
        warnings=warnings,
        tolerance_pct=tolerance_pct,
    )


def fmt_value(name: str, value: float | None) -> str:
    """A metric's value for a table: bytes in MiB/GiB, ms and rates with sensible digits."""
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return fmt_bytes(value)
    if name.endswith(("_ms)", "_per_s", "_per_h", "_pct")) or name == "replay_s":
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.4g}"


def fmt_bytes(value: float) -> str:
    gib = value / 2**30
    return f"{gib:.2f} GiB" if abs(gib) >= 1 else f"{value / 2**20:.0f} MiB"


def fmt_rel(rel: float | None, delta: float | None) -> str:
    if rel is None:
        return "-" if delta is None else "new"
    return f"{rel * 100:+.1f}%"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def _fmt_env(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    # Hashes shortened for the table (--json has them whole); long config values cut.
    if re.fullmatch(r"[0-9a-f]{64}", text):
        return text[:12]
    return text if len(text) <= 100 else text[:97] + "..."


def lines(comp: Comparison) -> list[str]:
    """The comparison as text: warnings first, then metrics, verdicts and criteria, environment."""
    out = [f"!! {w}" for w in comp.warnings]
    out.append(f"A (baseline)  {comp.a.run_id}  {comp.a.verdict}  {comp.a.run_dir}")
    out.append(f"B (candidate) {comp.b.run_id}  {comp.b.verdict}  {comp.b.run_dir}")
    out.append("")
    rows = [["metric", "A", "B", "delta", "rel", f"B vs A (tolerance {comp.tolerance_pct:g}%)"]]
    for m in comp.metrics:
        if m.a is None and m.b is None:
            continue
        delta = "-" if m.delta is None else fmt_value(m.name, m.delta)
        if m.delta is not None and m.delta > 0:
            delta = "+" + delta
        # A total's change is the runs' lengths as much as anything: said, so nobody reads it as a finding.
        status = f"{m.status} (total)" if is_total(m.name) and m.status == "changed" else m.status
        rows.append(
            [m.name, fmt_value(m.name, m.a), fmt_value(m.name, m.b), delta, fmt_rel(m.rel, m.delta), status]
        )
    out += _table(rows)
    if comp.criteria:
        out.append("")
        crit = [["criterion", "A", "B"]]
        for name, ca, cb in comp.criteria:
            crit.append([name, _fmt_criterion(ca), _fmt_criterion(cb)])
        out += _table(crit)
    out.append("")
    env = [["environment", "A", "B", ""]]
    for e in comp.environment:
        env.append([e.key, _fmt_env(e.a), _fmt_env(e.b), "differs" if e.differs else ""])
    out += _table(env)
    if comp.config_changes:
        out.append("")
        out.append("config differences (A -> B):")
        out += [f"  {e.key}: {_fmt_env(e.a)} -> {_fmt_env(e.b)}" for e in comp.config_changes]
    return out


def _fmt_criterion(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    value = "no data" if c.get("value") is None else f"{float(c['value']):.4g}"
    return f"{'ok' if c.get('passed') else 'FAIL'} {value}"
