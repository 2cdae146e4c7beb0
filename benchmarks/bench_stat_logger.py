"""Cost of soakd's stat logger per engine step, on vLLM's own stats objects (no engine needed).

Measures, for a typical decode step (running batch, prefix-cache stats, ngram k=3 spec stats, a
CUDA-graph stat, iteration stats with one finished request):
- in-process: the logger's record() (convert + hand to the collector's deque), as VllmLocalEngine runs it;
- server plugin: SoakdStatLogger.record() writing to a live StepChannel that soakd reads;
- soakd's side of the plugin channel: lines decoded per second.
Prints figures; run by hand: `.venv/bin/python benchmarks/bench_stat_logger.py`.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import deque
from typing import Any

from soakd.engine.channel import SOCKET_ENV, StepChannel
from soakd.engine.stats import StepStats, step_from_vllm

N = 20_000


def vllm_step() -> tuple[Any, Any]:
    from vllm.compilation.cuda_graph import CUDAGraphStat
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    spec = SpecDecodingStats.new(3)
    for _ in range(16):
        spec.observe_draft(3, 2)
    sched = SchedulerStats(
        num_running_reqs=16,
        num_waiting_reqs=2,
        kv_cache_usage=0.4,
        prefix_cache_stats=PrefixCacheStats(),
        spec_decoding_stats=spec,
        cudagraph_stats=CUDAGraphStat(
            num_unpadded_tokens=64, num_padded_tokens=64, num_paddings=0, runtime_mode="FULL"
        ),
    )
    it = IterationStats()
    it.num_generation_tokens = 48
    return sched, it


def pct(values: list[int], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] / 1e3


def bench_in_process(sched: Any, it: Any) -> list[int]:
    sink: deque[StepStats] = deque()
    costs = []
    for _ in range(N):
        t0 = time.perf_counter_ns()
        sink.append(step_from_vllm(sched, it, time.time_ns(), 0))
        costs.append(time.perf_counter_ns() - t0)
        if len(sink) > 1000:
            sink.clear()
    return costs


async def bench_plugin(sched: Any, it: Any) -> tuple[list[int], float, dict[str, object]]:
    from soakd.engine.plugin import SoakdStatLogger

    got = 0

    def sink(_: StepStats) -> None:
        nonlocal got
        got += 1

    channel = StepChannel(sink)
    await channel.open()
    os.environ[SOCKET_ENV] = channel.path
    # The plugin runs in the server's process; here a thread plays the server, the loop plays soakd.
    logger = await asyncio.to_thread(SoakdStatLogger, None, 0)
    costs: list[int] = []

    def server() -> None:
        for _ in range(N):
            t0 = time.perf_counter_ns()
            logger.record(sched, it)
            costs.append(time.perf_counter_ns() - t0)

    t0 = time.perf_counter()
    await asyncio.to_thread(server)
    while got < N and time.perf_counter() - t0 < 30:
        await asyncio.sleep(0.01)
        logger.log()  # what vLLM's periodic log() does: flush what the socket did not take
    took = time.perf_counter() - t0
    summary = channel.summary()
    await channel.aclose()
    return costs, got / took, summary


def main() -> None:
    sched, it = vllm_step()
    local = bench_in_process(sched, it)
    plugin, rate, summary = asyncio.run(bench_plugin(sched, it))
    print(f"steps: {N}")
    for name, costs in (("in-process record()", local), ("plugin record()", plugin)):
        print(
            f"{name:22s} mean {statistics.fmean(costs) / 1e3:6.1f} us  p50 {pct(costs, 0.5):6.1f} us  "
            f"p99 {pct(costs, 0.99):6.1f} us  max {max(costs) / 1e3:7.1f} us"
        )
    print(f"soakd side: {rate:,.0f} steps/s decoded; received {summary['steps']}, lost {summary['lost']}")


if __name__ == "__main__":
    main()
