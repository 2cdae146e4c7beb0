"""sd_notify from a whole soak, read from a real AF_UNIX datagram socket standing in for systemd's
NOTIFY_SOCKET: READY=1, WATCHDOG=1 stopping while the main loop hangs, STOPPING=1 and
EXTEND_TIMEOUT_USEC on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from soakd.app import Soak
from soakd.collectors.engine import EngineCollector
from soakd.config import Config
from soakd.testing import StubEngine, stub_config


class NotifySocket:
    """A bound datagram socket and a thread that keeps (monotonic time, message) for each datagram."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.got: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv, daemon=True)
        self._thread.start()

    def _recv(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.got.append((time.monotonic(), data.decode()))

    def times(self, message: str) -> list[float]:
        return [t for t, m in self.got if message in m.split("\n")]

    def mark(self, name: str) -> None:
        """Send a marker datagram of the test's own: datagrams are read in the order they were sent, so
        what was sent before and after it is told apart however late the reader thread runs."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(f"MARK={name}".encode(), str(self.path))

    def count_between(self, message: str, first: str, second: str) -> tuple[int, int, int]:
        """How many `message` datagrams came before marker `first`, between it and `second`, after it."""
        counts = [0, 0, 0]
        part = 0
        for _, m in self.got:
            if m in (f"MARK={first}", f"MARK={second}"):
                part += 1
            elif message in m.split("\n"):
                counts[part] += 1
        return counts[0], counts[1], counts[2]

    def wait_for_mark(self, name: str, timeout_s: float = 60.0) -> None:
        """Every datagram sent before marker `name` has been read (a hang guard of `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not any(m == f"MARK={name}" for _, m in self.got):
            assert time.monotonic() < deadline, f"marker {name} never read"
            time.sleep(0.01)  # poll interval

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    s = NotifySocket(tmp_path / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", str(s.path))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # a ping every 0.2 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield s
    s.close()


def _factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
    return StubEngine(collector)


def after_ready(notify_socket: NotifySocket, delay_s: float, fn: Callable[[], object]) -> None:
    """Call `fn` on the running loop `delay_s` after the soak has sent READY=1."""
    loop = asyncio.get_running_loop()

    def check() -> None:
        if notify_socket.times("READY=1"):
            loop.call_later(delay_s, fn)
        else:
            loop.call_later(0.05, check)

    loop.call_soon(check)


def _soak(tmp_path: Path, duration: str) -> Soak:
    cfg = stub_config(tmp_path, **{"run.duration": duration, "telemetry.interval": "0.2s"})
    return Soak(cfg, engine_factory=_factory)


async def test_watchdog_pings_stop_while_the_main_loop_hangs(
    tmp_path: Path, notify_socket: NotifySocket
) -> None:
    soak = _soak(tmp_path, "5s")
    hang: list[float] = []

    def block() -> None:
        notify_socket.mark("hang")
        hang.append(time.monotonic())
        time.sleep(1.5)  # the event loop is wedged: no job, no ping can run
        hang.append(time.monotonic())
        notify_socket.mark("free")

    after_ready(notify_socket, 1.0, block)
    await asyncio.wait_for(soak.run(), 60)
    notify_socket.mark("end")
    notify_socket.wait_for_mark("end")
    # In the order sent: pings before the hang, none while the loop was wedged, pings again after it.
    before, during, after = notify_socket.count_between("WATCHDOG=1", "hang", "free")
    assert before >= 3 and after >= 3, (before, during, after, hang)
    assert during == 0


async def test_no_ping_while_collection_has_stalled(tmp_path: Path, notify_socket: NotifySocket) -> None:
    soak = _soak(tmp_path, "5s")
    loop = asyncio.get_running_loop()
    stalled: list[float] = []

    def pause() -> None:
        # The loop keeps running; only the collection cycle stops (a wedged collector job).
        assert soak.jobs is not None
        soak.jobs.scheduler.pause_job("collect")
        stalled.append(time.monotonic())
        # Unhealthy once no cycle ran for 1.5 ping intervals (0.3 s), or 3 collection intervals (0.6 s):
        # from 0.9 s on (or later, on a late loop) no ping is sent.
        loop.call_later(0.9, notify_socket.mark, "stale")
        loop.call_later(1.5, unpause)

    def unpause() -> None:
        assert soak.jobs is not None
        notify_socket.mark("resumed")
        soak.jobs.scheduler.resume_job("collect")
        stalled.append(time.monotonic())

    after_ready(notify_socket, 1.0, pause)
    assert soak.healthy()[0]
    await asyncio.wait_for(soak.run(), 60)
    notify_socket.mark("end")
    notify_socket.wait_for_mark("end")
    before, during, after = notify_socket.count_between("WATCHDOG=1", "stale", "resumed")
    assert before and after and during == 0, (stalled, notify_socket.got)


async def test_sigterm_says_stopping_extends_the_timeout_and_drains(
    tmp_path: Path, notify_socket: NotifySocket
) -> None:
    soak = Soak(stub_config(tmp_path, **{"run.duration": "60s"}), engine_factory=_factory)
    loop = asyncio.get_running_loop()

    after_ready(notify_socket, 1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        result = await asyncio.wait_for(soak.run(), 60)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    assert result.stopped_by == "SIGTERM"
    notify_socket.mark("end")
    notify_socket.wait_for_mark("end")  # every datagram the soak sent has been read
    messages = [m for _, m in notify_socket.got if m != "MARK=end"]
    stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m)
    assert "SIGTERM" in messages[stopping]
    assert any(m == "EXTEND_TIMEOUT_USEC=30000000" for m in messages[stopping:])
    # An operator's stop is judged on the work done: the stub engine's requests meet the criteria.
    assert messages[-1] == "STATUS=done: PASS"
    # Nothing in flight was left: every request that came due has its record.
    assert result.summary["replay"]["scheduled"] == result.verdict.requests.scheduled > 0
