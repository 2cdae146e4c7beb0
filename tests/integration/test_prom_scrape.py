"""MetricsScraper against a real vLLM api_server (CPU build, tiny model, no speculation): two scrapes
around a couple of completions give exact token and request deltas, in both output modes."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import Server

from soakd.collectors.prom import MetricsScraper, http_fetch, parse_metrics
from soakd.metric import Sample
from soakd.testing import least_time

pytestmark = pytest.mark.integration

MAX_TOKENS = 32
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18] * 4


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> None:
    """Wait until the server runs and queues nothing (earlier tests may have left aborted requests)."""
    fetch = http_fetch(session, url)
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = parse_metrics(await fetch()).gauges
        if gauges["num_requests_running"] == 0 and gauges["num_requests_waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"server still busy: {gauges}"
        await asyncio.sleep(0.2)


async def complete(session: aiohttp.ClientSession, url: str, i: int) -> None:
    body = {
        "model": "tiny",
        "prompt": [*PROMPT, 100 + i],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS


async def traffic_between_scrapes(
    session: aiohttp.ClientSession,
    server: Server,
    scraper: MetricsScraper,
    requests: int,
    finished_field: str,
) -> list[Sample]:
    """Baseline scrape, `requests` completions, then scrapes until the server has counted them all
    (its counters are updated just after the answers go out); the collected samples, all intervals."""
    await wait_idle(session, server.url)
    await scraper.refresh()
    assert scraper.collect(time.time_ns()) == []  # the baseline alone gives nothing
    await asyncio.gather(*(complete(session, server.url, i) for i in range(requests)))
    samples: list[Sample] = []
    finished = 0
    deadline = time.monotonic() + 30.0
    while finished < requests:
        assert time.monotonic() < deadline, f"server counted {finished} of {requests} requests"
        await asyncio.sleep(0.2)
        await scraper.refresh()
        new = list(scraper.collect(time.time_ns()))
        samples += new
        finished += sum(int(s.fields.get(finished_field, 0)) for s in new)
    return samples


def total(samples: list[Sample], measurement: str, name: str) -> float:
    return sum(float(s.fields.get(name, 0)) for s in samples if s.measurement == measurement)


async def test_attach_mode_counts_the_requests(vllm_server: Server) -> None:
    async with aiohttp.ClientSession() as session:
        scraper = MetricsScraper(http_fetch(session, vllm_server.url), per_step=False, config_id="it")
        samples = await traffic_between_scrapes(session, vllm_server, scraper, 2, "finished")
    assert {s.measurement for s in samples} == {"engine"}  # no speculation on this server
    assert all(s.tags == {"config": "it"} and s.fields["source"] == "metrics" for s in samples)
    assert total(samples, "engine", "finished") == 2
    assert total(samples, "engine", "generation_tokens") == 2 * MAX_TOKENS
    assert total(samples, "engine", "prompt_tokens") == 2 * (len(PROMPT) + 1)
    assert total(samples, "engine", "prefix_queries") >= total(samples, "engine", "prefix_hits")
    assert total(samples, "engine", "iterations") > 0
    assert total(samples, "engine", "counter_resets") == 0
    assert total(samples, "engine", "interval_s") > 0
    assert scraper.resets == 0
    missing = scraper.missing()
    assert any(line.startswith("speculative decoding") for line in missing)
    assert any(line.startswith("CUDA-graph hit rate") for line in missing)
    assert scraper.last_bytes > 10_000 and scraper.last_parse_s > 0
    # Cheap on a real server's body: less than prometheus_client's own text parser, timed alongside.
    async with aiohttp.ClientSession() as session:
        body = await http_fetch(session, vllm_server.url)()
    ours = least_time(lambda: parse_metrics(body))
    reference = least_time(lambda: list(text_string_to_metric_families(body)))
    assert ours < reference, (ours, reference)


async def test_per_step_mode_gives_server_side_latencies(vllm_server: Server) -> None:
    async with aiohttp.ClientSession() as session:
        scraper = MetricsScraper(http_fetch(session, vllm_server.url), per_step=True)
        samples = await traffic_between_scrapes(session, vllm_server, scraper, 2, "request_success")
    assert {s.measurement for s in samples} == {"vllm_metrics"}
    assert total(samples, "vllm_metrics", "request_success") == 2
    assert total(samples, "vllm_metrics", "request_success_length") == 2
    assert total(samples, "vllm_metrics", "generation_tokens") == 2 * MAX_TOKENS
    assert total(samples, "vllm_metrics", "ttft_count") == 2
    assert total(samples, "vllm_metrics", "e2e_count") == 2
    ttft = total(samples, "vllm_metrics", "ttft_sum_s") / 2
    e2e = total(samples, "vllm_metrics", "e2e_sum_s") / 2
    assert 0 < ttft <= e2e
    assert total(samples, "vllm_metrics", "itl_count") > 0
    with_e2e = [s for s in samples if s.fields.get("e2e_count")]
    assert all(s.fields["e2e_mean_s"] > 0 for s in with_e2e)
    assert scraper.missing() == []
