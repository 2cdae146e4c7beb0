"""The progress bar of an interactive run: log lines written while it is drawn come out whole, on lines
of their own, and its last figure is the run summary's tokens/s."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
import structlog

from soakd import logs
from soakd.cli.run import print_summary
from soakd.progress import Progress
from soakd.replay.runner import ReplayStats


def _visible_lines(text: str) -> list[str]:
    """What a terminal shows of each line: what follows its last carriage return, trailing blanks cut."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]


def test_log_lines_clear_the_bar_and_come_out_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    logs.configure("info", fmt="json")
    log = structlog.get_logger("test")
    progress = Progress(enabled=True)
    progress.update(1.0, 10.0, ReplayStats(completed=1, dispatched=2, output_tokens=50))
    assert "done 1 failed 0 in-flight 1 now 50 tok/s" in term.getvalue()
    # structlog's line, a stdlib one (APScheduler's path) and a print, each in pieces as print writes.
    log.warning("first_event", n=1)
    logging.getLogger("apscheduler.test").warning("second event")
    print("third", "line", file=sys.stderr)
    progress.update(2.0, 10.0, ReplayStats(completed=3, dispatched=3, output_tokens=150))
    progress.close()
    assert sys.stderr is term  # the stream is given back
    shown = _visible_lines(term.getvalue())
    first = next(line for line in shown if "first_event" in line)
    assert first.startswith('{"n": 1, "event": "first_event"') and first.endswith("}")
    assert any(line.endswith("second event") or '"second event"' in line for line in shown)
    assert "third line" in shown
    # The bar is drawn again after the lines, with the rate since the last redraw.
    assert "now 100 tok/s" in shown[-1] or "now 100 tok/s" in shown[-2]


def test_the_last_figure_is_the_summarys_tokens_per_s(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    progress = Progress(enabled=True)
    # The last redraw saw 900 tokens at 9 s of 10; the run ended with 1,234 over 10.5 s.
    progress.update(9.0, 10.0, ReplayStats(completed=9, dispatched=10, output_tokens=900))
    summary = {
        "run_id": "r",
        "ran_s": 10.5,
        "points": {},
        "replay": {"scheduled": 12, "completed": 11, "failed": 1, "shed": 0, "output_tokens": 1234},
    }
    progress.finish(summary)
    last = _visible_lines(term.getvalue())[-2]  # tqdm ends the closed bar with a newline
    assert last.endswith("done 11 failed 1 run average 117.5 tok/s")
    print_summary(summary, Path("runs/r"), Path("runs/r/report.html"))
    out = capsys.readouterr().out
    assert "1234 output tokens (117.5 tok/s)" in out
    assert "  report: runs/r/report.html" in out.splitlines()


def test_a_disabled_bar_leaves_stderr_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    progress = Progress(enabled=False)
    progress.update(1.0, 10.0, ReplayStats())
    assert sys.stderr is term and term.getvalue() == ""
