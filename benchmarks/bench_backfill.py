"""Backfill rate: how fast the forwarder ships a spool backlog to a real InfluxDB 1.x after an outage.

Run by hand:  .venv/bin/python benchmarks/bench_backfill.py [--lines 500000] [--batches 5000 10000 20000]
              [--emulate-s 120] [--json]

1. A spool of `--lines` realistic lines is written through `Spool` (8 MiB segments): the points of the
   H200 runs in tests/data/h200 (live_soak, control, rebuild, server, soak_spool: every measurement a
   default soak writes, ~340 bytes a line), repeated with their times shifted so that no two points
   share a series and a time (InfluxDB would overwrite one), all within the last few hours.
2. The forwarder alone, against a writer that accepts at once: its own reading ceiling.
3. An influxd (tests/integration/servers.py `start_influxdb`, /usr/bin/influxd; data in a temp folder)
   is started; for each batch size a fresh database and cursor, and `Forwarder.drain()` ships the whole
   backlog through `V1Writer` (the daemon's writer). Reported: lines/s, the share of the time spent in
   the HTTP write, and a per-measurement count read back from the server.
4. The app's ship job, emulated over the same backlog (a fresh database): every `sinks.influx.interval`
   (1 s) up to 20 `step()`s, a run that outlasts the interval skipping the runs it overlapped
   (APScheduler, max_instances=1), at batch_lines 5000, until caught up (or `--emulate-s`). Its ceiling
   is 20 x batch_lines lines/s; the measured rate says whether that ceiling or the server binds.

The server is stopped by its pid at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from soakd.logs import configure as configure_logs
from soakd.metric import Sample, parse_line
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.influx import V1Writer
from soakd.sinks.spool import Spool

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = [
    ROOT / "tests/data/h200/live_soak/spool.lp.gz",
    ROOT / "tests/data/h200/control/spool.lp.gz",
    ROOT / "tests/data/h200/rebuild/spool.lp.gz",
    ROOT / "tests/data/h200/server/spool.lp.gz",
    ROOT / "tests/data/h200/soak_spool.lp.gz",
]
SEGMENT_BYTES = 8 * 1024 * 1024
SHIP_INTERVAL_S = 1.0  # sinks.influx.interval's default
SHIP_STEPS = 20  # the app's ship job: at most this many step()s per run

sys.path.insert(0, str(ROOT / "tests" / "integration"))
from servers import INFLUXD, start_influxdb  # noqa: E402


def _fixture_samples(conflicts: Counter[str]) -> list[list[Sample]]:
    """Each fixture's samples, times made relative to the fixture's first point.

    A field whose type differs from the one it first had in its measurement is left out (counted in
    `conflicts`): InfluxDB refuses such a point ("field type conflict"), which is not what is measured.
    """
    types: dict[tuple[str, str], type] = {}
    runs: list[list[Sample]] = []
    for path in FIXTURES:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            samples = [parse_line(line) for line in f if line.strip()]
        t0 = min(s.time_ns for s in samples)
        run: list[Sample] = []
        for s in samples:
            fields = {}
            for key, value in s.fields.items():
                if types.setdefault((s.measurement, key), type(value)) is type(value):
                    fields[key] = value
                else:
                    conflicts[f"{s.measurement}.{key}"] += 1
            if fields:
                run.append(Sample(s.measurement, fields, s.time_ns - t0, s.tags))
        runs.append(run)
    return runs


def _realistic(n: int, base_ns: int, conflicts: Counter[str]) -> Iterator[Sample]:
    """`n` samples: the fixtures' points round after round, each round shifted past the longest run."""
    runs = _fixture_samples(conflicts)
    span = max(max(s.time_ns for s in run) for run in runs) + 1_000_000_000
    made = 0
    for k in range(math.ceil(n / sum(len(r) for r in runs)) + 1):
        for run in runs:
            for s in run:
                if made == n:
                    return
                yield Sample(s.measurement, s.fields, base_ns + k * span + s.time_ns, s.tags)
                made += 1


def build_spool(directory: Path, n: int) -> dict[str, Any]:
    base_ns = time.time_ns() - 6 * 3600 * 10**9  # inside any retention, clear of "now"
    counts: Counter[str] = Counter()
    conflicts: Counter[str] = Counter()
    # A field every point of a measurement has, to count that measurement back from the server.
    common: dict[str, set[str]] = {}
    spool = Spool(directory, SEGMENT_BYTES, 1.0)
    t0 = time.perf_counter()
    chunk: list[Sample] = []
    for s in _realistic(n, base_ns, conflicts):
        counts[s.measurement] += 1
        keys = set(s.fields)
        common[s.measurement] = common[s.measurement] & keys if s.measurement in common else keys
        chunk.append(s)
        if len(chunk) == 1000:
            spool.write(chunk)
            chunk = []
    spool.write(chunk)
    spool.close()
    took = time.perf_counter() - t0
    return {
        "lines": spool.lines_written,
        "bytes": spool.bytes_written,
        "segments": spool.segments_created,
        "bytes_per_line": spool.bytes_written / spool.lines_written,
        "build_s": took,
        "counts": dict(counts),
        "type_conflicts_left_out": dict(conflicts),
        "count_field": {m: sorted(keys)[0] for m, keys in common.items() if keys},
    }


class TimedWriter:
    """Wraps a LineWriter and adds up the time spent in its writes."""

    def __init__(self, inner: V1Writer | None) -> None:
        self.inner = inner
        self.write_s = 0.0
        self.writes = 0

    async def write(self, lines: Sequence[str]) -> None:
        t0 = time.perf_counter()
        if self.inner is not None:
            await self.inner.write(lines)
        self.write_s += time.perf_counter() - t0
        self.writes += 1

    async def ping(self) -> str:
        return "timed"

    async def aclose(self) -> None:
        if self.inner is not None:
            await self.inner.aclose()


async def drain_case(spool_dir: Path, work: Path, writer: TimedWriter, batch: int) -> dict[str, Any]:
    state = work / f"state-{batch}-{id(writer)}.json"
    fwd = Forwarder(spool_dir, writer, batch, state_path=state)
    backlog = fwd.backlog_lines()
    t0 = time.perf_counter()
    done = await fwd.drain(timeout_s=3600.0)
    took = time.perf_counter() - t0
    return {
        "batch_lines": batch,
        "lines": fwd.lines_shipped,
        "backlog_before": backlog,
        "all_shipped": done,
        "failures": fwd.failures,
        "seconds": took,
        "lines_per_s": fwd.lines_shipped / took,
        "write_share": writer.write_s / took,
        "writes": writer.writes,
    }


async def emulate_ship_job(
    spool_dir: Path, work: Path, writer: TimedWriter, seconds: float
) -> dict[str, Any]:
    """The app's `forward` job over the whole backlog: every interval up to SHIP_STEPS steps, runs it
    overlapped skipped; until caught up or `seconds` have passed."""
    batch = 5000
    fwd = Forwarder(spool_dir, writer, batch, state_path=work / "state-emulated.json")
    start = time.perf_counter()
    runs = skipped = k = 0
    caught_up = False
    end = start
    while not caught_up and k * SHIP_INTERVAL_S < seconds:
        now = time.perf_counter()
        due = start + k * SHIP_INTERVAL_S
        if due > now:
            await asyncio.sleep(due - now)
        runs += 1
        for _ in range(SHIP_STEPS):
            if await fwd.step() == 0:
                caught_up = True
                break
        end = time.perf_counter()
        # The next run is the first scheduled time after this one ended; those in between are missed.
        nxt = math.floor((end - start) / SHIP_INTERVAL_S) + 1
        skipped += max(0, nxt - k - 1)
        k = nxt
    took = end - start
    return {
        "batch_lines": batch,
        "seconds": took,
        "caught_up": caught_up,
        "job_runs": runs,
        "job_runs_skipped": skipped,
        "lines": fwd.lines_shipped,
        "lines_per_s": fwd.lines_shipped / took,
        "ceiling_lines_per_s": SHIP_STEPS * batch / SHIP_INTERVAL_S,
    }


async def count_back(url: str, db: str, count_field: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=120.0) as client:
        for measurement, field in sorted(count_field.items()):
            # Names from the fixture spools (plain identifiers), double-quoted.
            q = f'SELECT count("{field}") FROM "{measurement}"'  # noqa: S608
            response = await client.get(url + "/query", params={"db": db, "q": q})
            result = response.json()["results"][0]
            series = result.get("series", [])
            out[measurement] = int(series[0]["values"][0][1]) if series else 0
    return out


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    spool_dir = work / "spool"
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load1": os.getloadavg()[0]},
    }
    report["spool"] = build_spool(spool_dir, args.lines)
    report["forwarder_alone"] = await drain_case(spool_dir, work, TimedWriter(None), 5000)
    server = start_influxdb(work / "influxdb")
    report["influxd"] = {"pid": server.pid, "binary": INFLUXD}
    try:
        cases = []
        for batch in args.batches:
            db = f"backfill_{batch}"
            writer = V1Writer(server.url, db, timeout_s=60.0)
            await writer.create_database()
            report["influxd"]["version"] = await writer.ping()
            case = await drain_case(spool_dir, work, TimedWriter(writer), batch)
            await writer.aclose()
            back = await count_back(server.url, db, report["spool"]["count_field"])
            expected = {m: report["spool"]["counts"][m] for m in back}
            case["read_back_matches"] = back == expected
            case["read_back_points"] = sum(back.values())
            cases.append(case)
        report["influx"] = cases
        if args.emulate_s > 0:
            writer = V1Writer(server.url, "backfill_job", timeout_s=60.0)
            await writer.create_database()
            report["ship_job"] = await emulate_ship_job(spool_dir, work, TimedWriter(writer), args.emulate_s)
            await writer.aclose()
    finally:
        server.stop()  # by its pid (terminate, then kill)
    report["influxd"]["exit_code"] = server.process.returncode
    report["machine"]["load1_after"] = os.getloadavg()[0]
    return report


def print_report(r: dict[str, Any]) -> None:
    s = r["spool"]
    print(
        f"spool: {s['lines']:,} lines, {s['bytes'] / 1e6:.1f} MB ({s['bytes_per_line']:.0f} B/line), "
        f"{s['segments']} segments, written in {s['build_s']:.1f} s"
    )
    if s["type_conflicts_left_out"]:
        print(f"fields left out for a type conflict in the fixtures: {s['type_conflicts_left_out']}")
    a = r["forwarder_alone"]
    print(f"forwarder alone (writer accepts at once), batch 5000: {a['lines_per_s']:,.0f} lines/s")
    print(
        f"influxd {r['influxd'].get('version')} (pid {r['influxd']['pid']}, exit {r['influxd']['exit_code']})"
    )
    print("| batch_lines | lines | seconds | lines/s | in HTTP write | failures | read back = spool |")
    print("|---|---|---|---|---|---|---|")
    for c in r["influx"]:
        print(
            f"| {c['batch_lines']} | {c['lines']:,} | {c['seconds']:.1f} | {c['lines_per_s']:,.0f} | "
            f"{c['write_share']:.0%} | {c['failures']} | {c['read_back_matches']} |"
        )
    if "ship_job" in r:
        j = r["ship_job"]
        print(
            f"app ship job emulated, batch {j['batch_lines']}: {j['lines']:,} lines in {j['seconds']:.1f} s "
            f"(caught up: {j['caught_up']}): {j['lines_per_s']:,.0f} lines/s, "
            f"ceiling {j['ceiling_lines_per_s']:,.0f}; "
            f"{j['job_runs']} runs, {j['job_runs_skipped']} skipped (overran the interval)"
        )
    m = r["machine"]
    print(
        f"machine: {m['cpus']} CPUs, Python {m['python']}, load1 {m['load1']:.2f} -> {m['load1_after']:.2f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=500_000)
    ap.add_argument("--batches", type=int, nargs="+", default=[5000, 10000, 20000])
    ap.add_argument(
        "--emulate-s", type=float, default=120.0, help="most seconds of the emulated ship job (0: skip)"
    )
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (spool, influxd data)")
    args = ap.parse_args()
    if not (Path(INFLUXD).is_file() and os.access(INFLUXD, os.X_OK)):
        print(f"{INFLUXD} not found (apt-get install influxdb, or set SOAKD_INFLUXD)", file=sys.stderr)
        return 2
    configure_logs(level="warning")
    work = Path(tempfile.mkdtemp(prefix="soakd-backfill-"))
    try:
        report = asyncio.run(run(args, work))
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        report["spool"].pop("count_field")
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
