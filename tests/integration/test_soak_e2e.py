"""One real soak: a Mooncake trace through a real vLLM CPU engine with ngram speculation, telemetry
through the spool into a real InfluxDB 1.6.7, and a verdict that matches the exit code.

It runs the installed CLI as a separate process, as a user would, and reads everything back with
InfluxQL. It takes about two minutes (engine start ~40 s, one minute of replay).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Server, run_soakd

from soakd.metric import parse_line

pytestmark = pytest.mark.integration

DURATION_S = 60.0
TRACE_SPAN_MS = 29_000
TRACE_ROWS = 40
DB = "soak_e2e"
# A field every point of the measurement carries, so count() of it counts points.
ALWAYS_FIELD = {
    "requests": "index",
    "engine": "steps",
    "spec_decode": "drafts",
    "host": "cpu_percent",
    "collector": "duration_s",
    "events": "message",
    "run": "passed",
}


def write_mooncake(path: Path) -> list[float]:
    """A Mooncake trace: 40 requests over 29 s, 512-token blocks, half sharing a prefix block."""
    rows = []
    times = []
    for i in range(TRACE_ROWS):
        ts = round(i * TRACE_SPAN_MS / (TRACE_ROWS - 1))
        inp = 100 + (i * 37) % 600
        blocks = math.ceil(inp / 512)
        hash_ids = (
            [7] + [1000 + i * 4 + b for b in range(blocks - 1)]
            if i % 2
            else [2000 + i * 4 + b for b in range(blocks)]
        )
        rows.append(
            {"timestamp": ts, "input_length": inp, "output_length": 16 + (i * 13) % 48, "hash_ids": hash_ids}
        )
        times.append(ts / 1000)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return times


def expected_requests(times: list[float], duration: float) -> int:
    """Requests due within the duration when the trace loops, each pass shifted by span + mean gap."""
    span = times[-1] - times[0]
    period = span + span / (len(times) - 1)
    count = 0
    k = 0
    while k * period < duration:
        count += sum(1 for t in times if t + k * period < duration)
        k += 1
    return count


def influxql(server: Server, query: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{server.url}/query", params={"db": DB, "q": query, "epoch": "ns"}, timeout=30)
    r.raise_for_status()
    result = r.json()["results"][0]
    assert "error" not in result, result
    return list(result.get("series", []))


def spool_counts(run_dir: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for seg in sorted((run_dir / "spool").glob("seg-*.lp")):
        for line in seg.read_text(encoding="utf-8").splitlines():
            counts[parse_line(line).measurement] += 1
    return counts


def test_soak_end_to_end(tmp_path: Path, influxdb: Server, tiny_model: Path) -> None:
    times = write_mooncake(tmp_path / "trace.jsonl")
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f"""
[run]
name = "e2e"
duration = "{DURATION_S:.0f}s"
output_dir = "runs"
[trace]
path = "trace.jsonl"
format = "mooncake"
[engine]
model = "{tiny_model}"
max_model_len = 1024
[engine.speculative]
enabled = true
method = "ngram"
num_speculative_tokens = 3
[sinks.influx]
enabled = true
url = "{influxdb.url}"
api = "v1"
database = "{DB}"
[criteria]
ttft_p99_ms = 60000.0
tpot_p99_ms = 5000.0
""",
        encoding="utf-8",
    )
    code, out, err = run_soakd(cfg, tmp_path)
    assert code in (0, 1), err[-3000:]
    summary = json.loads(out)
    run_dir = Path(summary["run_dir"])
    run_id = summary["run_id"]

    # The verdict file exists and agrees with the exit code.
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["exit_code"] == code
    assert verdict["verdict"] == ("PASS" if code == 0 else "FAIL")

    # Requests: trace schedule == spool records == InfluxDB points.
    want = expected_requests(times, DURATION_S)
    assert want > TRACE_ROWS  # the trace looped
    spool = spool_counts(run_dir)
    assert spool["requests"] == want
    assert summary["replay"]["scheduled"] == want
    assert verdict["requests"]["scheduled"] == want

    # Every spooled line was shipped; every measurement reads back with InfluxQL, point for point.
    assert summary["influx"]["all_shipped"] is True
    assert summary["influx"]["backlog_lines"] == 0
    assert summary["influx"]["lines_shipped"] == sum(spool.values())
    shown = {row[0] for s in influxql(influxdb, "SHOW MEASUREMENTS") for row in s["values"]}
    assert set(ALWAYS_FIELD) <= set(spool), spool
    assert set(spool) <= shown
    for measurement, field in ALWAYS_FIELD.items():
        series = influxql(
            influxdb, f'SELECT count("{field}") FROM "{measurement}" WHERE "run_id" = \'{run_id}\''
        )
        got = series[0]["values"][0][1] if series else 0
        assert got == spool[measurement], (measurement, got, spool[measurement])

    # Speculative decoding really ran, and its counters reached the database.
    spec = influxql(
        influxdb,
        f'SELECT sum("drafts"), sum("draft_tokens"), sum("accepted") FROM spec_decode '
        f"WHERE \"run_id\" = '{run_id}'",
    )
    _, drafts, draft_tokens, accepted = spec[0]["values"][0]
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens

    # Requests completed with the exact output lengths the trace asked for.
    ok = influxql(
        influxdb,
        f'SELECT count("index") FROM requests WHERE "status" = \'ok\' AND "run_id" = \'{run_id}\'',
    )
    assert ok and ok[0]["values"][0][1] == summary["replay"]["completed"] > 0
    short = influxql(
        influxdb,
        f'SELECT count("index") FROM requests WHERE "status" = \'ok\' AND '
        f'"output_tokens" <> "output_tokens_expected" AND "run_id" = \'{run_id}\'',
    )
    assert not short

    # The engine series carry the engine configuration tag; the prefix cache saw shared blocks.
    cfg_tags = influxql(influxdb, 'SHOW TAG VALUES FROM engine WITH KEY = "config"')
    assert cfg_tags and len(cfg_tags[0]["values"]) == 1
    hits = influxql(influxdb, f'SELECT sum("prefix_hits") FROM engine WHERE "run_id" = \'{run_id}\'')
    assert hits[0]["values"][0][1] > 0

    # `soakd report` re-judges from the spool alone and reaches the same verdict.
    rep = subprocess.run(
        [sys.executable, "-m", "soakd", "report", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert rep.returncode == code, rep.stderr
    again = json.loads(rep.stdout)
    assert again["verdict"] == verdict["verdict"]
    assert again["requests"]["scheduled"] == want
