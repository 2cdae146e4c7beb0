"""The sinks as lifecycle parts: their final drains at a run's end, and their summary.json entries.

Started first and stopped last (after the verdict is written to the spool): the webhook drains first
(the verdict reaches the on-call in seconds), then InfluxDB, then the spool closes. A drain that fails
or runs out of time leaves the lines in the spool, said in the summary and the log.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog

from soakd.notify import notify
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.spool import Spool
from soakd.sinks.webhook import WebhookSink

log = structlog.get_logger(__name__)

# A drain is bounded by its own timeout; this is the margin for closing the connection after it.
_CLOSE_MARGIN_S = 30.0


class SpoolPart:
    name = "spool"
    stop_timeout_s = _CLOSE_MARGIN_S

    def __init__(self, spool: Spool) -> None:
        self.spool = spool

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self.spool.close()

    def summary(self) -> Mapping[str, Any]:
        spool = self.spool
        return {
            "spool": {
                "lines": spool.lines_written,
                "bytes": spool.bytes_written,
                "segments": spool.segments_created,
                "fsyncs": spool.fsyncs,
                "total_bytes": spool.total_bytes,
                "state": spool.state,
                "dropped": dict(sorted(spool.dropped.items())),
            }
        }


class ForwarderPart:
    """InfluxDB: shipped before the spool closes, so outage/backfill events of the last stretch are kept."""

    name = "influx"

    def __init__(self, forwarder: Forwarder, drain_timeout_s: float) -> None:
        self.forwarder = forwarder
        self._drain_timeout_s = drain_timeout_s
        self.stop_timeout_s = drain_timeout_s + _CLOSE_MARGIN_S
        self.all_shipped = True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        notify("STATUS=shipping spool to InfluxDB")
        self.all_shipped = False  # until the drain says so (a stop cut at its timeout shipped not all)
        try:
            self.all_shipped = await self.forwarder.drain(self._drain_timeout_s)
        finally:
            if not self.all_shipped:
                log.error(
                    "influx_backlog_left",
                    lines=self.forwarder.backlog_lines(),
                    hint="the spool keeps them; ship them later with `soakd report RUN --ship`",
                )
            await self.forwarder.writer.aclose()

    def summary(self) -> Mapping[str, Any]:
        fwd = self.forwarder
        return {
            "influx": {
                "lines_shipped": fwd.lines_shipped,
                "lines_rejected": fwd.lines_rejected,
                "failures": fwd.failures,
                "backlog_lines": fwd.backlog_lines(),
                "all_shipped": self.all_shipped,
            }
        }


class WebhookPart:
    """The alert webhook: the verdict and the episodes the end resolved, delivered first."""

    name = "webhook"

    def __init__(self, webhook: WebhookSink, drain_timeout_s: float) -> None:
        self.webhook = webhook
        self._drain_timeout_s = drain_timeout_s
        self.stop_timeout_s = drain_timeout_s + _CLOSE_MARGIN_S
        self.all_delivered = True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        notify("STATUS=sending the last alerts")
        self.all_delivered = False
        try:
            self.all_delivered = await self.webhook.drain(self._drain_timeout_s)
        finally:
            await self.webhook.aclose()

    def summary(self) -> Mapping[str, Any]:
        return {"webhook": {**self.webhook.summary(), "all_delivered": self.all_delivered}}
