"""soakd's log lines: one JSON object per line on stderr, library logs included."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

import soakd.logs
from soakd.logs import bind, configure, resolve_format, under_journald


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()


def _lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_library_logs_and_their_tracebacks_come_out_as_json(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure("info")
    configure("info")  # configured twice (a CLI called in-process again): still one line per record
    bind(run_id="r1")
    structlog.get_logger("soakd.test").info("ours", n=1)
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        logging.getLogger("apscheduler.executors.default").exception('Job "control" raised an exception')
    logging.getLogger("apscheduler.scheduler").info("Added job")  # below warning: not in the journal
    logging.getLogger("apscheduler.scheduler").warning("Execution of job skipped")
    lines = _lines(capsys.readouterr().err)
    assert [d["event"] for d in lines] == [
        "ours",
        'Job "control" raised an exception',
        "Execution of job skipped",
    ]
    failed = lines[1]
    assert failed["level"] == "error" and failed["logger"] == "apscheduler.executors.default"
    assert failed["run_id"] == "r1"
    assert "ZeroDivisionError: boom" in str(failed["exception"])


def test_without_a_journal_socket_journald_lines_go_to_stderr_with_their_priority(
    restore_logging: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(soakd.logs, "JOURNAL_SOCKET", str(tmp_path / "no-socket"))
    assert configure("info", fmt="journald") == "journald"
    logging.getLogger("apscheduler.scheduler").warning("skipped")
    structlog.get_logger("soakd.test").error("bad")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("<4>{") and err[1].startswith("<3>{")


def test_under_journald_every_key_is_a_journal_field(
    restore_logging: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = str(tmp_path / "journal.socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(5)
    monkeypatch.setattr(soakd.logs, "JOURNAL_SOCKET", path)
    try:
        configure("info", fmt="journald")
        bind(run_id="20261201T000000Z-soak-ab12", host="h1")
        structlog.get_logger("soakd.test").warning("event", kind="throttle_enter", message="two\nlines", n=3)
        logging.getLogger("apscheduler.scheduler").error("Job failed")
        datagrams = [server.recv(65536), server.recv(65536)]
    finally:
        server.close()
    assert capsys.readouterr().err == ""  # journald took both: nothing doubled on stderr
    first = _parse_native(datagrams[0])
    assert first["RUN_ID"] == "20261201T000000Z-soak-ab12" and first["HOST"] == "h1"
    assert first["EVENT"] == "event" and first["KIND"] == "throttle_enter" and first["N"] == "3"
    assert first["PRIORITY"] == "4" and first["SYSLOG_IDENTIFIER"] == "soakd"
    assert first["MESSAGE"].startswith("event kind=throttle_enter") and first["SOAKD_MESSAGE"] == "two\nlines"
    second = _parse_native(datagrams[1])
    assert second["EVENT"] == "Job failed" and second["PRIORITY"] == "3" and second["RUN_ID"].endswith("ab12")


def _parse_native(data: bytes) -> dict[str, str]:
    """journald's native format read back (the inverse of soakd.logs.encode_journal)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            out[key.decode()] = value.decode()
            i = nl + 1
        else:
            (size,) = struct.unpack("<Q", data[nl + 1 : nl + 9])
            out[line.decode()] = data[nl + 9 : nl + 9 + size].decode()
            i = nl + 9 + size + 1
    return out


def test_on_a_terminal_lines_are_for_people(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert configure("info", fmt="console") == "console"
    structlog.get_logger("soakd.test").info("engine_started", start_s=12.5)
    err = capsys.readouterr().err
    assert "engine_started" in err and "start_s=12.5" in err and not err.lstrip().startswith("{")


def test_auto_is_json_in_a_pipe_and_journald_only_on_the_stream_systemd_named(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    assert resolve_format("auto") == "json"  # capsys/pytest: not a terminal
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")  # inherited, but stderr is not that stream
    assert not under_journald() and resolve_format("auto") == "json"
    st = os.fstat(sys.stderr.fileno())
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert under_journald() and resolve_format("auto") == "journald"


def test_no_url_credential_reaches_a_log_line(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure("info")
    structlog.get_logger("soakd.test").warning(
        "sink_outage", error="POST HTTP://soakd:Zq9hunter2@db:8086/write?db=s&access_token=Zq9tok failed"
    )
    try:
        raise ConnectionError("cannot reach https://u:Zq9hunter2@alerts:9093/api/v2/alerts")
    except ConnectionError:
        logging.getLogger("aiohttp.client").exception("request failed")
    err = capsys.readouterr().err
    assert "Zq9" not in err
    lines = _lines(err)
    assert "db:8086/write?db=s&access_token=<redacted>" in str(lines[0]["error"])
    assert "alerts:9093" in str(lines[1]["exception"])
