"""The throughput judge's prefill weight swept over every recorded matrix arm (benchmarks/RESULTS.md,
"Prompt tokens in the throughput judge", "The GPU's power in the throughput judge").

Run by hand:  .venv/bin/python benchmarks/h200_matrix/prefill_weight.py [--no-power] [weight ...]

Each arm's seconds (output tokens/s, queue, power-cap bit, prompt tokens computed, the GPU's power) go
through ThroughputJudge at each weight, as tests/unit/h200/test_h200_prefill_weight.py reads them; a row
per arm with its episodes and the second of the replay at which each began (an outside load starts 20 s
in). `--no-power` leaves the GPU's power out (the judge before it read it).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "h200"))
from test_h200_prefill_weight import ARMS, entries, loaded  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    power = "--no-power" not in args
    weights = [float(w) for w in args if w != "--no-power"] or [0.0, 0.08, 0.15, 0.25, 0.5, 1.0]
    print("| arm | load | " + " | ".join(f"weight {w:g}" for w in weights) + " |")
    print("|---|---|" + "---|" * len(weights))
    for arm in ARMS:
        cells = []
        for w in weights:
            s = entries(arm, w, power=power)
            cells.append(f"{len(s)}" + (f" (at {', '.join(f'{x:.0f}' for x in s)} s)" if s else ""))
        name = f"{arm.parent.parent.name}/{arm.parent.name}/{arm.name}"
        print(f"| {name} | {'yes' if loaded(arm) else 'no'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
