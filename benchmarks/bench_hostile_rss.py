"""Peak RSS and wall time of every bad-input corpus case and every hostile-file case, each run as
`python -m soakd ...` in its own process (the tests run most corpus cases in-process, where only the
Python heap can be measured). Prints one line per case, then the largest.

    .venv/bin/python benchmarks/bench_hostile_rss.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "core"))

from test_hostile_files import CONFIGS, TRACES, _run  # noqa: E402


def main() -> int:
    corpus = ROOT / "tests" / "data" / "bad_input"
    cases = tomllib.loads((corpus / "cases.toml").read_text())["case"]
    rows: list[tuple[str, int, float, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            work = Path(tmp) / "corpus"
            if not work.exists():
                shutil.copytree(corpus, work)
            start = time.monotonic()
            code, _, rss = _run(case["argv"], work, timeout_s=120)
            rows.append((f"corpus/{case['id']}", code, time.monotonic() - start, rss))
            shutil.rmtree(work)  # a fresh copy for each case
        for kind, make, _ in CONFIGS:
            work = Path(tempfile.mkdtemp(dir=tmp))
            make(work / "c.toml")
            start = time.monotonic()
            code, _, rss = _run(["check", "--config", "c.toml"], work)
            rows.append((f"config/{kind}", code, time.monotonic() - start, rss))
        for kind, name, make, _ in TRACES:
            work = Path(tempfile.mkdtemp(dir=tmp))
            make(work / name)
            for argv in (["trace", "inspect", name, "--format", "native"], ["check", "--trace", name]):
                start = time.monotonic()
                code, _, rss = _run(argv, work)
                rows.append((f"trace/{kind}/{argv[0]}", code, time.monotonic() - start, rss))
    for name, code, wall, rss in rows:
        print(f"{name:60s} exit {code}  {wall:5.2f} s  {rss / 2**20:6.1f} MiB")
    worst = max(rows, key=lambda r: r[3])
    slowest = max(rows, key=lambda r: r[2])
    not_two = [r[0] for r in rows if r[1] != 2]
    print(f"cases: {len(rows)}  exit 2: {len(rows) - len(not_two)}  others: {not_two}")
    print(f"peak RSS: {worst[3] / 2**20:.1f} MiB ({worst[0]})  slowest: {slowest[2]:.2f} s ({slowest[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
