"""What judging a parallel engine's GPUs costs on the GPU's fast tier: GpuThrottleWatch.observe per
sample and collect per interval, for N GPUs judged with the straggler's spread (one tensor-parallel
group of all N) against the same N without it. The samples are an H200's recording (pays-advice of the
control matrix: a shared load capping it from 20 s to 65 s), played as N GPUs; every run alternates
the two shapes and repeats, so a busy machine shifts both alike. Prints microseconds per sample per GPU.

    python benchmarks/bench_gpu_spread.py [--gpus 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.testing import recorded_gpu

RECORDING = (
    Path(__file__).resolve().parents[1]
    / "tests"
    / "data"
    / "h200"
    / "matrix2"
    / "pays-advice"
    / "nvml.jsonl.gz"
)


def samples() -> list[tuple[float, dict[str, Any], dict[str, Any]]]:
    """(seconds, fast reading, latest slow reading) of the recording's GPU."""
    return [(t, fast, slow) for t, _, fast, slow in recorded_gpu(RECORDING)]


def run(rows: list[tuple[float, dict[str, Any], dict[str, Any]]], gpus: int, spread: bool) -> float:
    """Seconds of CPU per sample per GPU for one pass over the recording, a collect each second."""
    watch = GpuThrottleWatch(
        dict.fromkeys(range(gpus), 1980.0),
        lambda *_a, **_f: None,
        groups={"0": tuple(range(gpus))} if spread else None,
    )
    last = rows[0][0]
    c0 = time.process_time()
    for t, fast, slow in rows:
        for gpu in range(gpus):
            watch.observe(gpu, t, fast, slow)
        if t - last >= 1.0:
            watch.collect(int(t * 1e9))
            last = t
    return (time.process_time() - c0) / (len(rows) * gpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = samples()
    with_spread, without = [], []
    for _ in range(args.repeats):
        without.append(run(rows, args.gpus, spread=False))
        with_spread.append(run(rows, args.gpus, spread=True))
    a, b = statistics.median(without), statistics.median(with_spread)
    print(f"{len(rows)} fast samples x {args.gpus} GPUs, {args.repeats} passes each, median:")
    print(f"  judged, no spread:   {a * 1e6:6.2f} us CPU per sample per GPU")
    print(f"  judged, with spread: {b * 1e6:6.2f} us CPU per sample per GPU ({100 * (b / a - 1):+.1f} %)")
    print(f"  at 10 Hz x {args.gpus} GPUs: {b * 10 * args.gpus * 100:.3f} % of one core with the spread")


if __name__ == "__main__":
    main()
