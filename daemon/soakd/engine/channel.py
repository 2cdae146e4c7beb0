"""The receiving end of the stat-logger plugin: a Unix stream socket soakd owns for a server it launched.

Each line is one engine step (or the plugin's hello with the engine's facts). Lost steps are not
guessed at: the plugin numbers its steps, and this side counts gaps in the numbering, per connection
(a restarted server connects again and starts again at 1).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from soakd.engine.stats import RecordCost, StepStats, step_from_wire

log = structlog.get_logger(__name__)

StepSink = Callable[[StepStats], None]
_LINE_LIMIT = 1 << 20
SOCKET_ENV = "SOAKD_STATS_SOCKET"
"""Names the socket in the server's environment; the plugin stays silent without it."""


@dataclass(slots=True)
class ChannelStats:
    """What came over the channel."""

    steps: int = 0
    """Steps received."""
    lost: int = 0
    """Steps the plugin numbered but soakd never received (its buffer full while soakd did not read)."""
    malformed: int = 0
    """Datagrams that could not be decoded."""
    cost: RecordCost = field(default_factory=RecordCost)
    """Time the plugin's record() took, per step it reported."""
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
        self._server: asyncio.AbstractServer | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self.stats = ChannelStats()
        self.hello = asyncio.Event()

    async def open(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=_LINE_LIMIT)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One server process's connection: its lines, in order, until it closes."""
        task = asyncio.current_task()
        if task is not None:
            self._readers.add(task)
        last = [0]
        try:
            while line := await reader.readline():
                self.receive(line, last)
        except (ConnectionError, ValueError) as err:  # ValueError: a line over the limit
            log.warning("step_channel_error", error=str(err))
        finally:
            writer.close()
            if task is not None:
                self._readers.discard(task)

    def receive(self, data: bytes, last: list[int]) -> None:
        """Decode one line; `last` holds the connection's last sequence number. A bad line is counted,
        never raised into the event loop."""
        st = self.stats
        try:
            msg = json.loads(data)
            if not isinstance(msg, dict):
                raise ValueError("not an object")
            if "hello" in msg:
                hello = msg["hello"]
                st.hellos.append(hello if isinstance(hello, dict) else {})
                self.hello.set()
                return
            step = step_from_wire(msg["s"])
            seq = int(msg["q"])
            cost = int(msg.get("c", 0))
        except (ValueError, KeyError, TypeError):
            st.malformed += 1
            return
        step.time_ns = self._clock_ns()
        if seq > last[0] + 1:
            st.lost += seq - last[0] - 1
        last[0] = max(last[0], seq)
        st.steps += 1
        if cost > 0:
            st.cost.add(cost)
        self._sink(step)

    def facts(self) -> dict[str, object]:
        """The newest server's engine facts (empty before its hello)."""
        return self.stats.hellos[-1] if self.stats.hellos else {}

    def summary(self) -> dict[str, object]:
        st = self.stats
        cost = st.cost.summary()
        return {
            "steps": st.steps,
            "lost": st.lost,
            "malformed": st.malformed,
            "record_us_mean": cost["record_us_mean"],
            "record_us_max": cost["record_us_max"],
        }

    async def aclose(self) -> None:
        """Stop listening, end the connections' readers and remove the socket's folder."""
        if self._server is not None:
            self._server.close()
            self._server = None
        readers = list(self._readers)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        shutil.rmtree(self._dir, ignore_errors=True)
