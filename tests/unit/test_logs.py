"""soakd's log lines: one JSON object per line on stderr, library logs included."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from soakd.logs import bind, configure


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


def test_journald_prefix_carries_the_priority(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure("info", journald_prefix=True)
    logging.getLogger("apscheduler.scheduler").warning("skipped")
    structlog.get_logger("soakd.test").error("bad")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("<4>{") and err[1].startswith("<3>{")


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
