"""The receiving end of the stat-logger plugin: a Unix datagram socket soakd owns for a server it launched.

Each datagram is one engine step (or the plugin's hello with the engine's facts). Lost steps are not
guessed at: the plugin numbers its datagrams and counts the ones it could not send, and this side
counts gaps in the numbering, per sending process (a restarted server starts again at 1).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from soakd.engine.stats import StepStats, step_from_wire

log = structlog.get_logger(__name__)

StepSink = Callable[[StepStats], None]
SOCKET_ENV = "SOAKD_STATS_SOCKET"
"""Names the socket in the server's environment; the plugin stays silent without it."""
_RCVBUF = 4 * 1024 * 1024  # bursts of short steps must not overflow the socket while the loop is busy


@dataclass(slots=True)
class ChannelStats:
    """What came over the channel."""

    steps: int = 0
    """Steps received."""
    lost: int = 0
    """Steps the plugin numbered but soakd never received (socket full, soakd slow)."""
    malformed: int = 0
    """Datagrams that could not be decoded."""
    record_ns_sum: int = 0
    """Total time the plugin's record() took, over the steps it reported."""
    record_ns_max: int = 0
    record_n: int = 0
    hellos: list[dict[str, object]] = field(default_factory=list)
    """The engine facts each server process sent at start (newest last)."""


class StepChannel:
    """Binds a socket in a private temporary folder and feeds decoded steps to `sink`."""

    def __init__(self, sink: StepSink, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._sink = sink
        self._clock_ns = clock_ns
        self._dir = Path(tempfile.mkdtemp(prefix="soakd-"))
        # Unix socket paths are limited to ~107 bytes: a short private folder under the temp dir.
        self.path = str(self._dir / "steps.sock")
        self._transport: asyncio.DatagramTransport | None = None
        self._last_seq: dict[int, int] = {}
        self.stats = ChannelStats()
        self.hello = asyncio.Event()

    async def open(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        sock.bind(self.path)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self), sock=sock)
        self._transport = transport

    def receive(self, data: bytes) -> None:
        """Decode one datagram; a bad one is counted, never raised into the event loop."""
        st = self.stats
        try:
            msg = json.loads(data)
            if not isinstance(msg, dict):
                raise ValueError("not an object")
            pid = int(msg.get("pid", 0))
            if "hello" in msg:
                hello = msg["hello"]
                st.hellos.append(hello if isinstance(hello, dict) else {})
                self._last_seq[pid] = 0
                self.hello.set()
                return
            step = step_from_wire(msg["s"])
            seq = int(msg["q"])
            cost = int(msg.get("c", 0))
        except (ValueError, KeyError, TypeError):
            st.malformed += 1
            return
        step.time_ns = self._clock_ns()
        last = self._last_seq.get(pid, 0)
        if seq > last + 1:
            st.lost += seq - last - 1
        self._last_seq[pid] = max(last, seq)
        st.steps += 1
        if cost > 0:
            st.record_ns_sum += cost
            st.record_n += 1
            st.record_ns_max = max(st.record_ns_max, cost)
        self._sink(step)

    def facts(self) -> dict[str, object]:
        """The newest server's engine facts (empty before its hello)."""
        return self.stats.hellos[-1] if self.stats.hellos else {}

    def summary(self) -> dict[str, object]:
        st = self.stats
        return {
            "steps": st.steps,
            "lost": st.lost,
            "malformed": st.malformed,
            "record_us_mean": st.record_ns_sum / st.record_n / 1e3 if st.record_n else None,
            "record_us_max": st.record_ns_max / 1e3 if st.record_n else None,
        }

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        shutil.rmtree(self._dir, ignore_errors=True)


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, channel: StepChannel) -> None:
        self._channel = channel

    def datagram_received(self, data: bytes, addr: object) -> None:
        self._channel.receive(data)

    def error_received(self, exc: Exception) -> None:
        log.warning("step_channel_error", error=str(exc))
