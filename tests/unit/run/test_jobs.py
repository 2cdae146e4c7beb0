"""The scheduler's skipped runs: a job that outlasts its interval is skipped by APScheduler; soakd counts
the skips per job for summary.json and says them at most once a minute per job, not a line each."""

from __future__ import annotations

import asyncio
import io
import logging
import sys

import pytest
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from structlog.testing import capture_logs

from soakd import jobs as jobs_module
from soakd import logs
from soakd.jobs import SkipLog
from soakd.testing import ManualClock


def test_skips_are_counted_and_said_once_per_minute_per_job() -> None:
    clock = ManualClock()
    skips = SkipLog(clock, every_s=60.0)
    with capture_logs() as said:
        for _ in range(30):  # a 1 s job skipped for half a minute: one line now, the rest later
            skips.add("slow")
            clock.sleep(1.0)
        skips.add("collect")
        clock.sleep(31.0)
        skips.add("slow")  # a minute after the first line: said, with the 30 since
        skips.add("slow")
        skips.flush()  # the run ends: the last one is said too
    lines = [(e["job"], e["skipped"], e["total"]) for e in said if e["event"] == "job_skipped"]
    assert lines == [("slow", 1, 1), ("collect", 1, 1), ("slow", 30, 31), ("slow", 1, 32)]
    assert all(e["log_level"] == "warning" for e in said)
    assert skips.skipped == {"slow": 32, "collect": 1}


def test_a_real_scheduler_skipping_a_job_logs_no_line_per_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    logs.configure("info", fmt="json")
    skips = SkipLog()

    async def main() -> None:
        release = asyncio.Event()
        scheduler = AsyncIOScheduler(
            job_defaults={"coalesce": True, "max_instances": 1}, logger=jobs_module._SCHEDULER_LOG
        )
        scheduler.add_listener(lambda e: skips.add(e.job_id), EVENT_JOB_MAX_INSTANCES)
        # Held until released: every later run of it is skipped.
        scheduler.add_job(release.wait, "interval", seconds=0.02, id="stuck")
        scheduler.start()
        for _ in range(2000):
            if skips.skipped.get("stuck", 0) >= 5:
                break
            await asyncio.sleep(0.01)
        release.set()
        scheduler.shutdown(wait=False)

    asyncio.run(main())
    assert skips.skipped["stuck"] >= 5
    out = term.getvalue()
    assert "maximum number of running instances" not in out
    assert out.count('"event": "job_skipped"') == 1 and '"job": "stuck"' in out
    logging.getLogger("apscheduler.scheduler.soakd").warning("another of APScheduler's lines")
    assert "another of APScheduler's lines" in term.getvalue()  # only the skip line is dropped


def test_jobs_cancelled_by_the_shutdown_end_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """A job running when the scheduler shuts down (the checkpoint in its worker thread, at the stop)
    and one due in the same loop turn (its task cancelled before it began) end without an error line,
    a traceback or a failed-job count."""
    failed: list[object] = []
    started: list[str] = []

    async def main() -> None:
        held = asyncio.Event()

        async def checkpoint() -> None:
            started.append("checkpoint")
            await asyncio.to_thread(held.is_set)
            await held.wait()  # still running at the shutdown
            started.append("checkpoint done")

        async def due_now() -> None:
            started.append("due_now")

        scheduler = jobs_module.make_scheduler()
        scheduler.add_listener(failed.append, EVENT_JOB_ERROR)
        scheduler.add_job(jobs_module.ending_quietly(checkpoint), "interval", seconds=0.02, id="checkpoint")
        scheduler.start()
        for _ in range(500):
            if started:
                break
            await asyncio.sleep(0.01)
        # Due at once, its task made now and cancelled by the shutdown before its first step.
        scheduler.add_job(jobs_module.ending_quietly(due_now), "date", id="due_now")
        scheduler.shutdown(wait=False)
        for _ in range(5):
            await asyncio.sleep(0)

    caplog.set_level(logging.DEBUG)
    with capture_logs() as said:
        asyncio.run(main())
    assert "checkpoint" in started
    assert failed == []
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert errors == [], [(r.name, r.getMessage()) for r in errors]
    assert [e for e in said if e["log_level"] in ("warning", "error", "critical")] == []
    assert "checkpoint done" not in started  # cancelled while it ran
    assert "due_now" not in started  # cancelled before it began
