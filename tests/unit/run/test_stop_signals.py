"""The one stop-signal handler of `soakd run` (soakd.stopsignals): a signal before the run's loop is kept
and the run begins stopped, one during the loop goes to the run, one after it is kept and cuts the
report short; and the phase in the verdict, readable in files written before it existed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from soakd.app import Soak
from soakd.collectors.engine import EngineCollector
from soakd.config import Config
from soakd.engine.base import GenerationRequest
from soakd.judge.verdict import stop_note
from soakd.stopsignals import StopSignals
from soakd.testing import StubEngine
from soakd.testing import stub_config as config


@pytest.fixture
def signals() -> Iterator[StopSignals]:
    s = StopSignals()
    s.install()
    try:
        yield s
    finally:
        s.restore()


def _factory(engines: list[StubEngine]) -> object:
    def factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
        engines.append(StubEngine(collector))
        return engines[-1]

    return factory


def test_a_signal_before_the_loop_is_kept_not_a_death(signals: StopSignals) -> None:
    os.kill(os.getpid(), signal.SIGHUP)
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.received == ["SIGHUP", "SIGTERM"] and signals.late == []


async def test_a_signal_during_the_setup_stops_the_run_with_its_phase(
    tmp_path: Path, signals: StopSignals
) -> None:
    engines: list[StubEngine] = []
    os.kill(os.getpid(), signal.SIGHUP)  # while the config and the trace were read
    soak = Soak(config(tmp_path), engine_factory=_factory(engines), signals=signals)  # type: ignore[arg-type]
    result = await asyncio.wait_for(soak.run(), 20)
    assert not any(e.started for e in engines)
    assert result.stopped_by == "SIGHUP" and result.verdict.exit_code == 4
    verdict = json.loads((result.run_dir / "verdict.json").read_text())
    assert verdict["stopped_in"] == "setup" and verdict["replay_began"] is False
    assert result.summary["stopped_in"] == "setup"
    assert json.loads((result.run_dir / "checkpoint.json").read_text())["stopped_by"] == "SIGHUP"


class SignalsInTheReplay(StubEngine):
    """Sends soakd SIGINT from its first request of the replay (not the warm-up's): one is in flight."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        if "--1-" not in request.request_id and not any("--1-" not in r for r in self.seen):
            os.kill(os.getpid(), signal.SIGINT)
        async for n in super().generate(request):
            yield n


async def test_a_signal_during_the_replay_goes_to_the_run_and_one_after_it_is_late(
    tmp_path: Path, signals: StopSignals
) -> None:
    def factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
        return SignalsInTheReplay(collector)

    soak = Soak(config(tmp_path, **{"run.duration": "30s"}), engine_factory=factory, signals=signals)
    result = await asyncio.wait_for(soak.run(), 30)
    assert result.stopped_by == "SIGINT" and result.verdict.ending.stopped_in == "replay"
    assert result.verdict.exit_code == 4 and result.verdict.ending.replay_began
    assert signals.late == []
    os.kill(os.getpid(), signal.SIGTERM)  # the run's loop is over: kept, never a default kill
    assert signals.late == ["SIGTERM"]
    with pytest.raises(KeyboardInterrupt), signals.reporting():
        os.kill(os.getpid(), signal.SIGTERM)


def test_the_stop_note_names_the_phase_and_reads_older_files() -> None:
    doc = {"stopped_early": True, "stopped_by": "SIGTERM", "ran_s": 30.0, "planned_s": 60.0}
    assert stop_note(doc) == "stopped early by SIGTERM at 30 s of 60 s: the verdict judges the work done"
    doc |= {"stopped_in": "drain"}
    assert stop_note(doc).startswith("stopped early by SIGTERM in drain at 30 s of 60 s")
    early = {
        "stopped_early": True,
        "stopped_by": "SIGHUP",
        "stopped_in": "engine_start",
        "replay_began": False,
    }
    assert (
        stop_note(early) == "stopped by SIGHUP in engine_start before the replay began: nothing was replayed"
    )


async def test_a_signal_reaches_the_run_in_the_context_it_attached_from(signals: StopSignals) -> None:
    """The run binds its log keys (run_id: journald's RUN_ID) in its own context; a signal lands in
    whatever context the main thread is in. The handler runs in the one `attach` was called from, so the
    `signal_received` line carries the run's keys (under systemd it was missing from `journalctl RUN_ID=`)."""
    import contextvars

    key: contextvars.ContextVar[str] = contextvars.ContextVar("key", default="none")
    seen: list[str] = []
    got = asyncio.Event()

    def on_signal(name: str) -> None:
        seen.append(f"{name}:{key.get()}")
        got.set()

    async def run() -> None:
        key.set("the run's")
        signals.attach(asyncio.get_running_loop(), on_signal)

    await asyncio.create_task(run())  # its own context, as asyncio.run gives the run
    assert key.get() == "none"
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(got.wait(), 10)
    signals.detach()
    assert seen == ["SIGTERM:the run's"]
