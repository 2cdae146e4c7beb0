"""Fold every sample of a run into the run-level metrics the criteria judge and reports compare.

One fold serves `soakd run` (fed as points are written, so the verdict needs no re-read of a night's
spool while systemd's stop timeout runs), `soakd report` (fed from the spool) and a resumed run (fed from
the spool before it continues). Memory is bounded: request latencies go into `Quantiles`; everything
else into 10-second buckets (8 h is 2,880 buckets of a few sums each), from which windows of any
multiple of 10 s are built: `min(spec_acceptance, window=5m)`, `sustained_ratio(tokens_per_s, ...)`.

Over 500 lines because every run-level metric's fold is listed here, one per measurement, as the criteria
name them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from soakd.judge.requests import RequestFolder, RequestSummary
from soakd.lang.criteria import DISTRIBUTIONS
from soakd.metric import Sample

BUCKET_S = 10
_BUCKET_NS = BUCKET_S * 1_000_000_000

# Windows with less than this behind them are not judged: one draft in a quiet minute is not a rate.
MIN_DRAFT_TOKENS = 50
MIN_GRAPH_STEPS = 20
MIN_PREFIX_QUERIES = 20


@dataclass(slots=True)
class _Bucket:
    """Sums over one 10-second bucket (one per bucket that saw any point)."""

    out_tokens: int = 0
    finished: int = 0
    failed: int = 0
    drafted: int = 0
    accepted: int = 0
    cg_steps: int = 0
    cg_graph_steps: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    throttle: dict[str, list[float]] = field(default_factory=dict)
    """Per GPU: [seconds throttled, seconds observed] by its throttle detector."""
    sm_ratio_sum: float = 0.0
    sm_ratio_n: int = 0
    power_sum: float = 0.0
    power_n: int = 0
    temp_max: float = -math.inf
    frag: dict[str, float] = field(default_factory=dict)
    """Latest allocator fragmentation per worker."""
    kv_max: float = -math.inf


@dataclass(frozen=True, slots=True)
class SeriesDef:
    """A windowed series: how a window's value comes from its buckets, and what the whole run's is."""

    name: str
    unit: str
    window: Callable[[list[_Bucket], float], float | None]
    total: bool
    """Whether the bare name is meaningful over the whole run (a ratio of sums, a rate); otherwise an
    aggregate (min/max/mean) must be named."""
    doc: str


def _ratio(num: float, den: float, least: float) -> float | None:
    return num / den if den >= least and den > 0 else None


def _tokens_per_s(bs: list[_Bucket], span_s: float) -> float | None:
    return sum(b.out_tokens for b in bs) / span_s if span_s > 0 else None


def _requests_per_s(bs: list[_Bucket], span_s: float) -> float | None:
    return sum(b.finished for b in bs) / span_s if span_s > 0 else None


def _error_rate(bs: list[_Bucket], _s: float) -> float | None:
    return _ratio(sum(b.failed for b in bs), sum(b.finished for b in bs), 1)


def _spec(bs: list[_Bucket], _s: float) -> float | None:
    return _ratio(sum(b.accepted for b in bs), sum(b.drafted for b in bs), MIN_DRAFT_TOKENS)


def _graphs(bs: list[_Bucket], _s: float) -> float | None:
    return _ratio(sum(b.cg_graph_steps for b in bs), sum(b.cg_steps for b in bs), MIN_GRAPH_STEPS)


def _prefix(bs: list[_Bucket], _s: float) -> float | None:
    return _ratio(sum(b.prefix_hits for b in bs), sum(b.prefix_queries for b in bs), MIN_PREFIX_QUERIES)


def _throttle_pct(bs: list[_Bucket], _s: float) -> float | None:
    per_gpu: dict[str, list[float]] = {}
    for b in bs:
        for gpu, (throttled, seen) in b.throttle.items():
            acc = per_gpu.setdefault(gpu, [0.0, 0.0])
            acc[0] += throttled
            acc[1] += seen
    # The worst GPU: one throttled GPU holds back every batch that spans it.
    pcts = [100.0 * t / seen for t, seen in per_gpu.values() if seen > 0]
    return max(pcts) if pcts else None


def _sm_ratio(bs: list[_Bucket], _s: float) -> float | None:
    n = sum(b.sm_ratio_n for b in bs)
    return sum(b.sm_ratio_sum for b in bs) / n if n else None


def _power(bs: list[_Bucket], _s: float) -> float | None:
    n = sum(b.power_n for b in bs)
    return sum(b.power_sum for b in bs) / n if n else None


def _temp(bs: list[_Bucket], _s: float) -> float | None:
    t = max((b.temp_max for b in bs), default=-math.inf)
    return t if t > -math.inf else None


def _frag(bs: list[_Bucket], _s: float) -> float | None:
    values = [v for b in bs for v in b.frag.values()]
    return max(values) if values else None


def _kv(bs: list[_Bucket], _s: float) -> float | None:
    v = max((b.kv_max for b in bs), default=-math.inf)
    return v if v > -math.inf else None


SERIES: dict[str, SeriesDef] = {
    s.name: s
    for s in (
        SeriesDef("tokens_per_s", "tok/s", _tokens_per_s, True, "output tokens of finished requests per s"),
        SeriesDef("requests_per_s", "req/s", _requests_per_s, True, "requests finished (ok or not) per s"),
        SeriesDef("error_rate_window", "ratio", _error_rate, False, "failed / finished, per window"),
        SeriesDef("spec_acceptance", "ratio", _spec, True, "accepted / drafted speculative tokens"),
        SeriesDef("graph_hit_rate", "ratio", _graphs, True, "engine steps run as a CUDA graph / all steps"),
        SeriesDef("prefix_hit_rate", "ratio", _prefix, True, "prefix-cache hits / queries (tokens)"),
        SeriesDef(
            "throttle_pct", "%", _throttle_pct, False, "% of the window a GPU was throttled (worst GPU)"
        ),
        SeriesDef("sm_clock_ratio", "ratio", _sm_ratio, False, "SM clock / max SM clock, mean over GPUs"),
        SeriesDef("power_w", "W", _power, False, "GPU power, mean over GPUs"),
        SeriesDef("temp_c", "C", _temp, False, "hottest GPU temperature"),
        SeriesDef("fragmentation", "ratio", _frag, False, "allocator fragmentation, worst worker"),
        SeriesDef("kv_cache_usage", "ratio", _kv, False, "KV-cache usage, highest"),
    )
}


def _num(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


class RunMetrics:
    """The fold. `add` every sample (requests included); read scalars, series and windows after."""

    def __init__(self, requests: RequestFolder | None = None) -> None:
        self.requests = requests if requests is not None else RequestFolder()
        self.lost_in_flight = 0
        """Requests in flight at the crashes the run was resumed from (its checkpoint's interruptions):
        scheduled and failed in every count read here, as in the verdict's criteria."""
        self._buckets: dict[int, _Bucket] = {}
        self._req_first_ns: int | None = None
        self._req_last_ns: int | None = None
        # Cumulative throttle-detector readings per GPU: (last throttled_s, last time ns).
        self._throttle_prev: dict[str, tuple[float, int]] = {}
        self._host_throttled_s = 0.0
        self._host_span_s = 0.0
        self._host_prev: tuple[float, int] | None = None
        self.events: dict[str, int] = {}
        self.peak_gpu_mem_bytes: float | None = None
        self.peak_engine_rss_bytes: float | None = None
        self.harness_saturated_s = 0.0
        """Seconds the loop watch judged soakd's own event loop late (the sum of its `late_s`)."""
        # soakd's process CPU: the last host sample's (time ns, CPU s), and the CPU and wall seconds summed
        # over consecutive samples of one process (a resumed run is another process: not summed across).
        self._self_last: tuple[int, float] | None = None
        self._self_cpu_s = 0.0
        self._self_wall_s = 0.0
        self.peak_allocator_reserved_bytes: float | None = None
        self._spec_drafted = 0
        self._spec_accepted = 0
        self._cg_steps = 0
        self._cg_graph = 0
        self._prefix_q = 0
        self._prefix_h = 0
        self._first_ns: int | None = None
        self._last_ns: int | None = None

    # -- folding -----------------------------------------------------------------------------------

    def _bucket(self, t_ns: int) -> _Bucket:
        key = t_ns // _BUCKET_NS
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        return b

    def add(self, s: Sample) -> None:
        m = s.measurement
        handler = _HANDLERS.get(m)
        if handler is None:
            return
        t = s.time_ns
        self._first_ns = t if self._first_ns is None else min(self._first_ns, t)
        self._last_ns = t if self._last_ns is None else max(self._last_ns, t)
        handler(self, s)

    def add_all(self, samples: Iterable[Sample]) -> RunMetrics:
        for s in samples:
            self.add(s)
        return self

    def _add_request(self, s: Sample) -> None:
        self.requests.add(s)
        t = s.time_ns
        self._req_first_ns = t if self._req_first_ns is None else min(self._req_first_ns, t)
        self._req_last_ns = t if self._req_last_ns is None else max(self._req_last_ns, t)
        status = s.tags.get("status", "error")
        if status == "shed":
            return
        b = self._bucket(t)
        # A request the run's end cut short is neither done nor failed; its tokens were served.
        if status != "incomplete":
            b.finished += 1
            b.failed += int(status != "ok")
        out = s.fields.get("output_tokens")
        if isinstance(out, int) and not isinstance(out, bool):
            b.out_tokens += out

    def _add_engine(self, s: Sample) -> None:
        f = s.fields
        b = self._bucket(s.time_ns)
        steps = _num(f.get("cg_steps"))
        graph = _num(f.get("cg_graph_steps"))
        if steps is not None and graph is not None:
            b.cg_steps += int(steps)
            b.cg_graph_steps += int(graph)
            self._cg_steps += int(steps)
            self._cg_graph += int(graph)
        q = _num(f.get("prefix_queries"))
        h = _num(f.get("prefix_hits"))
        if q is not None and h is not None:
            b.prefix_queries += int(q)
            b.prefix_hits += int(h)
            self._prefix_q += int(q)
            self._prefix_h += int(h)
        kv = _num(f.get("kv_cache_usage_max"))
        if kv is not None:
            b.kv_max = max(b.kv_max, kv)

    def _add_spec(self, s: Sample) -> None:
        drafted = _num(s.fields.get("draft_tokens"))
        accepted = _num(s.fields.get("accepted"))
        if drafted is None or accepted is None:
            return
        b = self._bucket(s.time_ns)
        b.drafted += int(drafted)
        b.accepted += int(accepted)
        self._spec_drafted += int(drafted)
        self._spec_accepted += int(accepted)

    def _add_gpu(self, s: Sample) -> None:
        f = s.fields
        b = self._bucket(s.time_ns)
        ratio = _num(f.get("sm_clock_ratio"))
        if ratio is not None:
            b.sm_ratio_sum += ratio
            b.sm_ratio_n += 1
        power = _num(f.get("power_w_mean"))
        if power is not None:
            b.power_sum += power
            b.power_n += 1
        temp = _num(f.get("temp_c_max"))
        if temp is not None:
            b.temp_max = max(b.temp_max, temp)
        mem = _num(f.get("mem_used_bytes"))
        if mem is not None:
            self.peak_gpu_mem_bytes = max(self.peak_gpu_mem_bytes or 0.0, mem)

    def _add_throttle(self, s: Sample) -> None:
        value = _num(s.fields.get("throttled_s"))
        if value is None:
            return
        t = s.time_ns
        if s.tags.get("scope") == "host":
            prev_h = self._host_prev
            self._host_prev = (value, t)
            if prev_h is not None:
                # A detector restarted by a resumed run starts from 0 again: its new total is growth.
                self._host_throttled_s += value - prev_h[0] if value >= prev_h[0] else value
                self._host_span_s += max(0.0, (t - prev_h[1]) / 1e9)
            return
        gpu = s.tags.get("gpu", "")
        prev = self._throttle_prev.get(gpu)
        self._throttle_prev[gpu] = (value, t)
        if prev is None:
            return
        grown = value - prev[0] if value >= prev[0] else value
        span = max(0.0, (t - prev[1]) / 1e9)
        acc = self._bucket(t).throttle.setdefault(gpu, [0.0, 0.0])
        acc[0] += grown
        acc[1] += span

    def _add_allocator(self, s: Sample) -> None:
        f = s.fields
        frag = _num(f.get("fragmentation"))
        worker = s.tags.get("worker", "")
        if frag is not None:
            self._bucket(s.time_ns).frag[worker] = frag
        reserved = _num(f.get("reserved_bytes_peak"))
        if reserved is None:
            reserved = _num(f.get("reserved_bytes"))
        if reserved is not None:
            self.peak_allocator_reserved_bytes = max(self.peak_allocator_reserved_bytes or 0.0, reserved)

    def _add_host(self, s: Sample) -> None:
        rss = _num(s.fields.get("engine_rss_bytes"))
        if rss is not None:
            self.peak_engine_rss_bytes = max(self.peak_engine_rss_bytes or 0.0, rss)
        cpu = _num(s.fields.get("soakd_cpu_seconds"))
        if cpu is not None:
            last, self._self_last = self._self_last, (s.time_ns, cpu)
            if last is not None:
                wall = (s.time_ns - last[0]) / 1e9
                # A counter that went back, or a gap no collector interval explains: another process.
                if cpu >= last[1] and 0 < wall <= _SAME_PROCESS_GAP_S:
                    self._self_cpu_s += cpu - last[1]
                    self._self_wall_s += wall

    def _add_loop(self, s: Sample) -> None:
        self.harness_saturated_s += _num(s.fields.get("late_s")) or 0.0

    def soakd_cpu_pct(self) -> float | None:
        """soakd's process CPU over the run, % of one core (None without two host samples)."""
        return 100.0 * self._self_cpu_s / self._self_wall_s if self._self_wall_s > 0 else None

    def _add_event(self, s: Sample) -> None:
        kind = s.tags.get("kind", "")
        self.events[kind] = self.events.get(kind, 0) + 1

    # -- reading -----------------------------------------------------------------------------------

    def summary(self) -> RequestSummary:
        """The whole run's requests: the records folded, and those lost in flight at crashes."""
        return self.requests.summary().with_lost(self.lost_in_flight)

    @property
    def span_s(self) -> float:
        """Seconds between the first and the last request record (the replay, as its records show)."""
        if self._req_first_ns is None or self._req_last_ns is None:
            return 0.0
        return (self._req_last_ns - self._req_first_ns) / 1e9

    def _range(self) -> tuple[int, int] | None:
        """First and last bucket keys of the replay (request records), else of any point."""
        first, last = self._req_first_ns, self._req_last_ns
        if first is None or last is None:
            first, last = self._first_ns, self._last_ns
        if first is None or last is None:
            return None
        return first // _BUCKET_NS, last // _BUCKET_NS

    def windows(self, name: str, window_s: float) -> list[tuple[float, float]]:
        """(window start as Unix seconds, value) over the replay in windows of `window_s`; windows with
        too little behind them (see MIN_*) are left out. A trailing partial window is dropped unless it is
        the only one."""
        series = SERIES[name]
        rng = self._range()
        if rng is None:
            return []
        per = max(1, round(window_s / BUCKET_S))
        lo, hi = rng
        out: list[tuple[float, float]] = []
        k = lo
        while k <= hi:
            end = min(k + per, hi + 1)
            if end - k < per and out:
                break
            bs = [self._buckets[i] for i in range(k, end) if i in self._buckets]
            value = series.window(bs, (end - k) * BUCKET_S)
            if value is not None:
                out.append((k * BUCKET_S, value))
            k += per
        return out

    def over(self, name: str, *, first_s: float | None = None, last_s: float | None = None) -> float | None:
        """The series' value over the whole replay, or over its first or last `*_s` seconds."""
        series = SERIES[name]
        rng = self._range()
        if rng is None:
            return None
        lo, hi = rng
        if first_s is not None:
            hi = min(hi, lo + max(1, round(first_s / BUCKET_S)) - 1)
        elif last_s is not None:
            lo = max(lo, hi - max(1, round(last_s / BUCKET_S)) + 1)
        bs = [self._buckets[i] for i in range(lo, hi + 1) if i in self._buckets]
        # Over the whole replay a rate is per second of the replay itself (the records' span, none without
        # records), not of the 10-second buckets it touches; the other series do not use the span.
        whole = first_s is None and last_s is None
        return series.window(bs, self.span_s if whole else (hi - lo + 1) * BUCKET_S)

    def throttle_time_pct(self) -> float | None:
        """% of the replay (the whole observation if nothing was replayed) that the worst GPU's throttle
        detector spent in its throttled state."""
        return self.over("throttle_pct")

    def host_throttle_time_pct(self) -> float | None:
        return 100.0 * self._host_throttled_s / self._host_span_s if self._host_span_s > 0 else None

    def fragmentation_growth(self) -> float | None:
        """Fragmentation of the last window minus the first (worst worker), windows a quarter of the run
        up to 10 minutes: growth means the allocator is fragmenting under this traffic."""
        rng = self._range()
        if rng is None:
            return None
        lo, hi = rng
        per = max(1, min(60, (hi - lo + 1) // 4))
        first: dict[str, list[float]] = {}
        last: dict[str, list[float]] = {}
        for i in range(lo, lo + per):
            for w, v in self._buckets[i].frag.items() if i in self._buckets else ():
                first.setdefault(w, []).append(v)
        for i in range(hi - per + 1, hi + 1):
            for w, v in self._buckets[i].frag.items() if i in self._buckets else ():
                last.setdefault(w, []).append(v)
        growth = [sum(last[w]) / len(last[w]) - sum(first[w]) / len(first[w]) for w in last if w in first]
        return max(growth) if growth else None

    def _request_scalars(self) -> dict[str, float | None]:
        s = self.summary()
        return {
            "requests": float(s.scheduled),
            "completed": float(s.completed),
            "errors": float(s.failed),
            "incomplete": float(s.incomplete),
            "shed": float(s.shed),
            "error_rate": s.error_rate,
            "completed_ratio": s.completed_ratio,
            "admission_wait_share": s.admission_wait_share,
            "output_tokens": float(s.output_tokens),
            "input_tokens": float(s.input_tokens),
        }

    def scalar(self, name: str) -> float | None:
        """One run scalar by its bare criteria name, computed alone (an `abort_on` check judged every few
        seconds must not compute every metric of the run)."""
        fn = _RUN_SCALARS.get(name)
        if fn is not None:
            return fn(self)
        series = SERIES.get(name)
        if series is not None and series.total:
            return self.over(name)
        return self._request_scalars().get(name)

    def scalars(self) -> dict[str, float | None]:
        """Every run-level metric by its criteria name (what verdict.json's `metrics` holds)."""
        out = self._request_scalars()
        for dist in DISTRIBUTIONS:
            q = self.requests.quantiles(dist)
            for p in (50, 90, 99):
                v = q.percentile(p)
                out[f"p{p}({dist})"] = v * 1000.0 if v is not None else None
            out[f"max({dist})"] = q.max * 1000.0 if q.max is not None else None
        for name, series in SERIES.items():
            if series.total:
                out[name] = self.over(name)
        for name, fn in _RUN_SCALARS.items():
            out[name] = fn(self)
        out["min(sm_clock_ratio)"] = _min(self.windows("sm_clock_ratio", 60))
        out["max(temp_c)"] = self.over("temp_c")
        out["min(spec_acceptance)"] = _min(self.windows("spec_acceptance", 60))
        return out


def _min(points: list[tuple[float, float]]) -> float | None:
    return min((v for _, v in points), default=None)


# Host samples (every telemetry.interval) further apart than this had a crash and a resume between them.
_SAME_PROCESS_GAP_S = 15.0

_HANDLERS: dict[str, Callable[[RunMetrics, Sample], None]] = {
    "requests": RunMetrics._add_request,
    "engine": RunMetrics._add_engine,
    "spec_decode": RunMetrics._add_spec,
    "gpu": RunMetrics._add_gpu,
    "throttle": RunMetrics._add_throttle,
    "allocator": RunMetrics._add_allocator,
    "host": RunMetrics._add_host,
    "events": RunMetrics._add_event,
    "loop": RunMetrics._add_loop,
}
# The run scalars that are neither request counts nor a series over the whole run.
_RUN_SCALARS: dict[str, Callable[[RunMetrics], float | None]] = {
    "throttle_time_pct": RunMetrics.throttle_time_pct,
    "host_throttle_time_pct": RunMetrics.host_throttle_time_pct,
    "fragmentation_growth": RunMetrics.fragmentation_growth,
    "peak_gpu_mem_bytes": lambda m: m.peak_gpu_mem_bytes,
    "peak_engine_rss_bytes": lambda m: m.peak_engine_rss_bytes,
    "soakd_cpu_pct": RunMetrics.soakd_cpu_pct,
    "harness_saturated_s": lambda m: m.harness_saturated_s,
    "peak_allocator_reserved_bytes": lambda m: m.peak_allocator_reserved_bytes,
    "engine_restarts": lambda m: float(m.events.get("engine_restart", 0)),
    "engine_rebuilds": lambda m: float(m.events.get("engine_rebuild", 0)),
    "throttle_episodes": lambda m: float(m.events.get("throttle_enter", 0)),
    "recaptures": lambda m: float(m.events.get("recapture", 0)),
    "replay_s": lambda m: m.span_s,
}
METRIC_MEASUREMENTS = frozenset(_HANDLERS)
"""The measurements the fold reads (a spool reader can skip every other line unparsed)."""
METRIC_FIELDS: dict[str, tuple[str, ...] | None] = {
    "requests": None,
    "engine": ("cg_steps", "cg_graph_steps", "prefix_queries", "prefix_hits", "kv_cache_usage_max"),
    "spec_decode": ("draft_tokens", "accepted"),
    "gpu": ("sm_clock_ratio", "power_w_mean", "temp_c_max", "mem_used_bytes"),
    "throttle": ("throttled_s",),
    "allocator": ("fragmentation", "reserved_bytes_peak", "reserved_bytes"),
    "host": ("engine_rss_bytes", "soakd_cpu_seconds"),
    "events": None,
    "loop": ("late_s",),
}
"""The fields the fold reads, per measurement (None: all): what a reader of InfluxDB must ask for."""
