"""Scrape a vLLM OpenAI server's Prometheus `/metrics` into per-interval Samples.

Two uses, chosen by `per_step`:

* attach mode (`per_step=False`): soakd did not launch the server, so no per-step stat logger runs inside
  it and `/metrics` is the only window into the engine. The counter deltas go into the same `engine` and
  `spec_decode` measurements and field names as EngineCollector writes, so one dashboard serves both
  kinds of run; a string field `source="metrics"` says where a point came from (a field, not a tag: a
  tag would split the series). Gauges are one sample per scrape, not a maximum over steps, so they get
  their own names (`running`, `waiting`, `kv_cache_usage`) rather than EngineCollector's `*_max`/`*_mean`.
* per-step mode (`per_step=True`): soakd's own stat logger already feeds `engine`; the scrape is written
  to one `vllm_metrics` measurement under short names, with the server-side latency means of the
  interval (delta of a histogram's sum / delta of its count), as the cross-check of soakd's client-side
  numbers.

`refresh()` (slow tier, I/O) fetches and parses one snapshot and adds the counter deltas since the
previous snapshot to what the next `collect()` hands out, so two refreshes between collects lose
nothing. The first snapshot is only a baseline. A counter that goes down (or a changed
`process_start_time_seconds`) means the server restarted: the new values are the deltas from 0, and the
restart is counted in `counter_resets`.

Parsing is kept cheap: only the lines of the families used here (no buckets, no HELP, no `_created`)
are handed to prometheus_client's parser: about 2.5 ms for a 53 kB scrape of one engine, where parsing
all of it takes 15-20 ms.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from soakd.errors import CollectorError
from soakd.metric import FieldValue, Sample

if TYPE_CHECKING:
    from soakd.engine.base import EngineInfo

# Counters: sample name at /metrics -> snapshot key. Summed over every label set (model_name, engine,
# finished_reason ...), except the per-position acceptance counter (keyed by `position`) and
# request_success, which is also kept per `finished_reason`.
COUNTERS: dict[str, str] = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prompt_tokens_cached_total": "prompt_tokens_cached",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "num_preemptions",
    "vllm:request_success_total": "request_success",
    "vllm:spec_decode_num_drafts_total": "spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "spec_decode_num_accepted_tokens_pos",
}
# Histograms: family name -> key; only `_sum` and `_count` are read (as counters).
HISTOGRAMS: dict[str, str] = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:request_time_per_output_token_seconds": "tpot",
    "vllm:e2e_request_latency_seconds": "e2e",
    "vllm:request_queue_time_seconds": "queue_time",
    "vllm:request_prefill_time_seconds": "prefill_time",
    "vllm:request_decode_time_seconds": "decode_time",
    "vllm:iteration_tokens_total": "iteration_tokens",
}
# Gauges: sample name -> key. Request counts are summed over engines; the KV-cache usage is averaged.
GAUGES: dict[str, str] = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
}
_MEAN_GAUGES = frozenset({"kv_cache_usage_perc"})
START_TIME = "process_start_time_seconds"
"""The front-end process's start time: when it changes between scrapes, the server restarted."""

SPEC_FAMILIES = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def _family(counter_sample: str) -> str:
    return counter_sample.removesuffix("_total")


CONSUMED_FAMILIES: tuple[str, ...] = (
    *(_family(n) for n in COUNTERS),
    *HISTOGRAMS,
    *GAUGES,
)
"""The metric families soakd reads, as prometheus_client names them (counters without `_total`)."""


def _line_prefixes() -> tuple[str, ...]:
    names = [*COUNTERS, *GAUGES, START_TIME]
    names += [h + suffix for h in HISTOGRAMS for suffix in ("_sum", "_count")]
    # A counter's TYPE line names it with `_total` (prometheus_client's text format) or without it.
    types = [*CONSUMED_FAMILIES, *COUNTERS, START_TIME]
    return (
        *(n + end for n in names for end in ("{", " ")),
        *(f"# TYPE {t} " for t in types),
    )


_PREFIXES = _line_prefixes()


def select_lines(text: str) -> str:
    """The lines of `text` that the scraper reads: samples and TYPE lines of the consumed families."""
    return "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES)) + "\n"


@dataclass(slots=True)
class Snapshot:
    """One parsed scrape: counter values (histogram sums and counts included), gauges, start time."""

    t: float
    """Monotonic time of the scrape, seconds."""
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    start_time: float | None = None
    families: frozenset[str] = frozenset()


def parse_metrics(text: str, t: float = 0.0) -> Snapshot:
    """Parse a `/metrics` body (Prometheus text format) into a Snapshot of what soakd uses.

    Raises CollectorError when the text cannot be parsed.
    """
    snap = Snapshot(t=t)
    counters = snap.counters
    gauge_sums: dict[str, float] = {}
    gauge_n: dict[str, int] = {}
    families: set[str] = set()
    try:
        for family in text_string_to_metric_families(select_lines(text)):
            families.add(family.name)
            for s in family.samples:
                name = s.name
                if name in COUNTERS:
                    key = COUNTERS[name]
                    if key == "spec_decode_num_accepted_tokens_pos":
                        key += s.labels.get("position", "")
                    elif key == "request_success" and "finished_reason" in s.labels:
                        reason = f"request_success_{s.labels['finished_reason']}"
                        counters[reason] = counters.get(reason, 0.0) + s.value
                    counters[key] = counters.get(key, 0.0) + s.value
                elif name in GAUGES:
                    key = GAUGES[name]
                    gauge_sums[key] = gauge_sums.get(key, 0.0) + s.value
                    gauge_n[key] = gauge_n.get(key, 0) + 1
                elif name == START_TIME:
                    snap.start_time = s.value
                else:
                    base, _, suffix = name.rpartition("_")
                    if base in HISTOGRAMS and suffix in ("sum", "count"):
                        key = f"{HISTOGRAMS[base]}_{suffix}"
                        counters[key] = counters.get(key, 0.0) + s.value
    except ValueError as err:  # the parser's error for a malformed line
        raise CollectorError(f"unparseable /metrics text: {err}") from err
    for key, total in gauge_sums.items():
        snap.gauges[key] = total / gauge_n[key] if key in _MEAN_GAUGES else total
    snap.families = frozenset(families - {START_TIME})
    return snap


def counter_deltas(old: Snapshot, new: Snapshot) -> tuple[dict[str, float], bool]:
    """Counter increments from `old` to `new`, and whether the server restarted in between.

    A restart (any counter lower than before, or another process start time) makes the new values the
    increments from zero. A counter that first appears in `new` counts from zero as well.
    """
    restarted = (
        old.start_time is not None and new.start_time is not None and new.start_time != old.start_time
    ) or any(value < old.counters[key] for key, value in new.counters.items() if key in old.counters)
    if restarted:
        return dict(new.counters), True
    return {k: v - old.counters.get(k, 0.0) for k, v in new.counters.items()}, False


class MetricsScraper:
    """RefreshingCollector over a vLLM server's `/metrics` (see the module docstring for the two modes).

    `fetch` returns the body of one `/metrics` GET (see `http_fetch`). After each refresh,
    `last_parse_s` and `last_bytes` tell what the parse cost; `families_seen` what the server exports
    of `CONSUMED_FAMILIES`; `resets` counts the restarts seen since construction.
    """

    name = "vllm_metrics"

    def __init__(
        self,
        fetch: Callable[[], Awaitable[str]],
        per_step: bool,
        config_id: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self.per_step = per_step
        self.config_id = config_id
        self._clock = clock
        self._last: Snapshot | None = None
        self._pending: dict[str, float] = {}
        self._pending_since: float | None = None
        """Scrape time the pending deltas start from; None while nothing new was scraped."""
        self._pending_resets = 0
        self.resets = 0
        self.last_parse_s = 0.0
        self.last_bytes = 0
        self.families_seen: frozenset[str] = frozenset()

    def engine_started(self, info: EngineInfo) -> None:
        """After a rebuild the series carry the new configuration's id."""
        self.config_id = info.config_id

    async def refresh(self) -> None:
        text = await self._fetch()
        t = self._clock()
        t0 = time.perf_counter()
        snap = parse_metrics(text, t)
        self.last_parse_s = time.perf_counter() - t0
        self.last_bytes = len(text)
        if not snap.families:
            raise CollectorError("the /metrics text has no vllm:* metrics soakd reads (not a vLLM server?)")
        self.update(snap)

    def update(self, snap: Snapshot) -> None:
        """Take a parsed snapshot: add its deltas from the previous one to what `collect` hands out."""
        self.families_seen = snap.families
        last, self._last = self._last, snap
        if last is None:
            return  # the baseline: nothing to compare with yet
        deltas, restarted = counter_deltas(last, snap)
        for key, value in deltas.items():
            self._pending[key] = self._pending.get(key, 0.0) + value
        if restarted:
            self.resets += 1
            self._pending_resets += 1
        if self._pending_since is None:
            self._pending_since = last.t

    def rebase(self) -> None:
        """Forget what the server counted until now (start-up, warm-up): deltas start at the last scrape."""
        self._pending.clear()
        self._pending_since = None
        self._pending_resets = 0

    def missing(self) -> list[str]:
        """`missing_signals` for this scraper's mode and the families its last scrape had."""
        return missing_signals(self.per_step, set(self.families_seen))

    def collect(self, now_ns: int) -> Sequence[Sample]:
        last = self._last
        if last is None or self._pending_since is None:
            return []  # no scrape since the previous collect (or only the baseline)
        deltas, resets = self._pending, self._pending_resets
        interval_s = last.t - self._pending_since
        self._pending, self._pending_since, self._pending_resets = {}, None, 0
        tags = {"config": self.config_id} if self.config_id else {}
        if self.per_step:
            fields = _cross_check_fields(deltas, last)
            fields["counter_resets"] = resets
            fields["interval_s"] = interval_s
            return [Sample("vllm_metrics", fields, now_ns, tags=dict(tags))]
        engine = _engine_fields(deltas, last)
        engine["counter_resets"] = resets
        engine["interval_s"] = interval_s
        engine["source"] = "metrics"
        out = [Sample("engine", engine, now_ns, tags=dict(tags))]
        if any(_seen(f, last.families) for f in SPEC_FAMILIES):
            spec = _spec_fields(deltas)
            spec["interval_s"] = interval_s
            spec["source"] = "metrics"
            out.append(Sample("spec_decode", spec, now_ns, tags=dict(tags)))
        return out

    def close(self) -> None:
        self._pending.clear()


def _n(deltas: dict[str, float], key: str) -> int:
    return round(deltas.get(key, 0.0))


def _positions(deltas: dict[str, float]) -> list[int]:
    prefix = "spec_decode_num_accepted_tokens_pos"
    return sorted(
        int(k[len(prefix) :]) for k in deltas if k.startswith(prefix) and k[len(prefix) :].isdigit()
    )


def _gauges(snap: Snapshot, fields: dict[str, FieldValue], names: dict[str, str]) -> None:
    for key, name in names.items():
        if key in snap.gauges:
            value = snap.gauges[key]
            fields[name] = value if key in _MEAN_GAUGES else round(value)


def _engine_fields(deltas: dict[str, float], snap: Snapshot) -> dict[str, FieldValue]:
    """EngineCollector's `engine` fields that /metrics can give, same names and types."""
    f: dict[str, FieldValue] = {}
    queries = _n(deltas, "prefix_cache_queries")
    hits = _n(deltas, "prefix_cache_hits")
    f["prefix_queries"] = queries
    f["prefix_hits"] = hits
    if queries:
        f["prefix_hit_rate"] = hits / queries
    f["prompt_tokens"] = _n(deltas, "prompt_tokens")
    f["prompt_tokens_cached"] = _n(deltas, "prompt_tokens_cached")
    f["generation_tokens"] = _n(deltas, "generation_tokens")
    f["preempted"] = _n(deltas, "num_preemptions")
    f["finished"] = _n(deltas, "request_success")
    # vllm:iteration_tokens_total: one observation per front-end iteration, of computed prompt plus
    # generated tokens (prefix-cache hits not included, unlike EngineCollector's tokens_per_step_mean).
    iterations = _n(deltas, "iteration_tokens_count")
    f["iterations"] = iterations
    if iterations:
        f["iteration_tokens_mean"] = deltas.get("iteration_tokens_sum", 0.0) / iterations
    _gauges(
        snap,
        f,
        {
            "num_requests_running": "running",
            "num_requests_waiting": "waiting",
            "kv_cache_usage_perc": "kv_cache_usage",
        },
    )
    return f


def _spec_fields(deltas: dict[str, float]) -> dict[str, FieldValue]:
    """EngineCollector's `spec_decode` fields that /metrics can give, same names and types.

    /metrics has no per-position draft-token counter, so `acceptance_rate_pos{i}` divides by the number
    of drafts, as vLLM's own log line does (with ngram, which may propose fewer than k tokens, this is
    lower than EngineCollector's accepted / drafted at that position).
    """
    drafts = _n(deltas, "spec_decode_num_drafts")
    draft_tokens = _n(deltas, "spec_decode_num_draft_tokens")
    accepted = _n(deltas, "spec_decode_num_accepted_tokens")
    f: dict[str, FieldValue] = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted}
    if draft_tokens:
        f["acceptance_rate"] = accepted / draft_tokens
    if drafts:
        f["mean_acceptance_length"] = 1.0 + accepted / drafts
    for i in _positions(deltas):
        acc = _n(deltas, f"spec_decode_num_accepted_tokens_pos{i}")
        f[f"accepted_pos{i}"] = acc
        if drafts:
            f[f"acceptance_rate_pos{i}"] = acc / drafts
    return f


_LATENCIES = ("ttft", "itl", "tpot", "e2e", "queue_time", "prefill_time", "decode_time")


def _cross_check_fields(deltas: dict[str, float], snap: Snapshot) -> dict[str, FieldValue]:
    """The `vllm_metrics` fields: counter deltas under short names, gauges, interval latency means."""
    f: dict[str, FieldValue] = {}
    for key, value in deltas.items():
        if key.endswith(("_sum", "_count")):
            continue
        f[key] = round(value)
    for name in _LATENCIES:
        count = _n(deltas, f"{name}_count")
        if f"{name}_count" not in deltas:
            continue
        total = deltas.get(f"{name}_sum", 0.0)
        f[f"{name}_count"] = count
        f[f"{name}_sum_s"] = total
        if count:
            f[f"{name}_mean_s"] = total / count
    if "iteration_tokens_count" in deltas:
        iterations = _n(deltas, "iteration_tokens_count")
        f["iterations"] = iterations
        f["iteration_tokens"] = _n(deltas, "iteration_tokens_sum")
        if iterations:
            f["iteration_tokens_mean"] = deltas.get("iteration_tokens_sum", 0.0) / iterations
    _gauges(snap, f, {key: key for key in GAUGES.values()})
    return f


def _seen(family: str, families_seen: Iterable[str]) -> bool:
    seen = set(families_seen)
    return family in seen or family + "_total" in seen


def missing_signals(per_step: bool, families_seen: set[str]) -> list[str]:
    """What a run lacks compared with soakd's own per-step logger, in plain words for the report.

    `families_seen`: the metric family names the server exports (as prometheus_client names them, with
    or without a counter's `_total`). With `per_step` the engine signals come from soakd's own logger,
    so only the server-side cross-checks the server does not export are listed.
    """
    out: list[str] = []
    spec = [f for f in SPEC_FAMILIES if _seen(f, families_seen)]
    if not per_step:
        out += [
            "CUDA-graph hit rate and padding waste (no /metrics counter exists)",
            "per-step batch sizes and running/waiting maxima (gauges are sampled once per scrape; "
            "only the mean tokens per iteration, from vllm:iteration_tokens_total)",
            "allocator fragmentation and per-worker GPU memory (needs a worker extension in the server)",
        ]
        if spec:
            out.append(
                "per-position draft-token counts (acceptance_rate_pos{i} divides by drafts, "
                "as vLLM's own log does)"
            )
        else:
            out.append(
                "speculative decoding acceptance (no vllm:spec_decode_* counters: spec decoding is "
                "off, or the server does not export them)"
            )
    skip = set(SPEC_FAMILIES)
    for family in CONSUMED_FAMILIES:
        if family not in skip and not _seen(family, families_seen):
            out.append(f"{family} (not exported by this server)")
    return out


def http_fetch(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float = 5.0
) -> Callable[[], Awaitable[str]]:
    """A `fetch` for MetricsScraper: GET {base_url}/metrics with `session`.

    Raises CollectorError on a status other than 200, on a connection error and on a timeout.
    """
    url = base_url.rstrip("/") + "/metrics"
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def fetch() -> str:
        try:
            async with session.get(url, timeout=timeout) as resp:
                if resp.status != 200:
                    raise CollectorError(f"GET {url}: HTTP {resp.status} {resp.reason or ''}".rstrip())
                body = await resp.read()
        except aiohttp.ClientError as err:
            raise CollectorError(f"GET {url}: {type(err).__name__}: {err}") from err
        except TimeoutError as err:
            raise CollectorError(f"GET {url}: no answer in {timeout_s:g} s") from err
        return body.decode("utf-8", errors="replace")

    return fetch
