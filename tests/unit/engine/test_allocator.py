"""Allocator telemetry: the worker extension's pure parts and the AllocatorCollector with a fake rpc;
server_rpc against a small loopback aiohttp app shaped like vLLM's dev-mode /collective_rpc."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from soakd.collectors.allocator import AllocatorCollector, server_rpc, validate_result
from soakd.collectors.base import RefreshingCollector
from soakd.engine.worker_ext import SoakdWorkerExtension, cuda_fields, memory_stats, request_amx
from soakd.errors import CollectorError
from soakd.testing import serving

GiB = 1 << 30

# Shaped like torch.cuda.memory_stats() on one GPU after a vLLM start (a subset of its ~80 keys, with the
# same names and int values; the counters it reports per pool are kept to "all").
CUDA_STATS: dict[str, int] = {
    "active.all.allocated": 5123,
    "active.all.current": 812,
    "active_bytes.all.current": 120 * GiB,
    "active_bytes.all.peak": 126 * GiB,
    "allocated_bytes.all.allocated": 3_400 * GiB,
    "allocated_bytes.all.current": 120 * GiB,
    "allocated_bytes.all.freed": 3_280 * GiB,
    "allocated_bytes.all.peak": 126 * GiB,
    "allocated_bytes.large_pool.current": 119 * GiB,
    "allocated_bytes.small_pool.current": 1 * GiB,
    "inactive_split.all.current": 37,
    "inactive_split_bytes.all.current": 3 * GiB,
    "inactive_split_bytes.all.peak": 5 * GiB,
    "max_split_size": -1,
    "num_alloc_retries": 2,
    "num_device_alloc": 311,
    "num_device_free": 4,
    "num_ooms": 0,
    "num_sync_all_streams": 0,
    "oversize_allocations.current": 0,
    "requested_bytes.all.current": 119 * GiB,
    "reserved_bytes.all.current": 128 * GiB,
    "reserved_bytes.all.peak": 130 * GiB,
    "segment.all.current": 290,
}


# ---- worker extension: pure parts ----------------------------------------------------------------


def test_cuda_fields_selects_counters_and_derives_ratios() -> None:
    f = cuda_fields(CUDA_STATS, free_bytes=7 * GiB, total_bytes=140 * GiB)
    assert f == {
        "allocated_bytes": 120 * GiB,
        "reserved_bytes": 128 * GiB,
        "active_bytes": 120 * GiB,
        "inactive_split_bytes": 3 * GiB,
        "allocated_bytes_peak": 126 * GiB,
        "reserved_bytes_peak": 130 * GiB,
        "num_alloc_retries": 2,
        "num_ooms": 0,
        "num_device_alloc": 311,
        "num_device_free": 4,
        "device_free_bytes": 7 * GiB,
        "device_total_bytes": 140 * GiB,
        "fragmentation": pytest.approx(1 - 120 / 128),
        "inactive_split_ratio": pytest.approx(3 / 128),
    }
    assert isinstance(f["fragmentation"], float)
    assert isinstance(f["num_ooms"], int)


def test_cuda_fields_missing_keys_are_absent_and_no_ratio_without_reserved() -> None:
    # Before the first allocation (or on an older torch) most keys are missing or zero.
    f = cuda_fields({"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0})
    assert f == {"allocated_bytes": 0, "reserved_bytes": 0}
    assert cuda_fields({}) == {}
    # Only the allocated side: no ratio can be formed.
    assert "fragmentation" not in cuda_fields({"allocated_bytes.all.current": 5})


def test_cuda_fields_reserved_without_inactive_gives_only_fragmentation() -> None:
    f = cuda_fields({"allocated_bytes.all.current": 3, "reserved_bytes.all.current": 4})
    assert f["fragmentation"] == 0.25
    assert "inactive_split_ratio" not in f


class _Worker(SoakdWorkerExtension):
    def __init__(self, device: Any = None, rank: Any = 0, local_rank: Any = 0) -> None:
        self.device = device
        self.rank = rank
        self.local_rank = local_rank


def test_cpu_worker_reports_own_rss() -> None:
    out = _Worker(types.SimpleNamespace(type="cpu"), rank=1, local_rank=1).soakd_memory_stats()
    assert out["source"] == "worker_rss"
    assert out["pid"] == os.getpid()
    assert out["rank"] == 1
    assert out["local_rank"] == 1
    assert isinstance(out["rss_bytes"], int)
    assert out["rss_bytes"] > 0
    assert isinstance(out["vms_bytes"], int)
    assert out["vms_bytes"] >= out["rss_bytes"]
    assert all(type(v) in (int, float, str) for v in out.values())


def test_worker_without_device_or_rank_still_answers() -> None:
    out = memory_stats(types.SimpleNamespace())
    assert out["source"] == "worker_rss"
    assert "rank" not in out


def test_cuda_worker_uses_memory_stats_of_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    device = types.SimpleNamespace(type="cuda", index=0)
    calls: list[object] = []

    def stats(dev: object) -> dict[str, int]:
        calls.append(dev)
        return CUDA_STATS

    fake_torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            is_available=lambda: True,
            memory_stats=stats,
            mem_get_info=lambda dev: (7 * GiB, 140 * GiB),
        )
    )
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    out = _Worker(device).soakd_memory_stats()
    assert calls == [device]
    assert out["source"] == "cuda_allocator"
    assert out["reserved_bytes"] == 128 * GiB
    assert out["device_total_bytes"] == 140 * GiB
    assert "rss_bytes" not in out
    assert all(type(v) in (int, float, str) for v in out.values())


def test_cuda_device_without_cuda_falls_back_to_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    out = _Worker(types.SimpleNamespace(type="cuda")).soakd_memory_stats()
    assert out["source"] == "worker_rss"


def test_extension_adds_one_public_attribute() -> None:
    # vLLM refuses an extension whose non-dunder attributes clash with the worker's: keep it to one.
    assert [a for a in dir(SoakdWorkerExtension) if not a.startswith("__")] == ["soakd_memory_stats"]


# ---- collector ------------------------------------------------------------------------------------


def fake_rpc(*answers: object) -> Callable[[], Awaitable[list[Any]]]:
    queue = list(answers)

    async def rpc() -> list[Any]:
        answer = queue.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]

    return rpc


W0 = {"pid": 101, "rank": 0, "rss_bytes": 1000, "vms_bytes": 5000, "source": "worker_rss"}
W1 = {"pid": 102, "rank": 1, "rss_bytes": 2000, "vms_bytes": 6000, "source": "worker_rss"}


def test_collector_is_a_refreshing_collector() -> None:
    assert isinstance(AllocatorCollector(fake_rpc()), RefreshingCollector)
    assert AllocatorCollector(fake_rpc()).name == "allocator"


async def test_one_sample_per_worker_with_tags() -> None:
    c = AllocatorCollector(fake_rpc([W0, W1]), config_id="abc123")
    assert c.collect(1) == []  # nothing refreshed yet
    await c.refresh()
    samples = c.collect(42)
    assert [s.measurement for s in samples] == ["allocator", "allocator"]
    assert [dict(s.tags) for s in samples] == [
        {"worker": "0", "config": "abc123"},
        {"worker": "1", "config": "abc123"},
    ]
    assert dict(samples[0].fields) == W0
    assert dict(samples[1].fields) == W1
    assert all(s.time_ns == 42 for s in samples)
    line = samples[1].to_line()
    assert line == (
        'allocator,config=abc123,worker=1 pid=102i,rank=1i,rss_bytes=2000i,source="worker_rss",'
        "vms_bytes=6000i 42"
    )


async def test_no_config_tag_when_unset() -> None:
    c = AllocatorCollector(fake_rpc([W0]))
    await c.refresh()
    assert [dict(s.tags) for s in c.collect(1)] == [{"worker": "0"}]


async def test_a_reading_is_written_once() -> None:
    c = AllocatorCollector(fake_rpc([W0], [], [W1]))
    await c.refresh()
    assert len(c.collect(1)) == 1
    assert c.collect(2) == []  # no refresh since: nothing stale is repeated
    await c.refresh()  # found nothing new
    assert c.collect(3) == []
    await c.refresh()
    (sample,) = c.collect(4)
    assert sample.fields["pid"] == 102


async def test_refreshes_between_collects_keep_the_latest_per_worker() -> None:
    newer = {**W0, "rss_bytes": 1111}
    c = AllocatorCollector(fake_rpc([W0, W1], [newer]))
    await c.refresh()
    await c.refresh()
    samples = c.collect(1)
    assert [s.fields["rss_bytes"] for s in samples] == [1111, 2000]


@pytest.mark.parametrize(
    ("result", "needle"),
    [
        ("torch.float16", "expected a dict, got str"),
        (None, "expected a dict, got NoneType"),
        ([1, 2], "expected a dict, got list"),
        ({}, "empty dict"),
        ({"rss_bytes": None}, "field 'rss_bytes' is NoneType"),
        ({"rss_bytes": True}, "field 'rss_bytes' is bool"),
        ({"rss_bytes": [1]}, "field 'rss_bytes' is list"),
        ({"nested": {"a": 1}}, "field 'nested' is dict"),
        ({3: 1}, "key 3 is not"),
    ],
)
def test_validate_rejects(result: object, needle: str) -> None:
    with pytest.raises(CollectorError, match=needle.replace("(", r"\(")) as info:
        validate_result(2, result)
    assert "worker 2" in str(info.value)


async def test_a_bad_result_rejects_the_whole_refresh() -> None:
    c = AllocatorCollector(fake_rpc([W0, "<object>"]))
    with pytest.raises(CollectorError, match="worker 1: expected a dict"):
        await c.refresh()
    assert c.collect(1) == []  # worker 0's good reading was not half-kept


async def test_non_list_answer_rejected() -> None:
    c = AllocatorCollector(fake_rpc({"results": []}))
    with pytest.raises(CollectorError, match="expected a list"):
        await c.refresh()


async def test_rpc_errors_pass_through_and_close_clears() -> None:
    c = AllocatorCollector(fake_rpc([W0], RuntimeError("engine dead")))
    await c.refresh()
    with pytest.raises(RuntimeError, match="engine dead"):
        await c.refresh()
    c.close()
    assert c.collect(1) == []


# ---- server_rpc against a loopback app shaped like vLLM's dev-mode endpoint -------------------------


@pytest.fixture
async def fake_server() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """An app with POST /collective_rpc answering what `state["answer"]` says; records the bodies."""
    state: dict[str, Any] = {
        "answer": lambda: web.json_response({"results": [W0]}),
        "bodies": [],
        "peers": [],
    }

    async def handler(request: web.Request) -> web.StreamResponse:
        state["bodies"].append(await request.json())
        assert request.transport is not None
        state["peers"].append(request.transport.get_extra_info("peername"))
        if state["answer"] is None:
            return await state["slow"](request)
        answer: web.StreamResponse = state["answer"]()  # a response object can be sent only once
        return answer

    app = web.Application()
    app.router.add_post("/collective_rpc", handler)
    async with serving(app) as url:
        yield url + "/", state


async def test_server_rpc_posts_the_method_and_returns_results(
    fake_server: tuple[str, dict[str, Any]],
) -> None:
    url, state = fake_server
    async with aiohttp.ClientSession() as session:
        assert await server_rpc(session, url)() == [W0]
    assert state["bodies"] == [{"method": "soakd_memory_stats"}]


@pytest.mark.parametrize(
    ("answer", "needle"),
    [
        (lambda: web.Response(status=404, text='{"detail":"Not Found"}'), "HTTP 404 .*VLLM_SERVER_DEV_MODE"),
        (lambda: web.Response(status=500, text="Internal Server Error"), "HTTP 500"),
        (lambda: web.Response(status=200), "empty answer"),
        (lambda: web.Response(status=200, text="<html>"), "not JSON"),
        (lambda: web.json_response({"result": []}), "no 'results' list"),
    ],
)
async def test_server_rpc_failures_are_collector_errors(
    fake_server: tuple[str, dict[str, Any]], answer: Callable[[], web.Response], needle: str
) -> None:
    url, state = fake_server
    state["answer"] = answer
    async with aiohttp.ClientSession() as session:
        with pytest.raises(CollectorError, match=needle):
            await server_rpc(session, url)()


async def test_server_rpc_never_pools_its_connection(fake_server: tuple[str, dict[str, Any]]) -> None:
    # vLLM's server closes the connection after a failed RPC's 500; a pooled one would reset the
    # session's next request. So each call has a connection of its own, whatever the answer.
    url, state = fake_server
    async with aiohttp.ClientSession() as session:
        rpc = server_rpc(session, url)
        await rpc()
        state["answer"] = lambda: web.Response(status=500, text="Internal Server Error")
        with pytest.raises(CollectorError):
            await rpc()
        state["answer"] = lambda: web.json_response({"results": [W0]})
        await rpc()
        assert session.connector is not None
        assert not session.connector._conns  # nothing kept alive
    assert len(set(state["peers"])) == 3


async def test_server_rpc_unreachable_is_a_collector_error() -> None:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        with pytest.raises(CollectorError, match="ClientConnectorError"):
            await server_rpc(session, f"http://127.0.0.1:{port}", timeout_s=2.0)()


async def test_server_rpc_timeout_is_a_collector_error(fake_server: tuple[str, dict[str, Any]]) -> None:
    url, state = fake_server

    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(1)
        return web.json_response({"results": []})

    state["slow"] = slow
    state["answer"] = None
    async with aiohttp.ClientSession() as session:
        with pytest.raises(CollectorError, match="TimeoutError"):
            await server_rpc(session, url, timeout_s=0.2)()


def test_request_amx_asks_only_where_torch_is_loaded_and_the_cpu_has_amx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib.metadata import entry_points

    calls: list[int] = []
    cpu = types.SimpleNamespace(
        _is_amx_tile_supported=lambda: True, _init_amx=lambda: calls.append(1) or True
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cpu=cpu))
    assert request_amx() is True and calls == [1]
    cpu._is_amx_tile_supported = lambda: False
    assert request_amx() is False and calls == [1]
    monkeypatch.delitem(sys.modules, "torch")
    assert request_amx() is False
    # vLLM finds it as a general plugin, so every vLLM process asks (its CPU workers among them).
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("soakd_amx") == "soakd.engine.worker_ext:request_amx"
