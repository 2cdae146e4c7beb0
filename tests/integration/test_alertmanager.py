"""The webhook sink against a real Alertmanager (Debian's 0.25): the alerts soakd POSTs are accepted,
fire, resolve by endsAt, and come out of Alertmanager's own webhook receiver in the very shape of
soakd's "webhook" format, fingerprints included."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from servers import ALERTMANAGER, binary_available, free_port, start_alertmanager

from soakd.config import WebhookConfig
from soakd.sinks.spool import Spool
from soakd.sinks.webhook import Alert, WebhookSink, make_sender
from soakd.sinks.writer import SampleWriter

pytestmark = pytest.mark.integration


class Hook:
    """Alertmanager's webhook receiver: an aiohttp server on loopback keeping each notification."""

    def __init__(self) -> None:
        self.port = free_port()
        self.notifications: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.notifications.append(await request.json())
        return web.Response()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def hook() -> AsyncIterator[Hook]:
    server = Hook()
    await server.start()
    yield server
    await server.stop()


async def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)  # poll interval


async def test_a_real_alertmanager_fires_resolves_and_notifies_in_the_webhook_format(
    tmp_path: Path, hook: Hook
) -> None:
    if not binary_available(ALERTMANAGER):
        if os.environ.get("SOAKD_REQUIRE_SERVERS") == "1":
            pytest.fail(f"SOAKD_REQUIRE_SERVERS=1 but {ALERTMANAGER} not found", pytrace=False)
        pytest.skip(f"{ALERTMANAGER} not found (apt-get install prometheus-alertmanager)")
    am = await asyncio.to_thread(start_alertmanager, tmp_path / "am", f"http://127.0.0.1:{hook.port}/hook")
    try:
        spool = Spool(tmp_path / "spool", segment_bytes=1 << 16, fsync_interval_s=1.0)
        writer = SampleWriter(spool, {"run_id": "20261130T000000Z-soak-abcd", "host": "h200-a"})
        cfg = WebhookConfig(
            enabled=True, url=am.url + "/api/v2/alerts", external_url="http://grafana:3000/d/soak"
        )
        sink = WebhookSink(spool.directory, make_sender(cfg, {}), cfg)
        as_webhook = make_sender(cfg.model_copy(update={"format": "webhook"}), {})
        writer.event("throttle_enter", "GPU 0: ok -> throttled (power cap)", gpu=0, reasons="sw_power_cap")
        await sink.tick(5.0)
        (ours,) = sink.book.open.values()
        await _until(lambda: len(hook.notifications) == 1)
        async with httpx.AsyncClient() as client:
            (active,) = (await client.get(am.url + "/api/v2/alerts")).json()
            assert active["labels"] == ours.labels and active["status"]["state"] == "active"
            assert active["fingerprint"] == ours.fingerprint and active["generatorURL"] == cfg.external_url

            writer.event("throttle_leave", "GPU 0: recovering -> ok", gpu=0)
            await sink.tick(5.0)
            await _until(lambda: len(hook.notifications) == 2)
            assert (await client.get(am.url + "/api/v2/alerts")).json() == []  # resolved: no longer listed
        await sink.aclose()
        await as_webhook.aclose()

        fired, resolved = hook.notifications
        assert (fired["status"], resolved["status"]) == ("firing", "resolved")
        ended = Alert(ours.labels, resolved["alerts"][0]["annotations"], ours.starts_ns, ours.starts_ns + 1)
        # What Alertmanager sent its receiver, and what soakd sends one directly, key for key.
        for notification, alert in ((fired, ours), (resolved, ended)):
            mine = json.loads(as_webhook.payloads([alert])[0])
            assert set(mine) == set(notification)
            assert set(mine["alerts"][0]) == set(notification["alerts"][0])
            for key in ("status", "labels", "annotations", "startsAt", "fingerprint", "generatorURL"):
                assert mine["alerts"][0][key] == notification["alerts"][0][key], key
            assert mine["commonLabels"] == notification["commonLabels"]
        assert resolved["alerts"][0]["endsAt"] > resolved["alerts"][0]["startsAt"]
    finally:
        am.stop()
