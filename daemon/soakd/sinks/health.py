"""The sinks' own health as series: the `spool` point (size, state, drops) and the `sink` point (backlog,
outage, shipping counters), one each per collector run.

Both measurements are in the spool's ESSENTIAL_MEASUREMENTS, so they are still written while the spool
is degraded to essential data only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from soakd.metric import Sample

if TYPE_CHECKING:  # the forwarder pulls in the HTTP clients; only its type is needed here
    from soakd.sinks.forwarder import Forwarder
    from soakd.sinks.spool import Spool


class SpoolHealth:
    """Collector `spool`: bytes, segments, state (code and name), free bytes, lines dropped (in total and
    per measurement as `dropped_<measurement>`)."""

    name = "spool"

    def __init__(self, spool: Spool) -> None:
        self._spool = spool

    def collect(self, now_ns: int) -> list[Sample]:
        return [Sample("spool", self._spool.series_fields(), now_ns)]

    def close(self) -> None:
        return None


class SinkHealth:
    """Collector `sink`: the forwarder's backlog (lines, bytes, age of the oldest unshipped line),
    outage length and shipping counters."""

    name = "sink"

    def __init__(self, forwarder: Forwarder) -> None:
        self._forwarder = forwarder

    def collect(self, now_ns: int) -> list[Sample]:
        return [Sample("sink", self._forwarder.series_fields(now_ns), now_ns)]

    def close(self) -> None:
        return None
