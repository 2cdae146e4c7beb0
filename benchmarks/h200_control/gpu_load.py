"""A bf16 matrix-product load on GPU 0 for a window of a soak's replay: it waits for the replay to start
(the first request lands in the run folder's replay.journal, which is created empty at the run's start,
before the engine), sleeps `--after`, multiplies 8192^3 matrices back to back for
`--seconds`, and writes the wall times (replay start, load start and end) as JSON. At full duty this holds
an H200 at its power cap (SwPowerCap, SM clock ~1,300-1,500 of 1,980 MHz). Needs torch with CUDA."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def newest_run(runs: Path, since: float) -> Path | None:
    dirs = [d for d in runs.glob("*") if d.is_dir() and d.stat().st_mtime >= since]
    return max(dirs, key=lambda d: d.stat().st_mtime) if dirs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=Path, required=True, help="the soak's run.output_dir")
    ap.add_argument("--after", type=float, default=120.0, help="seconds after the replay starts")
    ap.add_argument("--seconds", type=float, default=150.0, help="length of the load")
    ap.add_argument("--out", type=Path, required=True, help="times.json to write")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    import torch

    t0 = time.time()
    journal = None
    while time.time() - t0 < args.timeout:
        run = newest_run(args.runs, t0 - 5)
        path = None if run is None else run / "replay.journal"
        if path is not None and path.exists() and path.stat().st_size > 0:
            journal = path
            break
        time.sleep(0.05)
    if journal is None:
        raise SystemExit("no replay started")
    replay_start = time.time()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    time.sleep(max(0.0, replay_start + args.after - time.time()))
    start = time.time()
    n = 0
    while time.time() - start < args.seconds:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        n += 20
    end = time.time()
    tflops = n * 2 * 8192**3 / (end - start) / 1e12
    doc = {"replay_start": replay_start, "load_start": start, "load_end": end, "tflops": round(tflops, 1)}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"load: {n} matmuls in {end - start:.1f} s = {tflops:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
