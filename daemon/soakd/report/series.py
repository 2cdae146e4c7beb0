"""A run's time series for the sign-off report, folded into fixed-width time buckets.

Whatever the source (the spool, or InfluxDB), the same points go through `SeriesBuilder`, so both give
the same report: values are kept per (measurement, group tag, field) as they arrive, then sorted by
bucket and value before any sum is taken, so the result does not depend on the order the points came
in (the spool's write order, InfluxDB's series order). Numbers are read as floats (InfluxDB's JSON gives
1.0 back as 1). An 8 h run at 1 s points is ~30k points per series; the plots get at most `max_buckets`
buckets of min/mean/max per series instead.

Over 500 lines because the field table, the bucket fold and the panel list of the report are one mapping
from measurements to plots.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from soakd.judge.requests import offered_s
from soakd.metric import FieldValue, Sample
from soakd.sinks.spool import DamagedFn, iter_samples

# The fields the report reads, per measurement (None: every field). InfluxDB is asked for these only.
FIELDS: dict[str, tuple[str, ...] | None] = {
    "gpu": (
        "sm_mhz_min",
        "sm_mhz_mean",
        "sm_mhz_max",
        "power_w_mean",
        "power_w_max",
        "power_limit_w",
        "temp_c_max",
        "hbm_temp_c_max",
        "mem_total_bytes",
        "gpm_dram_bw_pct",
    ),
    # decode_ceiling_pct only says a run was recorded before decode steps were counted (see _why).
    "engine": (
        "generation_tokens",
        "interval_s",
        "cg_graph_steps",
        "cg_steps",
        "decode_bw_pct",
        "decode_ceiling_pct",
    ),
    # Per-position fields are numbered (accepted_pos0, ...): all of them.
    "spec_decode": None,
    "allocator": ("fragmentation",),
    "control": ("ceiling",),
    "requests": (
        "output_tokens",
        "input_tokens",
        "ttft_s",
        "ttft_offered_s",
        "tpot_s",
        "e2e_s",
        "lateness_s",
        "queue_s",
        "error",
    ),
    "events": None,
}
MEASUREMENTS = tuple(FIELDS)

# The tag that splits a measurement into several lines of a plot.
_GROUP_TAG = {"gpu": "gpu", "allocator": "worker", "requests": "status"}
# Ratios of sums (a rate over an interval is only right as sum over sum): name -> (numerator, denominator).
_RATIOS: dict[str, dict[str, tuple[str, str]]] = {
    "engine": {"gen_tps": ("generation_tokens", "interval_s"), "cg_hit": ("cg_graph_steps", "cg_steps")},
    "spec_decode": {"all": ("accepted", "draft_tokens")},
}
_POS_RE = re.compile(r"^accepted_pos(\d+)$")
_NICE_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
# Control actions, engine changes and faults: what the actions timeline is for (other events are context).
ACTION_KINDS = frozenset(
    {
        "downscale",
        "upscale",
        "revert",
        "action_result",
        "recapture",
        "engine_rebuild",
        "engine_restart",
        "engine_failed",
        "engine_error",
        "mtp_on",
        "mtp_off",
        "mtp_advisory",
        "spec_drift",
        "spec_drift_cleared",
        "sink_outage",
        "sink_backfill",
        "sink_rejected",
        "spool_degraded",
        "spool_recovered",
        "gpu_xid",
        "gpu_error",
        "replay_error",
        "run_resume",
    }
)
_THROTTLE_KINDS = ("throttle_enter", "throttle_recovering", "throttle_leave")


def nice_bucket(span_s: float, max_buckets: int) -> float:
    """The smallest of 1, 2, 5, 10, 15, 30 s, 1, 2, 5 ... min, 1 h ... that cuts `span_s` into at most
    `max_buckets` buckets."""
    for step in _NICE_S:
        if span_s / step <= max_buckets:
            return float(step)
    return float(math.ceil(span_s / max_buckets / 86400) * 86400)


def _r(value: float) -> float | None:
    """Six significant digits (plots need no more; JSON stays small), None for NaN/inf."""
    return float(f"{value:.6g}") if math.isfinite(value) else None


def _num(value: FieldValue | None) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _normal(value: FieldValue) -> FieldValue:
    # Numbers as floats: InfluxDB's JSON gives a float 1.0 back as the integer 1.
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


@dataclass(slots=True)
class _Column:
    t: array[int] = field(default_factory=lambda: array("q"))
    v: array[float] = field(default_factory=lambda: array("d"))


@dataclass(frozen=True, slots=True)
class _Buckets:
    """One column sorted by (bucket, value): bucket indexes present and where each starts."""

    idx: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    values: npt.NDArray[np.float64]


class SeriesBuilder:
    """Collects the points the report needs (`add`), then folds them into plot series (`build`)."""

    def __init__(self) -> None:
        self._cols: dict[tuple[str, str, str], _Column] = {}
        self._events: list[tuple[int, str, str, dict[str, FieldValue]]] = []
        self._first: int | None = None
        self._last: int | None = None
        self.points = 0

    def _put(self, key: tuple[str, str, str], t: int, value: float) -> None:
        col = self._cols.get(key)
        if col is None:
            col = self._cols[key] = _Column()
        col.t.append(t)
        col.v.append(value)

    def _seen(self, t: int) -> None:
        self.points += 1
        self._first = t if self._first is None else min(self._first, t)
        self._last = t if self._last is None else max(self._last, t)

    def add(self, s: Sample) -> None:
        m = s.measurement
        wanted = FIELDS.get(m, ())
        if m == "events":
            fields = {k: _normal(v) for k, v in s.fields.items() if k != "message"}
            self._events.append((s.time_ns, s.tags.get("kind", ""), str(s.fields.get("message", "")), fields))
            self._seen(s.time_ns)
            return
        if wanted == ():
            return
        group = s.tags.get(_GROUP_TAG.get(m, ""), "")
        stored = False
        names = s.fields.keys() if wanted is None else wanted
        for name in names:
            value = _num(s.fields.get(name))
            if value is not None:
                self._put((m, group, name), s.time_ns, value)
                stored = True
        if m == "requests":
            stored = stored or "error" in s.fields
            if "ttft_offered_s" not in s.fields:
                # Recorded before the due-time view was stamped: its parts add up to it (as the verdict's).
                offered = offered_s(s.fields, "ttft_offered_s", "ttft_s")
                if offered is not None:
                    self._put((m, group, "ttft_offered_s"), s.time_ns, offered)
        ratios = dict(_RATIOS.get(m, {}))
        if m == "spec_decode":
            for name in s.fields:
                match = _POS_RE.match(name)
                if match:
                    ratios[f"pos{match.group(1)}"] = (name, f"draft_tokens_pos{match.group(1)}")
        for rname, (num_f, den_f) in ratios.items():
            num, den = _num(s.fields.get(num_f)), _num(s.fields.get(den_f))
            if num is not None and den is not None:
                self._put((m, group, f"{rname}#n"), s.time_ns, num)
                self._put((m, group, f"{rname}#d"), s.time_ns, den)
        if stored:
            # Only points that gave the report something mark the run's span: InfluxDB returns no row
            # for a point whose selected fields are all empty.
            self._seen(s.time_ns)

    # -- folding ------------------------------------------------------------------------------------

    def _bucketed(self, key: tuple[str, str, str], t0: int, width_ns: int) -> _Buckets | None:
        col = self._cols.get(key)
        if col is None or not len(col.t):
            return None
        t = np.frombuffer(col.t, dtype=np.int64)
        v = np.frombuffer(col.v, dtype=np.float64)
        idx = (t - t0) // width_ns
        order = np.lexsort((v, idx))
        idx, v = idx[order], v[order]
        uniq, starts = np.unique(idx, return_index=True)
        return _Buckets(uniq, starts.astype(np.int64), v)

    def groups(self, measurement: str) -> list[str]:
        return sorted({g for (m, g, _) in self._cols if m == measurement}, key=_group_order)

    def fields_of(self, measurement: str) -> set[str]:
        return {f for (m, _, f) in self._cols if m == measurement}

    def build(self, config: Mapping[str, Any] | None = None, *, max_buckets: int = 600) -> dict[str, Any]:
        """The report's `data` section: span, bucket width, panels of series, throttle episodes, events.

        `config` is the run's config (meta.json's dump): it says why a panel has no data."""
        cfg = config or {}
        if self._first is None or self._last is None:
            return {
                "t0_ns": None,
                "span_s": 0.0,
                "bucket_s": 1.0,
                "latency_bucket_s": 1.0,
                "points": 0,
                "gpus": [],
                "panels": _empty_panels(cfg, self),
                "episodes": [],
                "events": [],
            }
        t0 = self._first
        span_s = (self._last - t0) / 1e9
        bucket_s = nice_bucket(span_s, max_buckets)
        # Latency percentiles per minute (a bucket needs requests in it), finer on short runs.
        lat_s = max(bucket_s, 60.0) if span_s >= 1800 else max(bucket_s, nice_bucket(span_s, 30))
        f = _Fold(self, t0, span_s, bucket_s, lat_s)
        panels = _panels(f, cfg)
        return {
            "t0_ns": t0,
            "span_s": _r(span_s),
            "bucket_s": bucket_s,
            "latency_bucket_s": lat_s,
            "points": self.points,
            "gpus": [
                {
                    "index": g,
                    "power_limit_w": _r(
                        max(f.reduce(("gpu", g, "power_limit_w"), "max").values(), default=0)
                    ),
                    "mem_total_bytes": _r(
                        max(f.reduce(("gpu", g, "mem_total_bytes"), "max").values(), default=0)
                    ),
                }
                for g in self.groups("gpu")
            ],
            "panels": panels,
            "episodes": self._episodes(t0, self._last),
            "events": [
                {"t_s": round((t - t0) / 1e9, 3), "kind": kind, "message": msg, "fields": fields}
                for t, kind, msg, fields in sorted(self._events, key=lambda e: (e[0], e[1], e[2]))
            ],
        }

    def _episodes(self, t0: int, last: int) -> list[dict[str, Any]]:
        """Throttle episodes from the `throttle_*` events: entered, recovering (if it got there), left."""
        out: list[dict[str, Any]] = []
        open_: dict[str, dict[str, Any]] = {}
        for t, kind, _, fields in sorted(self._events, key=lambda e: (e[0], e[1], e[2])):
            if kind not in _THROTTLE_KINDS:
                continue
            gpu = _num(fields.get("gpu"))
            scope = f"GPU {int(gpu)}" if gpu is not None else "host CPUs"
            at = round((t - t0) / 1e9, 3)
            ep = open_.get(scope)
            if kind == "throttle_enter":
                if ep is None:
                    ep = open_[scope] = {
                        "scope": scope,
                        "start_s": at,
                        "recovering_s": None,
                        "end_s": None,
                        "reasons": str(fields.get("reasons", "")),
                    }
                    out.append(ep)
                else:
                    ep["recovering_s"] = None  # back from recovering to throttled
            elif ep is not None and kind == "throttle_recovering":
                ep["recovering_s"] = at
            elif ep is not None and kind == "throttle_leave":
                ep["end_s"] = at
                del open_[scope]
        for ep in open_.values():
            # Still throttled when the data ends: shaded to the end, marked open.
            ep["end_s"] = round((last - t0) / 1e9, 3)
            ep["open"] = True
        for ep in out:
            ep.setdefault("open", False)
        return out


def _group_order(g: str) -> tuple[int, str]:
    return (int(g), "") if g.isdigit() else (1 << 30, g)


class _Fold:
    """Per-bucket reductions of the builder's columns over one time grid."""

    def __init__(self, b: SeriesBuilder, t0: int, span_s: float, bucket_s: float, lat_s: float) -> None:
        self.b, self.t0, self.span_s = b, t0, span_s
        self.width_ns = round(bucket_s * 1e9)
        self.bucket_s = bucket_s
        self.lat_ns = round(lat_s * 1e9)
        self.lat_s = lat_s

    def _x(self, idx: npt.NDArray[np.int64], width_s: float) -> list[float | None]:
        # A bucket is drawn at its middle (its last one at the middle of what it covers).
        return [_r(min((i + 0.5) * width_s, self.span_s)) for i in idx.tolist()]

    def reduce(self, key: tuple[str, str, str], how: str, width_ns: int | None = None) -> dict[int, float]:
        bk = self.b._bucketed(key, self.t0, width_ns or self.width_ns)
        if bk is None:
            return {}
        ufunc = {"min": np.minimum, "max": np.maximum, "sum": np.add}
        if how == "mean":
            sums = np.add.reduceat(bk.values, bk.starts)
            counts = np.diff(np.append(bk.starts, len(bk.values)))
            vals = sums / counts
        else:
            vals = ufunc[how].reduceat(bk.values, bk.starts)
        return dict(zip(bk.idx.tolist(), vals.tolist(), strict=True))

    def level(self, m: str, group: str, lo: str, mid: str, hi: str, name: str) -> dict[str, Any] | None:
        """min of `lo`, mean of `mid`, max of `hi` per bucket."""
        a = self.reduce((m, group, lo), "min")
        b = self.reduce((m, group, mid), "mean")
        c = self.reduce((m, group, hi), "max")
        return _series(name, self.bucket_s, self, {"lo": a, "mid": b, "hi": c})

    def ratio(self, m: str, group: str, rname: str, name: str, scale: float = 1.0) -> dict[str, Any] | None:
        num = self.reduce((m, group, f"{rname}#n"), "sum")
        den = self.reduce((m, group, f"{rname}#d"), "sum")
        mid = {i: num[i] / den[i] * scale for i in num if den.get(i)}
        return _series(name, self.bucket_s, self, {"mid": mid})

    def per_second(self, m: str, group: str, fname: str, name: str) -> dict[str, Any] | None:
        """Sum per bucket over the bucket's width. The last bucket may be cut short by the run's end
        and read low; dividing by the sliver it covers would draw a spike instead."""
        sums = self.reduce((m, group, fname), "sum")
        return _series(name, self.bucket_s, self, {"mid": {i: v / self.bucket_s for i, v in sums.items()}})

    def count(self, m: str, group: str, fname: str, name: str) -> dict[str, Any] | None:
        bk = self.b._bucketed((m, group, fname), self.t0, self.width_ns)
        if bk is None:
            return None
        counts = np.diff(np.append(bk.starts, len(bk.values)))
        return _series(
            name, self.bucket_s, self, {"mid": dict(zip(bk.idx.tolist(), counts.tolist(), strict=True))}
        )

    def percentiles(
        self, m: str, group: str, fname: str, qs: tuple[float, ...], scale: float, label: str = ""
    ) -> list[Any]:
        bk = self.b._bucketed((m, group, fname), self.t0, self.lat_ns)
        if bk is None:
            return []
        ends = np.append(bk.starts[1:], len(bk.values))
        out = []
        for q in qs:
            vals = {
                i: float(np.percentile(bk.values[s:e], q)) * scale
                for i, s, e in zip(bk.idx.tolist(), bk.starts.tolist(), ends.tolist(), strict=True)
            }
            out.append(_series(f"p{q:g}{label}", self.lat_s, self, {"mid": vals}))
        return [s for s in out if s is not None]


def _series(
    name: str, width_s: float, fold: _Fold, parts: Mapping[str, Mapping[int, float]]
) -> dict[str, Any] | None:
    idx = sorted(set().union(*(p.keys() for p in parts.values())))
    if not idx:
        return None
    out: dict[str, Any] = {
        "name": name,
        "t": fold._x(np.array(idx, dtype=np.int64), width_s),
    }
    for key, values in parts.items():
        if values:
            out[key] = [_r(values[i]) if i in values else None for i in idx]
    return out


def at_path(cfg: Mapping[str, Any], path: str, default: Any = None) -> Any:
    """The value at a dotted path of nested mappings ("telemetry.collectors"), or `default`."""
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _why(cfg: Mapping[str, Any], panel: str, b: SeriesBuilder) -> str:
    """Why a panel has no data, from what the run's config asked for."""
    collectors = at_path(cfg, "telemetry.collectors", None)

    def has(name: str) -> bool:
        return name in collectors if isinstance(collectors, list) else True

    if panel in ("sm_clock", "power", "temperature"):
        if not has("gpu") and not at_path(cfg, "telemetry.gpu_recording"):
            return "the gpu collector was not enabled (telemetry.collectors)"
        return "no gpu points: NVML saw no GPU, or it read nothing (GPU telemetry was off)"
    if panel == "throughput":
        return "no engine steps and no completed requests"
    if panel in ("ttft", "tpot"):
        return "no completed requests"
    if panel in ("spec_acceptance", "spec_drift"):
        if at_path(cfg, "engine.speculative.enabled") is False:
            return "speculative decoding was off (engine.speculative.enabled = false)"
        if not has("engine"):
            return "the engine collector was not enabled (telemetry.collectors)"
        if panel == "spec_drift" and b.fields_of("spec_decode"):
            return "no drift figures: the baseline window (telemetry.spec_drift.baseline) never filled"
        return "the engine reported no speculative-decoding counters"
    if panel == "cudagraph":
        if at_path(cfg, "engine.enforce_eager") is True:
            return "CUDA graphs were off (engine.enforce_eager = true)"
        if not has("engine"):
            return "the engine collector was not enabled (telemetry.collectors)"
        return "the engine reported no CUDA-graph steps (a CPU engine has none; engine.cudagraph_metrics)"
    if panel == "bandwidth":
        if "decode_ceiling_pct" in b.fields_of("engine"):
            return (
                "recorded before soakd counted decode steps: its decode_ceiling_pct divided tokens by a "
                "tokens ceiling, which speculation passes, so it is not drawn as a bandwidth share"
            )
        return (
            "no decode bandwidth (it needs a local model folder and a bandwidth: telemetry."
            "ceiling_bandwidth_gbs or a live GPU) and no GPM readings (Hopper or newer)"
        )
    if panel == "fragmentation":
        if not has("allocator"):
            return "the allocator collector was not enabled (telemetry.collectors)"
        return "no allocator points (the engine's worker extension gave none)"
    return "no data"


_PANEL_META: dict[str, dict[str, Any]] = {
    "sm_clock": {"title": "SM clock", "unit": "MHz"},
    "power": {"title": "GPU power", "unit": "W"},
    "temperature": {"title": "GPU temperature", "unit": "°C"},
    "throughput": {"title": "Throughput (output tokens)", "unit": "tokens/s"},
    "ttft": {
        "title": "Time to first token: as offered (from the due time) and from the send",
        "unit": "ms",
        "log": True,
    },
    "tpot": {"title": "Time per output token", "unit": "ms", "log": True},
    "spec_acceptance": {"title": "Spec-decode acceptance per draft position", "unit": "accepted share"},
    "spec_drift": {"title": "Spec-decode acceptance drift from the run's first window", "unit": "relative"},
    "cudagraph": {"title": "CUDA-graph hit rate (steps replayed from a graph)", "unit": "share of steps"},
    "bandwidth": {
        "title": "Memory bandwidth: decode steps' weight + KV reads (computed) and DRAM (GPM, measured)",
        "unit": "% of bandwidth",
    },
    "fragmentation": {"title": "Allocator fragmentation", "unit": "share of reserved"},
    "actions": {"title": "Actions timeline", "unit": "concurrency ceiling"},
}


def _panel(
    name: str, series: list[dict[str, Any] | None], cfg: Mapping[str, Any], b: SeriesBuilder, **extra: Any
) -> dict[str, Any]:
    kept = [s for s in series if s is not None]
    return {**_PANEL_META[name], "series": kept, "why": None if kept else _why(cfg, name, b), **extra}


def _empty_panels(cfg: Mapping[str, Any], b: SeriesBuilder) -> dict[str, Any]:
    out = {name: _panel(name, [], cfg, b) for name in _PANEL_META if name != "actions"}
    out["actions"] = {**_PANEL_META["actions"], "series": [], "why": "no events", "refs": []}
    return out


def _panels(f: _Fold, cfg: Mapping[str, Any]) -> dict[str, Any]:
    b = f.b
    panels = _gpu_panels(f, cfg)
    spec_pos = sorted(
        {fld.split("#")[0] for fld in b.fields_of("spec_decode") if fld.startswith("pos") and "#" in fld},
        key=lambda p: int(p[3:]),
    )
    threshold = at_path(cfg, "telemetry.spec_drift.threshold")
    ceiling = f.level("control", "", "ceiling", "ceiling", "ceiling", "concurrency ceiling")
    failed = (
        f.count("requests", "error", "lateness_s", "failed requests"),
        f.count("requests", "shed", "lateness_s", "shed requests"),
        f.count("requests", "incomplete", "lateness_s", "incomplete at the end"),
    )
    return {
        "sm_clock": panels["sm_clock"],
        "power": panels["power"],
        "temperature": panels["temperature"],
        "throughput": _panel(
            "throughput",
            [
                f.ratio("engine", "", "gen_tps", "engine generation"),
                f.per_second("requests", "ok", "output_tokens", "completed requests"),
            ],
            cfg,
            b,
            counts=[s for s in failed if s is not None],
        ),
        # The user's view first (from the due time), the server's beside it: apart, they show the wait
        # soakd's admission ceiling added.
        "ttft": _panel(
            "ttft",
            f.percentiles("requests", "ok", "ttft_offered_s", (50, 99), 1000.0, " as offered")
            + f.percentiles("requests", "ok", "ttft_s", (99,), 1000.0, " from the send"),
            cfg,
            b,
        ),
        "tpot": _panel("tpot", f.percentiles("requests", "ok", "tpot_s", (50, 99), 1000.0), cfg, b),
        "spec_acceptance": _panel(
            "spec_acceptance",
            [f.ratio("spec_decode", "", p, f"position {int(p[3:]) + 1}") for p in spec_pos]
            + [f.ratio("spec_decode", "", "all", "all positions")],
            cfg,
            b,
        ),
        "spec_drift": _panel(
            "spec_drift",
            [f.level("spec_decode", "", "acceptance_drift", "acceptance_drift", "acceptance_drift", "drift")],
            cfg,
            b,
            refs=[{"name": "drift threshold", "value": -float(threshold)}]
            if isinstance(threshold, int | float)
            else [],
        ),
        "cudagraph": _panel("cudagraph", [f.ratio("engine", "", "cg_hit", "hit rate")], cfg, b),
        "bandwidth": panels["bandwidth"],
        "fragmentation": _panel(
            "fragmentation",
            [
                f.level("allocator", w, "fragmentation", "fragmentation", "fragmentation", f"worker {w or 0}")
                for w in b.groups("allocator")
            ],
            cfg,
            b,
        ),
        "actions": {
            **_PANEL_META["actions"],
            "series": [ceiling] if ceiling else [],
            "why": None,
            "refs": [],
        },
    }


def _gpu_panels(f: _Fold, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Clock, power, temperature and memory bandwidth, one series per GPU."""
    b = f.b
    gpus = b.groups("gpu")
    many = len(gpus) > 1

    def label(g: str) -> str:
        return f"GPU {g}" if many else "GPU"

    limits = []
    for g in gpus:
        lim = f.reduce(("gpu", g, "power_limit_w"), "max")
        if lim:
            limits.append({"name": f"{label(g)} power limit", "value": _r(max(lim.values()))})
    temps: list[dict[str, Any] | None] = []
    for g in gpus:
        temps.append(f.level("gpu", g, "temp_c_max", "temp_c_max", "temp_c_max", f"{label(g)} core"))
        temps.append(
            f.level("gpu", g, "hbm_temp_c_max", "hbm_temp_c_max", "hbm_temp_c_max", f"{label(g)} HBM")
        )
    decode = f.level(
        "engine", "", "decode_bw_pct", "decode_bw_pct", "decode_bw_pct", "decode reads (computed)"
    )
    dram = [
        f.level("gpu", g, "gpm_dram_bw_pct", "gpm_dram_bw_pct", "gpm_dram_bw_pct", f"{label(g)} DRAM (GPM)")
        for g in gpus
    ]
    return {
        "sm_clock": _panel(
            "sm_clock",
            [f.level("gpu", g, "sm_mhz_min", "sm_mhz_mean", "sm_mhz_max", label(g)) for g in gpus],
            cfg,
            b,
        ),
        "power": _panel(
            "power",
            [f.level("gpu", g, "power_w_mean", "power_w_mean", "power_w_max", label(g)) for g in gpus],
            cfg,
            b,
            refs=limits,
        ),
        "temperature": _panel("temperature", temps, cfg, b),
        "bandwidth": _panel("bandwidth", [decode, *dram], cfg, b),
    }


def spool_samples(
    spool_dir: Path, measurements: Iterable[str] = MEASUREMENTS, on_damaged: DamagedFn | None = None
) -> Iterator[Sample]:
    """The spool's samples of `measurements`, in write order; other lines are skipped before parsing
    (most of a spool is host and collector points the report does not draw)."""
    return iter_samples(spool_dir, frozenset(measurements), on_damaged)
