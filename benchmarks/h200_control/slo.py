"""The TPOT limit for an A/B from an earlier arm's spool.

Default: 1.25 x the p90 of the load-free run's requests' TPOT (ms), the kind of SLO a deployment states
just above what it serves unloaded. With `--times` (that arm's gpu_load.py times.json) and `--quantile`:
that quantile of the TPOT of requests that finished under the outside load, a limit the full batch misses
under the load for most requests (the SLO-bound case where a smaller batch can pay)."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from pathlib import Path

TPOT = re.compile(r"[ ,]tpot_s=([0-9.eE+-]+)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("spool", type=Path, help="the arm's spool.lp.gz")
    ap.add_argument("--times", type=Path, help="the arm's times.json: only requests ending under the load")
    ap.add_argument("--quantile", type=float, default=0.25)
    args = ap.parse_args()
    window = None
    if args.times is not None:
        t = json.loads(args.times.read_text())
        window = (t["load_start"] * 1e9, t["load_end"] * 1e9)
    tpots = []
    with gzip.open(args.spool, "rt", errors="replace") as f:
        for line in f:
            if not (line.startswith("requests,") and "status=ok" in line.split(" ", 1)[0]):
                continue
            m = TPOT.search(line)
            ts = int(line.rsplit(" ", 1)[1])
            if m and (window is None or window[0] <= ts < window[1]):
                tpots.append(float(m.group(1)) * 1000)
    if len(tpots) < 10:
        print("100.00")
    elif window is None:
        print(f"{1.25 * statistics.quantiles(tpots, n=10)[-1]:.2f}")
    else:
        tpots.sort()
        print(f"{tpots[min(len(tpots) - 1, int(args.quantile * len(tpots)))]:.2f}")


if __name__ == "__main__":
    main()
