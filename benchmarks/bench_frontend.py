"""CPU that soakd's process spends per output token with engine.kind = "vllm-local" (vLLM's front end runs
in soakd's process), with vLLM's detokenization on and off.

One in-process engine (the tiny model, eager, speculation off); rounds of CONCURRENCY requests of
OUTPUT tokens each, alternating detokenize off / on; per round the CPU seconds of this process (all its
threads: vLLM's output handler, soakd's request tasks; the engine core is another process) per output
token, and tokens/s. Run by hand:

    .venv/bin/python benchmarks/bench_frontend.py [--model models/tiny] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from soakd.config import EngineConfig, SpeculativeConfig
from soakd.engine.base import GenerationRequest
from soakd.engine.vllm_local import VllmLocalEngine

CONCURRENCY = 32
OUTPUT = 256
PROMPT = 128


async def one_round(engine: VllmLocalEngine, tag: str, n: int) -> tuple[float, float, int]:
    async def one(i: int) -> int:
        req = GenerationRequest(f"{tag}-{n}-{i}", [(i * 7 + k) % 400 + 1 for k in range(PROMPT)], OUTPUT)
        got = 0
        async for k in engine.generate(req):
            got += k
        return got

    cpu0, t0 = time.process_time(), time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(CONCURRENCY))))
    return time.process_time() - cpu0, time.perf_counter() - t0, tokens


async def main_async(model: str, rounds: int) -> None:
    cfg = EngineConfig(
        model=model,
        enforce_eager=True,
        max_num_seqs=CONCURRENCY,
        speculative=SpeculativeConfig(enabled=False),
    )
    engine = VllmLocalEngine(cfg, model, lambda step: None)
    await engine.start()
    try:
        await one_round(engine, "warm", 0)
        results: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
        for n in range(rounds):
            for detok in (False, True):
                engine.detokenize = detok
                results[detok].append(await one_round(engine, f"d{int(detok)}", n))
        for detok, rows in results.items():
            us = [1e6 * cpu / tok for cpu, _, tok in rows]
            tps = [tok / wall for _, wall, tok in rows]
            print(
                f"detokenize={detok!s:<5}  CPU of this process per output token: "
                f"{statistics.median(us):6.1f} us (rounds: {', '.join(f'{u:.1f}' for u in us)})  "
                f"tokens/s {statistics.median(tps):7.0f}"
            )
    finally:
        await engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(main_async(args.model, args.rounds))


if __name__ == "__main__":
    main()
