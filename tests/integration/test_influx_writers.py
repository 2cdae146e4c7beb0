"""Spool -> Forwarder -> writer -> a real server, read back: counts, exact values, outages survived."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Server

from soakd.errors import SinkError
from soakd.metric import Sample
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.influx import V1Writer, V2Writer
from soakd.sinks.spool import Spool

pytestmark = pytest.mark.integration

# An hour ago, on a whole millisecond (victoria-metrics keeps milliseconds), inside every retention.
BASE_NS = (time.time_ns() // 1_000_000 - 3_600_000) * 1_000_000
NOTE = 'he said "hi, there", then left \\ ok'
RUN_ID = "run 1,a=b"


def _engine_samples(start: int, n: int) -> list[Sample]:
    return [
        Sample(
            "engine",
            {"tokens": i, "rate": i + 0.25, "note": f"{NOTE} #{i}", "ok": i % 2 == 0},
            BASE_NS + i * 1_000_000,
            {"run_id": RUN_ID, "gpu": str(i % 2)},
        )
        for i in range(start, start + n)
    ]


def _query(server: Server, db: str, q: str) -> list[dict[str, Any]]:
    response = httpx.get(server.url + "/query", params={"db": db, "q": q, "epoch": "ns"}, timeout=10.0)
    response.raise_for_status()
    result = response.json()["results"][0]
    assert "error" not in result, result
    series: list[dict[str, Any]] = result.get("series", [])
    return series


def _count(server: Server, db: str, field: str = "tokens") -> int:
    series = _query(server, db, f'SELECT count("{field}") FROM "engine"')
    return int(series[0]["values"][0][1]) if series else 0


async def _v1(server: Server, db: str) -> V1Writer:
    writer = V1Writer(server.url, db, timeout_s=5.0)
    await writer.create_database()
    await writer.create_database()  # idempotent
    return writer


async def test_v1_roundtrip_keeps_counts_types_and_escapes(influxdb: Server, tmp_path: Path) -> None:
    db = "roundtrip"
    spool = Spool(tmp_path / "spool", segment_bytes=8192, fsync_interval_s=1.0)
    spool.write(_engine_samples(0, 1000))
    assert len(spool.segments()) > 5
    writer = await _v1(influxdb, db)
    assert (await writer.ping()).startswith("1.")
    fwd = Forwarder(tmp_path / "spool", writer, batch_lines=128)
    assert await fwd.drain(timeout_s=30.0)
    assert fwd.lines_shipped == 1000
    assert fwd.failures == 0

    counts = _query(influxdb, db, 'SELECT count(*) FROM "engine"')[0]
    assert dict(zip(counts["columns"], counts["values"][0], strict=True)) == {
        "time": 0,
        "count_note": 1000,
        "count_ok": 1000,
        "count_rate": 1000,
        "count_tokens": 1000,
    }
    rows = _query(influxdb, db, f'SELECT * FROM "engine" WHERE time = {BASE_NS + 7 * 1_000_000}')[0]
    row = dict(zip(rows["columns"], rows["values"][0], strict=True))
    assert row == {
        "time": BASE_NS + 7_000_000,
        "gpu": "1",
        "note": f"{NOTE} #7",
        "ok": False,
        "rate": 7.25,
        "run_id": RUN_ID,
        "tokens": 7,
    }
    assert isinstance(row["tokens"], int)
    tags = _query(influxdb, db, 'SHOW TAG VALUES FROM "engine" WITH KEY = "run_id"')[0]
    assert tags["values"] == [["run_id", RUN_ID]]
    assert _query(influxdb, db, 'SELECT sum("tokens") FROM "engine"')[0]["values"][0][1] == sum(range(1000))

    # More samples later: only the new ones are shipped.
    spool.write(_engine_samples(1000, 10))
    assert await fwd.drain(timeout_s=30.0)
    assert _count(influxdb, db) == 1010
    spool.close()
    await writer.aclose()


async def test_v1_field_type_conflict_raises_with_server_message(influxdb: Server) -> None:
    writer = await _v1(influxdb, "conflict")
    await writer.write([f"m a=1i {BASE_NS}"])
    with pytest.raises(SinkError, match="HTTP 400: partial write: field type conflict"):
        await writer.write([f"m a=1.5 {BASE_NS + 1}"])
    with pytest.raises(SinkError, match="HTTP 400"):
        await writer.write(["not line protocol"])
    await writer.aclose()


async def test_v1_writer_creates_a_missing_database(influxdb: Server) -> None:
    db = "created_on_first_write"
    shown = _query(influxdb, "", "SHOW DATABASES")
    assert db not in {row[0] for row in shown[0].get("values", [])}
    writer = V1Writer(influxdb.url, db, timeout_s=5.0)
    await writer.write([f"engine tokens=5i {BASE_NS}"])
    await writer.aclose()
    assert _count(influxdb, db) == 1


async def test_server_outage_loses_nothing(tmp_path: Path, influxdb_starter: Callable[..., Server]) -> None:
    server = influxdb_starter(tmp_path / "influx")
    db = "outage"
    events: list[tuple[str, dict[str, float | int | str]]] = []
    spool = Spool(tmp_path / "spool", segment_bytes=8192, fsync_interval_s=1.0)
    writer = V1Writer(server.url, db, timeout_s=5.0)
    try:
        await writer.create_database()
        fwd = Forwarder(
            tmp_path / "spool",
            writer,
            batch_lines=100,
            on_event=lambda kind, fields: events.append((kind, fields)),
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        spool.write(_engine_samples(0, 200))
        assert await fwd.drain(timeout_s=30.0)
        assert _count(server, db) == 200

        server.stop()
        assert server.process.returncode is not None
        spool.write(_engine_samples(200, 300))
        assert await fwd.step() == 0
        assert not await fwd.drain(timeout_s=0.3)
        assert fwd.consecutive_failures >= 2
        assert fwd.backlog_lines() == 300
        assert [kind for kind, _ in events] == ["sink_outage"]
        spool.write(_engine_samples(500, 100))

        # Same data directory, same port: the forwarder's URL is valid again.
        restarted = influxdb_starter(tmp_path / "influx", server.ports["http"], server.ports["rpc"])
        assert await fwd.drain(timeout_s=30.0)
        assert _count(restarted, db) == 600
        assert _count(restarted, db, "note") == 600
        assert fwd.backlog_lines() == 0
        assert [kind for kind, _ in events] == ["sink_outage", "sink_backfill"]
        backfill = events[1][1]
        assert backfill["backlog_lines"] == 400
        assert isinstance(backfill["outage_s"], float) and backfill["outage_s"] > 0
        assert "ConnectError" in str(backfill["reason"])
    finally:
        spool.close()
        await writer.aclose()


def _vm_export(server: Server, match: str, expect_series: int) -> list[dict[str, Any]]:
    """Series matching `match`, once victoria-metrics has made the expected number searchable."""
    deadline = time.monotonic() + 30.0
    with httpx.Client(timeout=10.0) as client:
        while True:
            # Freshly ingested rows become searchable once flushed from the in-memory buffers.
            client.get(server.url + "/internal/force_flush").raise_for_status()
            response = client.get(server.url + "/api/v1/export", params={"match[]": match})
            response.raise_for_status()
            series = [json.loads(line) for line in response.text.splitlines() if line.strip()]
            if len(series) >= expect_series or time.monotonic() > deadline:
                return series
            time.sleep(0.05)  # poll interval


async def test_v2_writer_to_victoria_metrics(victoria_metrics: Server, tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", segment_bytes=4096, fsync_interval_s=1.0)
    spool.write(
        Sample(
            "gpu",
            {"power_w": 100.0 + i / 4, "clock_mhz": 1400 + i},
            BASE_NS + i * 1_000_000,
            {"gpu": str(i % 2), "run_id": "v2 run"},
        )
        for i in range(400)
    )
    writer = V2Writer(victoria_metrics.url, "-", "soakd", "user:password", timeout_s=5.0)
    assert await writer.ping() == "unknown"  # victoria-metrics sends no version header
    fwd = Forwarder(tmp_path / "spool", writer, batch_lines=64)
    assert await fwd.drain(timeout_s=30.0)
    assert fwd.lines_shipped == 400

    series = _vm_export(victoria_metrics, '{__name__=~"gpu_.*", run_id="v2 run"}', expect_series=4)
    by_key = {(s["metric"]["__name__"], s["metric"]["gpu"]): s for s in series}
    assert set(by_key) == {
        ("gpu_power_w", "0"),
        ("gpu_power_w", "1"),
        ("gpu_clock_mhz", "0"),
        ("gpu_clock_mhz", "1"),
    }
    power0 = by_key[("gpu_power_w", "0")]
    assert power0["timestamps"] == [(BASE_NS + i * 1_000_000) // 1_000_000 for i in range(0, 400, 2)]
    assert power0["values"] == [100.0 + i / 4 for i in range(0, 400, 2)]
    assert by_key[("gpu_clock_mhz", "1")]["values"] == [1400 + i for i in range(1, 400, 2)]
    spool.close()
    await writer.aclose()
