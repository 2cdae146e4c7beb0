"""Peak RSS and wall time of every bad-input corpus case and every hostile-file case, each run as
`python -m soakd ...` in its own process (the tests run most corpus cases in-process, where only the
Python heap can be measured). Prints one line per case, then the largest. Then the cases whose tests
measure a real `soakd` process themselves (stop signals in every phase, two resumes of one run at once,
hostile traces): run by pytest with $SOAKD_RSS_LOG set, each case's figure read back from it.

    .venv/bin/python benchmarks/bench_hostile_rss.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "core"))

from test_hostile_files import CONFIGS, TRACES, _run  # noqa: E402

# The tests that measure each process they start (soakd.testing.measured) and note its figure.
MEASURING_TESTS = [
    "tests/integration/test_stop_phases_e2e.py",
    "tests/unit/run/test_run_owner.py::test_two_resumes_of_one_crashed_run_at_once_only_one_takes_it_up",
    "tests/unit/traces/test_trace_bounds.py",
]


def measured_by_tests(tmp: Path) -> list[tuple[str, float]]:
    """(case, peak RSS in MB) of every process the measuring tests started; exits if a test failed."""
    log = tmp / "rss.jsonl"
    env = {**os.environ, "SOAKD_RSS_LOG": str(log)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MEASURING_TESTS]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    print(done.stdout.strip().splitlines()[-1])
    if done.returncode != 0:
        raise SystemExit(f"the measuring tests failed:\n{done.stdout[-3000:]}")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [(r["case"], float(r["peak_rss_mb"])) for r in rows]


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
    with tempfile.TemporaryDirectory() as tmp:
        by_tests = measured_by_tests(Path(tmp))
    for case, mb in by_tests:
        print(f"{case:60s} {mb:6.1f} MiB")
    top = max(by_tests, key=lambda r: r[1])
    median = sorted(mb for _, mb in by_tests)[len(by_tests) // 2]
    print(f"measured by their tests: {len(by_tests)} processes, median {median:.1f} MiB, ", end="")
    print(f"peak {top[1]:.1f} MiB ({top[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
