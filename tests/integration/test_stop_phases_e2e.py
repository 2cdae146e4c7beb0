"""Every stop signal in every phase of a real `soakd run`: SIGINT, SIGTERM and SIGHUP (a closed terminal or
ssh session) each stop it promptly, exit 4, with a verdict that names the signal and the phase it came in,
and no request counted twice.

The phases, each reached by a stand-in engine (soakd.testing's stub, slowed where the phase must last) or,
for the engine start, by attach mode against a port where no server listens yet:
setup (the config being read), engine_start (the wait for the attached server to be ready), warmup,
replay, drain (the duration is over, requests still in flight), verdict (the engine stopping). Each run
is waited on by the JSON log lines on its stderr (`run_phase`, `engine_waiting`), never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from soakd.judge.verdict import verdict_lines
from soakd.rundir import JOURNAL_FILE
from soakd.sinks.spool import iter_samples
from soakd.testing import PEAK_RSS_LIMIT_MB, PeakRss, measured

pytestmark = pytest.mark.integration

# `soakd run` with the stub engine of soakd.testing, slowed per phase (argv[1]): the warm-up's requests
# never end ("warmup"), steps of 0.3 s so that requests are in flight at the duration's end ("drain"), an
# engine stop that takes 2 s ("verdict"), requests that never end ("hang"). "setup" signals soakd itself
# while its config is read. argv[2:] is `soakd`'s own.
_SOAK = """
import asyncio, os, signal, sys
from soakd import app, cli, config, testing

mode = sys.argv[1]


class Engine(testing.StubEngine):
    async def generate(self, request):
        if mode == "hang" or (mode == "warmup" and request.request_id.split("-")[0].endswith("w")):
            await asyncio.sleep(3600)
        async for n in super().generate(request):
            if mode in ("drain", "replay"):
                await asyncio.sleep(0.3)
            yield n

    async def stop(self):
        if mode == "verdict":
            await asyncio.sleep(2.0)
        await super().stop()


if mode == "setup":
    load = config.load

    def load_signalled(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, os.environ["SOAKD_TEST_SIGNAL"]))
        return load(*args, **kwargs)

    config.load = load_signalled
if mode != "engine_start":  # that one attaches to a server (engine.kind = "openai")
    app.make_engine = lambda cfg, model, collector, log_dir=None: Engine(collector)
sys.exit(cli.main(sys.argv[2:]))
"""

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
PHASES = ("setup", "engine_start", "warmup", "replay", "drain", "verdict")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp_path: Path, phase: str) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.safetensors").write_text("")
    duration = {"drain": "2s", "verdict": "1s"}.get(phase, "60s")
    if phase == "engine_start":
        # Attach mode against a port nobody listens on: soakd waits up to start_timeout for it.
        engine = f'kind = "openai"\nurl = "http://127.0.0.1:{_free_port()}"\nstart_timeout = "300s"'
    else:
        engine = f'model = "{model}"'
    path = tmp_path / "soak.toml"
    path.write_text(
        f"""
[run]
duration = "{duration}"
output_dir = "{tmp_path / "runs"}"
report = false
[trace]
format = "synthetic"
[trace.arrivals]
rate_rps = 10.0
[trace.synthetic]
duration = "60s"
output_tokens_mean = 8
output_tokens_max = 16
[engine]
{engine}
[replay]
warmup_requests = {0 if phase == "hang" else 2}
drain_timeout = "300s"
[telemetry]
interval = "0.5s"
collectors = ["host"]
""",
        encoding="utf-8",
    )
    return path


class Soakd:
    """A `soakd run` in its own session, its stderr's JSON log lines read as they come."""

    def __init__(self, tmp_path: Path, mode: str, env: dict[str, str]) -> None:
        argv = ["run", "--config", str(_config(tmp_path, mode)), "--json", "--no-progress"]
        self.rss_file = tmp_path / "soakd.maxrss"
        self.proc = subprocess.Popen(
            measured([sys.executable, "-c", _SOAK, mode, *argv], self.rss_file),
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
        self.tmp_path = tmp_path
        self.events: list[dict[str, Any]] = []
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                self.events.append(doc)

    def saw(self, event: str, **fields: object) -> bool:
        return any(
            e.get("event") == event and all(e.get(k) == v for k, v in fields.items()) for e in self.events
        )

    def wait_for(self, pred: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            code = self.proc.poll()
            assert code is None, f"soakd exited ({code}) before {what}: {self.tail()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s: {self.tail()}"
            time.sleep(0.05)

    def signal(self, name: str) -> None:
        os.killpg(self.proc.pid, getattr(signal, name))

    def finish(self, timeout_s: float) -> tuple[int, dict[str, Any]]:
        assert self.proc.stdout is not None
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"soakd still running {timeout_s:.0f} s after the signal: {self.tail()}")
        out = self.proc.stdout.read()
        self._reader.join(timeout=10)
        return self.proc.returncode, json.loads(out)

    def peak_rss(self, case: str) -> float:
        """soakd's peak RSS in MB, once it has ended (noted for benchmarks/bench_hostile_rss.py)."""
        peak = PeakRss.read(self.rss_file)
        peak.note(case)
        return peak.mb

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self) -> str:
        return "".join(self.err[-20:])[-3000:]


@pytest.fixture
def soakd(tmp_path: Path) -> Iterator[Callable[[str, dict[str, str]], Soakd]]:
    started: list[Soakd] = []

    def start(mode: str, env: dict[str, str]) -> Soakd:
        s = Soakd(tmp_path, mode, env)
        started.append(s)
        return s

    yield start
    for s in started:  # by its pid (its own process group), never by name
        s.kill()


def _reach(s: Soakd, phase: str) -> None:
    if phase == "setup":
        return  # it signals itself while its config is read
    if phase == "engine_start":
        s.wait_for(lambda: s.saw("engine_waiting"), "the wait for the attached server")
    else:
        s.wait_for(lambda: s.saw("run_phase", phase=phase), f"phase {phase}")
    if phase == "replay":
        s.wait_for(lambda: _due(s.tmp_path) >= 1, "a request sent")


def _requests_once(run_dir: Path, doc: dict[str, Any]) -> int:
    """Every request recorded and journalled at most once; returns how many were recorded."""
    keys = Counter(
        (s.fields["loop"], s.fields["index"], s.fields.get("copy", 0), s.fields["turn"])
        for s in iter_samples(run_dir / "spool", "requests")
    )
    twice = [k for k, n in keys.items() if n > 1]
    assert not twice, f"recorded more than once: {twice[:5]}"
    journal = run_dir / JOURNAL_FILE
    due = [ln.split()[:3] for ln in journal.read_text().splitlines() if ln] if journal.exists() else []
    assert len(due) == len({tuple(d) for d in due}), "a request journalled twice"
    recorded = sum(keys.values())
    req = doc["requests"]
    assert recorded == req["completed"] + req["failed"] + req["shed"] + req["incomplete"], (recorded, req)
    return recorded


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("signame", SIGNALS)
def test_a_stop_signal_in_any_phase_stops_with_its_verdict(
    soakd: Callable[[str, dict[str, str]], Soakd], signame: str, phase: str
) -> None:
    s = soakd(phase, {"SOAKD_TEST_SIGNAL": signame})
    _reach(s, phase)
    if phase != "setup":
        s.signal(signame)
    t0 = time.monotonic()
    code, doc = s.finish(timeout_s=60)
    took_s = time.monotonic() - t0
    assert code == 4, s.tail()
    # Prompt: no wait for the attached server's start_timeout, the hanging warm-up or a drain timeout.
    assert took_s < 20, f"the stop took {took_s:.1f} s"
    run_dir = Path(doc["run_dir"])
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["exit_code"] == 4 and verdict["stopped_early"] is True, verdict
    assert verdict["stopped_by"] == signame and verdict["stopped_in"] == phase, verdict
    assert doc["stopped_by"] == signame and doc["stopped_in"] == phase and doc["exit_code"] == 4
    began = phase in ("replay", "drain", "verdict")
    assert verdict["replay_began"] is began, verdict
    recorded = _requests_once(run_dir, doc)
    assert (recorded > 0) is began
    if phase in ("replay", "drain"):
        # The first signal drains: whatever was in flight finished, none aborted.
        assert doc["requests"]["failed"] == 0, doc["requests"]
    assert f"by {signame} in {phase}" in "\n".join(verdict_lines(verdict))
    assert s.peak_rss(f"signal/{signame}/{phase}") < PEAK_RSS_LIMIT_MB


def test_a_second_signal_ends_the_drain_and_the_verdict_is_still_written(
    soakd: Callable[[str, dict[str, str]], Soakd],
) -> None:
    # Requests that never end: the first SIGTERM's drain would wait for replay.drain_timeout (300 s).
    s = soakd("hang", {})
    s.wait_for(lambda: s.saw("run_phase", phase="replay"), "the replay")
    s.wait_for(lambda: _due(s.tmp_path) >= 3, "requests in flight")
    s.signal("SIGTERM")
    s.wait_for(lambda: s.saw("signal_received", signal="SIGTERM"), "the first signal")
    s.signal("SIGHUP")
    code, doc = s.finish(timeout_s=30)
    assert code == 4, s.tail()
    assert s.saw("replay_aborted")
    run_dir = Path(doc["run_dir"])
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["stopped_by"] == "SIGTERM" and verdict["stopped_in"] == "replay", verdict
    recorded = _requests_once(run_dir, doc)
    # Every request sent was aborted by the second signal and recorded once: left unfinished by the stop
    # (`incomplete`), not failed by the engine.
    req = doc["requests"]
    assert recorded > 0 and req["incomplete"] == recorded and req["failed"] == req["completed"] == 0
    assert s.peak_rss("signal/second-in-drain") < PEAK_RSS_LIMIT_MB


def _due(tmp_path: Path) -> int:
    """Requests that came due (and were sent) so far: the run's journal lines."""
    return sum(len(p.read_bytes().splitlines()) for p in (tmp_path / "runs").glob(f"*/{JOURNAL_FILE}"))
