"""The forwarder (against in-memory writers) and the writers (against mock HTTP transports)."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from soakd.config import InfluxConfig
from soakd.errors import SinkError
from soakd.metric import Sample
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.influx import V1Writer, V2Writer, make_writer
from soakd.sinks.spool import Spool, iter_lines
from soakd.testing import ManualTime


class MemoryWriter:
    """Keeps every accepted batch; fails the next `fail_next` writes."""

    def __init__(self, fail_next: int = 0) -> None:
        self.batches: list[list[str]] = []
        self.fail_next = fail_next
        self.attempts = 0

    @property
    def lines(self) -> list[str]:
        return [line for batch in self.batches for line in batch]

    async def write(self, lines: Sequence[str]) -> None:
        self.attempts += 1
        if self.fail_next > 0:
            self.fail_next -= 1
            raise SinkError("connection refused")
        self.batches.append(list(lines))

    async def ping(self) -> str:
        return "memory"

    async def aclose(self) -> None:
        return None


def _fill(spool: Spool, start: int, n: int) -> None:
    spool.write(
        Sample("m", {"i": i, "s": f"v {i}"}, 1_000 + i, {"t": "a b"}) for i in range(start, start + n)
    )


def _indexes(lines: list[str]) -> list[int]:
    return [int(line.split("i=")[1].split("i,")[0]) for line in lines]


async def test_ships_everything_in_order_across_segments_once(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 300)
    assert len(spool.segments()) >= 3
    writer = MemoryWriter()
    fwd = Forwarder(tmp_path, writer, batch_lines=64)
    assert fwd.backlog_lines() == 300
    assert fwd.backlog_bytes() == spool.bytes_written

    shipped = [await fwd.step() for _ in range(6)]
    assert shipped == [64, 64, 64, 64, 44, 0]
    assert writer.lines == list(iter_lines(tmp_path))
    assert _indexes(writer.lines) == list(range(300))
    assert fwd.backlog_lines() == 0 and fwd.backlog_bytes() == 0
    assert (fwd.lines_shipped, fwd.batches) == (300, 5)

    # Lines written later are picked up, and nothing is shipped twice.
    _fill(spool, 300, 10)
    assert await fwd.step() == 10
    assert await fwd.step() == 0
    assert _indexes(writer.lines) == list(range(310))
    spool.close()


async def test_never_ships_a_torn_trailing_line(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    _fill(spool, 0, 3)
    seg = spool.current_segment
    with seg.open("ab") as f:
        f.write(b"m,t=a i=3i")  # the spool is in the middle of writing this line
    writer = MemoryWriter()
    fwd = Forwarder(tmp_path, writer, batch_lines=100)
    assert await fwd.step() == 3
    assert await fwd.step() == 0
    assert fwd.cursor == (seg.name, seg.stat().st_size - len(b"m,t=a i=3i"))
    with seg.open("ab") as f:
        f.write(b" 1003\n")  # ... and finishes it
    assert await fwd.step() == 1
    assert writer.lines[-1] == "m,t=a i=3i 1003"
    spool.close()


async def test_torn_tail_of_a_final_segment_is_skipped(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    _fill(spool, 0, 2)
    spool.close()
    with spool.current_segment.open("ab") as f:
        f.write(b"m i=")  # the daemon crashed mid-line
    restarted = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    _fill(restarted, 2, 2)
    writer = MemoryWriter()
    fwd = Forwarder(tmp_path, writer, batch_lines=100)
    assert await fwd.step() == 4
    assert _indexes(writer.lines) == [0, 1, 2, 3]
    assert await fwd.drain(timeout_s=60.0)  # a hang guard: it ends as soon as all is shipped
    restarted.close()


async def test_resumes_from_persisted_cursor(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool = Spool(spool_dir, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 200)
    writer = MemoryWriter()
    fwd = Forwarder(spool_dir, writer, batch_lines=70)
    assert await fwd.step() == 70
    assert await fwd.step() == 70
    state = json.loads((spool_dir / "forwarder.json").read_text())
    assert state == {"segment": fwd.cursor[0], "offset": fwd.cursor[1], "lines_shipped": 140}
    assert not list(spool_dir.glob("*.tmp"))

    # The daemon restarts: a new spool segment and a new forwarder from the saved state.
    spool.close()
    spool = Spool(spool_dir, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 200, 50)
    writer2 = MemoryWriter()
    fwd2 = Forwarder(spool_dir, writer2, batch_lines=70)
    assert fwd2.cursor == fwd.cursor
    assert fwd2.lines_shipped == 140
    assert await fwd2.drain(timeout_s=60.0)  # a hang guard: it ends as soon as all is shipped
    assert _indexes(writer.lines + writer2.lines) == list(range(250))
    assert fwd2.lines_shipped == 250
    spool.close()


async def test_custom_state_path_and_unreadable_state(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 5)
    state = tmp_path / "state.json"
    state.write_text("{not json")
    writer = MemoryWriter()
    # An unreadable state ships everything again (InfluxDB overwrites identical points) rather than skip.
    fwd = Forwarder(tmp_path / "spool", writer, batch_lines=10, state_path=state)
    assert await fwd.step() == 5
    assert json.loads(state.read_text())["lines_shipped"] == 5
    spool.close()


async def test_outage_keeps_cursor_loses_nothing_and_reports_events(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 50)
    writer = MemoryWriter()
    events: list[tuple[str, dict[str, float | int | str]]] = []
    clock = ManualTime(100.0)
    fwd = Forwarder(
        tmp_path, writer, batch_lines=40, on_event=lambda k, f: events.append((k, f)), clock=clock
    )
    assert await fwd.step() == 40

    writer.fail_next = 3
    cursor = fwd.cursor
    for n in range(3):
        assert await fwd.step() == 0
        assert fwd.cursor == cursor
        assert fwd.consecutive_failures == n + 1
        _fill(spool, 50 + n * 10, 10)  # samples keep arriving during the outage
        clock.now += 5.0
    assert fwd.failures == 3
    assert fwd.last_error == "connection refused"
    started: int | None = fwd.outage_started_ns
    assert started is not None and started > 0
    assert fwd.outage_s == pytest.approx(15.0)
    assert fwd.backlog_lines() == 40
    assert [k for k, _ in events] == ["sink_outage"]
    assert events[0][1] == {"backlog_lines": 10, "outage_s": 0.0, "reason": "connection refused"}

    assert await fwd.step() == 40  # the server is back
    assert fwd.consecutive_failures == 0
    assert fwd.outage_started_ns is None
    assert [k for k, _ in events] == ["sink_outage", "sink_backfill"]
    assert events[1][1] == {"backlog_lines": 40, "outage_s": 15.0, "reason": "connection refused"}
    assert _indexes(writer.lines) == list(range(80))
    assert writer.attempts == 5

    # A second outage is reported again.
    writer.fail_next = 1
    _fill(spool, 80, 1)
    assert await fwd.step() == 0
    attempts = writer.attempts
    assert await fwd.step() == 0  # backing off: no attempt before backoff_initial_s has passed
    assert writer.attempts == attempts
    clock.now += 0.5
    assert await fwd.step() == 1
    assert [k for k, _ in events] == ["sink_outage", "sink_backfill", "sink_outage", "sink_backfill"]
    assert fwd.failures == 4
    spool.close()


async def test_outage_at_the_first_attempt_is_reported(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 5)
    events: list[str] = []
    fwd = Forwarder(
        tmp_path, MemoryWriter(fail_next=1), batch_lines=10, on_event=lambda k, f: events.append(k)
    )
    assert await fwd.step() == 0
    assert events == ["sink_outage"]
    assert not (tmp_path / "forwarder.json").exists()
    spool.close()


async def test_drain_backs_off_and_recovers(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 100)
    clock = ManualTime(100.0)
    writer = MemoryWriter(fail_next=6)
    fwd = Forwarder(
        tmp_path,
        writer,
        batch_lines=30,
        sleep=clock.sleep,
        clock=clock,
        backoff_initial_s=0.5,
        backoff_max_s=4.0,
    )
    assert await fwd.drain(timeout_s=60.0)
    assert clock.sleeps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert _indexes(writer.lines) == list(range(100))
    spool.close()


async def test_drain_gives_up_at_timeout(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 10)
    clock = ManualTime(100.0)
    writer = MemoryWriter(fail_next=10**9)
    fwd = Forwarder(tmp_path, writer, batch_lines=30, sleep=clock.sleep, clock=clock, backoff_max_s=2.0)
    assert not await fwd.drain(timeout_s=10.0)
    assert clock.now == pytest.approx(110.0)
    assert max(clock.sleeps) <= 2.0
    assert writer.attempts == len(clock.sleeps) + 1
    assert fwd.cursor == ("", 0)
    assert fwd.backlog_lines() == 10
    spool.close()


async def test_drain_of_an_empty_spool_is_immediate(tmp_path: Path) -> None:
    fwd = Forwarder(tmp_path, MemoryWriter(), batch_lines=30)
    assert await fwd.drain(timeout_s=0.0)
    assert fwd.lines_shipped == 0


# -- writers -------------------------------------------------------------------------------------------


async def test_v1_writer_request_and_auth() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204, headers={"X-Influxdb-Version": "1.6.7"})

    writer = V1Writer(
        "http://influx:8086/",
        "soak db",
        retention_policy="week",
        username="ann",
        password="s3cret",
        transport=httpx.MockTransport(handler),
    )
    await writer.write(["m a=1i 1", "m a=2i 2"])
    assert await writer.ping() == "1.6.7"
    await writer.aclose()

    req = seen[0]
    assert req.method == "POST"
    assert req.url.path == "/write"
    assert dict(req.url.params) == {"db": "soak db", "rp": "week", "precision": "ns"}
    assert req.content == b"m a=1i 1\nm a=2i 2"
    assert req.headers["authorization"] == "Basic " + base64.b64encode(b"ann:s3cret").decode()
    assert seen[1].url.path == "/ping"


async def test_v1_writer_without_auth_or_rp_and_empty_batch() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    writer = V1Writer("http://influx:8086", "soakd", transport=httpx.MockTransport(handler))
    await writer.write([])
    assert seen == []
    await writer.write(["m a=1 1"])
    assert dict(seen[0].url.params) == {"db": "soakd", "precision": "ns"}
    assert "authorization" not in seen[0].headers
    await writer.aclose()


async def test_v1_writer_raises_with_server_message_on_400() -> None:
    message = 'partial write: field type conflict: input field "a" on measurement "m" is type float'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": message})

    writer = V1Writer("http://influx:8086", "soakd", transport=httpx.MockTransport(handler))
    with pytest.raises(SinkError, match="HTTP 400: partial write: field type conflict") as info:
        await writer.write(["m a=1.5 1"])
    assert message in str(info.value)
    with pytest.raises(SinkError, match="ping: HTTP 400"):
        await writer.ping()
    await writer.aclose()


async def test_v1_writer_turns_transport_errors_into_sink_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    writer = V1Writer(
        "http://influx:8086",
        "soakd",
        username="u",
        password="hunter2",
        transport=httpx.MockTransport(handler),
    )
    with pytest.raises(SinkError, match="ConnectError: connection refused") as info:
        await writer.write(["m a=1 1"])
    assert "hunter2" not in str(info.value)
    await writer.aclose()


async def test_v1_create_database_reports_statement_errors() -> None:
    queries: list[bytes] = []
    answer: dict[str, Any] = {"results": [{"statement_id": 0}]}

    def handler(request: httpx.Request) -> httpx.Response:
        queries.append(request.content)
        return httpx.Response(200, json=answer)

    writer = V1Writer("http://influx:8086", 'we"ird', transport=httpx.MockTransport(handler))
    await writer.create_database()
    assert queries[0] == b"q=CREATE+DATABASE+%22we%5C%22ird%22"
    answer = {"results": [{"statement_id": 0, "error": "unauthorized"}]}
    with pytest.raises(SinkError, match="create database: unauthorized"):
        await writer.create_database()
    await writer.aclose()


async def test_v2_writer_against_nothing_raises_sink_error() -> None:
    # A closed port on loopback: the blocking client's connection error becomes SinkError.
    writer = V2Writer("http://127.0.0.1:9", "-", "soakd/autogen", "u:p", timeout_s=2.0)
    with pytest.raises(SinkError):
        await writer.write(["m a=1 1"])
    with pytest.raises(SinkError, match="ping"):
        await writer.ping()
    await writer.aclose()


def test_make_writer_picks_by_api_and_reads_secrets_from_env() -> None:
    v1 = make_writer(
        InfluxConfig(api="v1", database="d", retention_policy="rp", username="u", password_env="PW"),
        {"PW": "pw"},
    )
    assert isinstance(v1, V1Writer)
    assert (v1.database, v1.retention_policy) == ("d", "rp")

    v2 = make_writer(InfluxConfig(api="v2", database="d", retention_policy="rp"), {})
    assert isinstance(v2, V2Writer)
    assert v2.bucket == "d/rp"
    v2b = make_writer(InfluxConfig(api="v2", database="d", bucket="b", org="o"), {"SOAKD_INFLUX_TOKEN": "t"})
    assert isinstance(v2b, V2Writer)
    assert (v2b.bucket, v2b.org) == ("b", "o")
    v2c = make_writer(InfluxConfig(api="v2", database="d"), {})
    assert isinstance(v2c, V2Writer)
    assert v2c.bucket == "d"


async def test_v1_writer_creates_a_missing_database_and_writes_again() -> None:
    from soakd.sinks.influx import V1Writer

    seen: list[tuple[str, str]] = []
    created = False

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal created
        seen.append((request.url.path, request.content.decode()))
        if request.url.path == "/query":
            created = True
            return httpx.Response(200, json={"results": [{"statement_id": 0}]})
        if not created:
            return httpx.Response(404, json={"error": 'database not found: "soakd"'})
        return httpx.Response(204)

    writer = V1Writer("http://influx", "soakd", transport=httpx.MockTransport(handler))
    await writer.write(["m a=1i 1"])
    await writer.aclose()
    assert [p for p, _ in seen] == ["/write", "/query", "/write"]
    assert "CREATE+DATABASE" in seen[1][1] or "CREATE DATABASE" in seen[1][1]


async def test_a_refused_batch_is_set_aside_not_retried_forever(tmp_path: Path) -> None:
    from soakd.errors import SinkRejected
    from soakd.sinks.forwarder import REJECTED_FILE, Forwarder

    spool = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    spool.write([Sample("m", {"v": i}, i + 1) for i in range(6)])
    spool.flush()
    shipped: list[str] = []
    calls = 0

    class Refusing:
        async def write(self, lines: Sequence[str]) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise SinkRejected("HTTP 400: field type conflict")
            shipped.extend(lines)

        async def ping(self) -> str:
            return "x"

        async def aclose(self) -> None:
            return None

    events: list[str] = []
    fwd = Forwarder(tmp_path, Refusing(), batch_lines=3, on_event=lambda kind, _: events.append(kind))
    assert await fwd.drain(5.0)
    assert len(shipped) == 3 and fwd.lines_rejected == 3
    # Only the lines the sink took count as shipped; the refused ones are counted apart.
    assert fwd.lines_shipped == 3
    kept = (tmp_path / REJECTED_FILE).read_text().splitlines()
    assert kept == [line for line in iter_lines(tmp_path)][:3]
    assert events == ["sink_rejected"]
    spool.close()


# -- backlog as a series, backoff, a full disk ---------------------------------------------------------


def _fresh_count(spool_dir: Path, shipped: int) -> int:
    return len(list(iter_lines(spool_dir))) - shipped


async def test_backlog_reads_only_what_was_appended_since_the_last_look(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 200)
    fwd = Forwarder(tmp_path, MemoryWriter(), batch_lines=50)
    assert fwd.backlog_lines() == 200
    first = spool.segments()[0]
    # Counted bytes are never read again: overwrite a counted segment with as many bytes and no
    # newline, and the backlog still says what was counted.
    first.write_bytes(b"x" * first.stat().st_size)
    assert fwd.backlog_lines() == 200
    _fill(spool, 200, 7)
    assert fwd.backlog_lines() == 207  # ... while appended lines are counted
    spool.close()


async def test_backlog_follows_shipping_outages_restarts_and_torn_tails(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=2048, fsync_interval_s=1.0)
    clock = ManualTime(100.0)
    writer = MemoryWriter()
    fwd = Forwarder(tmp_path, writer, batch_lines=33, clock=clock)

    async def check() -> None:
        assert fwd.backlog_lines() == _fresh_count(tmp_path, len(writer.lines))
        total = sum(p.stat().st_size for p in spool.segments())
        done = sum(p.stat().st_size for p in spool.segments() if p.name < fwd.cursor[0]) + fwd.cursor[1]
        assert fwd.backlog_bytes() == total - done

    _fill(spool, 0, 100)
    await check()
    assert await fwd.step() == 33
    await check()
    _fill(spool, 100, 50)
    writer.fail_next = 2
    assert await fwd.step() == 0
    await check()
    clock.now += 0.5
    assert await fwd.step() == 0
    _fill(spool, 150, 10)
    await check()
    clock.now += 1.0
    for _ in range(3):
        await fwd.step()
    await check()
    spool.close()
    with spool.current_segment.open("ab") as f:
        f.write(b"m,t=a i=")  # killed mid-line
    await check()
    spool = Spool(tmp_path, segment_bytes=2048, fsync_interval_s=1.0)
    _fill(spool, 160, 40)
    await check()
    assert await fwd.drain(5.0)
    await check()
    assert fwd.backlog_lines() == 0 and fwd.backlog_bytes() == 0
    assert _indexes(writer.lines) == list(range(200))
    spool.close()


async def test_backlog_recounts_when_segments_are_deleted_by_hand(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=2048, fsync_interval_s=1.0)
    _fill(spool, 0, 150)
    fwd = Forwarder(tmp_path, MemoryWriter(), batch_lines=10)
    assert fwd.backlog_lines() == 150
    spool.segments()[1].unlink()  # an operator making room on a full disk
    assert fwd.backlog_lines() == _fresh_count(tmp_path, 0) < 150
    spool.close()


async def test_series_fields_report_backlog_age_and_counters(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 30)  # times 1000..1029 ns
    clock = ManualTime(100.0)
    writer = MemoryWriter(fail_next=1)
    fwd = Forwarder(tmp_path, writer, batch_lines=20, clock=clock)
    assert await fwd.step() == 0
    clock.now += 4.0
    fields = fwd.series_fields(now_ns=1_000 + 5_000_000_000)
    assert fields == {
        "backlog_lines": 30,
        "backlog_bytes": spool.bytes_written,
        "backlog_age_s": 5.0,
        "outage_s": 4.0,
        "lines_shipped": 0,
        "lines_rejected": 0,
        "batches": 0,
        "failures": 1,
        "consecutive_failures": 1,
    }
    assert await fwd.step() == 20
    # The oldest unshipped line is now the 21st (time 1020).
    assert fwd.backlog_age_s(now_ns=1_020 + 2_000_000_000) == 2.0
    assert await fwd.step() == 10
    fields = fwd.series_fields(now_ns=10**19)
    assert fields["backlog_lines"] == fields["backlog_bytes"] == 0
    assert fields["backlog_age_s"] == 0.0
    assert fields["outage_s"] == 4.0  # the last outage's length
    assert (fields["lines_shipped"], fields["batches"], fields["consecutive_failures"]) == (30, 2, 0)
    spool.close()


async def test_step_backs_off_exponentially_while_the_database_is_down(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 5)
    clock = ManualTime(100.0)
    writer = MemoryWriter(fail_next=10**9)
    fwd = Forwarder(tmp_path, writer, batch_lines=10, clock=clock, backoff_initial_s=0.5, backoff_max_s=4.0)
    attempt_times: list[float] = []
    for tick in range(160):  # a periodic caller, every 0.125 s (exact in binary) for 20 s
        clock.now = 100.0 + tick * 0.125
        before = writer.attempts
        await fwd.step()
        if writer.attempts > before:
            attempt_times.append(clock.now - 100.0)
    assert attempt_times == [0.0, 0.5, 1.5, 3.5, 7.5, 11.5, 15.5, 19.5]
    writer.fail_next = 0
    clock.now += 4.0
    assert await fwd.step() == 5
    spool.close()


async def test_a_cursor_that_cannot_be_saved_does_not_stop_shipping(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", segment_bytes=4096, fsync_interval_s=1.0)
    _fill(spool, 0, 25)
    writer = MemoryWriter()
    # The state's folder does not exist: every save fails, as on a full disk.
    fwd = Forwarder(tmp_path / "spool", writer, batch_lines=10, state_path=tmp_path / "gone" / "state.json")
    assert await fwd.drain(5.0)
    assert _indexes(writer.lines) == list(range(25))
    assert fwd.state_save_failures == 3
    assert fwd.cursor[1] == spool.bytes_written
    spool.close()


async def test_a_refused_batch_that_cannot_be_set_aside_is_located_in_the_spool(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    from soakd.errors import SinkRejected
    from soakd.sinks.forwarder import REJECTED_FILE

    spool = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    _fill(spool, 0, 4)
    (tmp_path / REJECTED_FILE).mkdir()  # cannot be opened for writing

    class Refusing:
        async def write(self, lines: Sequence[str]) -> None:
            raise SinkRejected("HTTP 400: bad")

        async def ping(self) -> str:
            return "x"

        async def aclose(self) -> None:
            return None

    fwd = Forwarder(tmp_path, Refusing(), batch_lines=4)
    with capture_logs() as logs:
        assert await fwd.step() == 4
    assert fwd.lines_rejected == 4
    kept = [e["kept_in"] for e in logs if e["event"] == "sink_rejected_batch"]
    assert kept == [f"spool, from the first segment to {spool.current_segment.name}:{spool.bytes_written}"]
    spool.close()


async def test_ships_only_what_soakd_wrote(tmp_path: Path) -> None:
    """A segment name that is a symlink (to a secret), a FIFO, a device or a folder is refused, never
    read, shipped or set aside; a line longer than any soakd writes is skipped without being held whole;
    the lines around it ship in order."""
    import os

    from soakd.sinks.spool import MAX_LINE_BYTES, iter_samples

    spool = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    _fill(spool, 0, 2)
    spool.close()
    seg = spool.current_segment
    with seg.open("ab") as f:  # a huge line (a damaged or foreign segment), then soakd's own again
        f.write(b'm,t=x s="' + b"A" * (3 * MAX_LINE_BYTES) + b'" 1\n')
    again = Spool(tmp_path, segment_bytes=1 << 20, fsync_interval_s=1.0)
    _fill(again, 2, 2)
    again.close()
    secret = tmp_path.parent / f"{tmp_path.name}-secret.txt"
    secret.write_text('m,t=x password="Zq9hunter2" 1\n')
    (tmp_path / "seg-00000100.lp").symlink_to(secret)
    os.mkfifo(tmp_path / "seg-00000101.lp")
    (tmp_path / "seg-00000102.lp").symlink_to("/dev/zero")
    (tmp_path / "seg-00000103.lp").mkdir()
    writer = MemoryWriter()
    fwd = Forwarder(tmp_path, writer, batch_lines=100)
    assert await fwd.step() == 4
    assert await fwd.step() == 0
    assert _indexes(writer.lines) == [0, 1, 2, 3]
    assert "Zq9hunter2" not in "".join(writer.lines)
    assert [s.fields["i"] for s in iter_samples(tmp_path, "m")] == [0, 1, 2, 3]
    assert not (tmp_path / "rejected.lp").exists()
