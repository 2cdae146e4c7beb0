"""Allocator telemetry through the soakd worker extension against the real vLLM CPU engine (tiny model):
in process (AsyncLLM.collective_rpc) and over HTTP (a dev-mode api_server's POST /collective_rpc). The
in-process engine also runs soakd's scheduler class: its admission limit follows a file, live.

On the CPU build the worker is a child process of the engine core: the reading must come from that
process (its pid is alive, not ours, and below the engine in the process tree), and the engine must keep
serving after the RPC (a non-plain result once crashed the engine core's output thread).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from servers import VllmServer, start_vllm

from soakd.collectors.allocator import AllocatorCollector, local_rpc, server_rpc
from soakd.engine.live_limit import ACTIVE_SEQS_ENV, read_status, status_path, write_limit
from soakd.engine.stats import RecordCost, StepStats
from soakd.engine.vllm_local import SCHEDULER_CLS, make_logger_factory
from soakd.errors import CollectorError
from soakd.metric import Sample

pytestmark = pytest.mark.integration

EXTENSION = "soakd.engine.worker_ext.SoakdWorkerExtension"


def is_descendant(pid: int, ancestor: int) -> bool:
    return any(p.pid == ancestor for p in psutil.Process(pid).parents())


def check_worker_sample(sample: Sample, ancestor: int) -> int:
    """The assertions both paths share; returns the worker's pid."""
    assert sample.measurement == "allocator"
    assert dict(sample.tags) == {"worker": "0", "config": "t1"}
    f = sample.fields
    assert f["source"] == "worker_rss"
    assert isinstance(f["rss_bytes"], int)
    assert f["rss_bytes"] > 0
    assert isinstance(f["vms_bytes"], int)
    assert f["vms_bytes"] >= f["rss_bytes"]
    assert f["rank"] == 0
    pid = f["pid"]
    assert isinstance(pid, int)
    assert pid != os.getpid()
    assert psutil.pid_exists(pid)
    assert is_descendant(pid, ancestor)
    assert sample.to_line() is not None
    return pid


def gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


async def timed_refreshes(collector: AllocatorCollector, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await collector.refresh()
        out.append(time.perf_counter() - t0)
    return out


async def test_in_process_engine(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    # The CPU build sizes its KV cache from this variable (GiB), as VllmLocalEngine sets it.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # The same engine also runs soakd's scheduler class, its live limit read from this file.
    limit_file = tmp_path / "active-seqs"
    write_limit(limit_file, 1)
    monkeypatch.setenv(ACTIVE_SEQS_ENV, str(limit_file))
    steps: list[StepStats] = []
    args = AsyncEngineArgs(
        model=str(tiny_model),
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        disable_log_stats=True,
        worker_extension_cls=EXTENSION,
        scheduler_cls=SCHEDULER_CLS,
    )
    factory = make_logger_factory(steps.append, RecordCost())
    llm: Any = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[factory])
    try:
        await check_live_limit(llm, steps, limit_file)
        collector = AllocatorCollector(local_rpc(llm, timeout_s=30.0), config_id="t1")
        times = await timed_refreshes(collector, 5)
        (sample,) = collector.collect(time.time_ns())
        worker_pid = check_worker_sample(sample, os.getpid())
        assert collector.collect(time.time_ns()) == []  # written once
        print(f"\nin-process refresh s: {[round(t, 4) for t in times]}\nreading: {dict(sample.fields)}")

        # The engine still serves after the RPC.
        params = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True, temperature=0.0)
        outs = [o async for o in llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params, "r1")]
        assert len(outs[-1].outputs[0].token_ids) == 4
        await collector.refresh()
        (again,) = collector.collect(time.time_ns())
        assert again.fields["pid"] == worker_pid
    finally:
        await asyncio.to_thread(llm.shutdown)
    # shutdown() takes the worker down with the engine core.
    assert gone(worker_pid, 30.0)


async def check_live_limit(llm: Any, steps: list[StepStats], limit_file: Path) -> None:
    """vLLM admits no more requests into RUNNING than the file says, and follows a change live."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=12, min_tokens=12, ignore_eos=True, temperature=0.0)

    async def one(rid: str) -> None:
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7, 8]), params, rid):
            pass

    await asyncio.gather(*(one(f"a{i}") for i in range(4)))
    first = [s for s in steps if s.running or s.waiting]
    assert max(s.running for s in first) == 1 and max(s.waiting for s in first) >= 2
    write_limit(limit_file, 3)
    await asyncio.sleep(0.5)  # the scheduler looks at the file's mtime every 0.2 s
    steps.clear()
    await asyncio.gather(*(one(f"b{i}") for i in range(4)))
    assert max(s.running for s in steps) == 3  # raised live, no rebuild (max_num_seqs is 4)
    # The scheduler says what it enforces, on the attribute this vLLM reads (0.32: max_num_active_reqs).
    status = read_status(status_path(limit_file))
    assert status is not None and status.live and status.attr == "max_num_active_reqs"
    assert status.start == 4 and status.applied == 3 and status.pid != os.getpid()


@pytest.fixture(scope="module")
def dev_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[VllmServer]:
    """An api_server with the dev-mode endpoints and the soakd worker extension."""
    server = start_vllm(
        tiny_model,
        tmp_path_factory.mktemp("vllm-dev"),
        "--worker-extension-cls",
        EXTENSION,
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        yield server
    finally:
        server.stop()


async def test_dev_mode_server(dev_server: VllmServer) -> None:
    async with aiohttp.ClientSession() as session:
        collector = AllocatorCollector(server_rpc(session, dev_server.url), config_id="t1")
        times = await timed_refreshes(collector, 5)
        (sample,) = collector.collect(time.time_ns())
        check_worker_sample(sample, dev_server.pid)
        assert sample.fields["pid"] != dev_server.pid
        print(f"\nHTTP refresh s: {[round(t, 4) for t in times]}\nreading: {dict(sample.fields)}")

        # The raw answer's shape, as server_rpc documents it.
        async with session.post(
            dev_server.url + "/collective_rpc", json={"method": "soakd_memory_stats"}
        ) as r:
            assert r.status == 200
            body = await r.json()
        assert list(body) == ["results"]
        assert len(body["results"]) == 1
        assert body["results"][0]["source"] == "worker_rss"

        # A method no worker has is a CollectorError naming the worker's error; the engine lives on, and
        # the session's next requests (vLLM closes the connection after that 500) still go through.
        with pytest.raises(CollectorError, match=r"HTTP 500.*has no attribute 'no_such_method'"):
            await server_rpc(session, dev_server.url, method="no_such_method")()
        await collector.refresh()
        (again,) = collector.collect(time.time_ns())
        assert again.fields["pid"] == sample.fields["pid"]

        # The server still serves after both RPCs.
        async with session.post(
            dev_server.url + "/v1/completions",
            json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
        ) as r:
            assert r.status == 200, await r.text()
            done = await r.json()
        assert done["usage"]["completion_tokens"] == 4
