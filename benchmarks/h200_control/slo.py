"""The TPOT limit for the A/B from the load-free run's spool: 1.25 x the p90 of its requests' TPOT (ms),
the kind of SLO a deployment states just above what it serves unloaded."""

from __future__ import annotations

import gzip
import re
import statistics
import sys

TPOT = re.compile(r"[ ,]tpot_s=([0-9.eE+-]+)")


def main() -> None:
    tpots = []
    with gzip.open(sys.argv[1], "rt", errors="replace") as f:
        for line in f:
            if line.startswith("requests,") and "status=ok" in line.split(" ", 1)[0]:
                m = TPOT.search(line)
                if m:
                    tpots.append(float(m.group(1)) * 1000)
    p90 = statistics.quantiles(tpots, n=10)[-1] if len(tpots) >= 10 else 100.0
    print(f"{1.25 * p90:.2f}")


if __name__ == "__main__":
    main()
