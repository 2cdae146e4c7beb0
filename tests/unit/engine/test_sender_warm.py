"""The sender process opens connections on request (the `warm` frame), against a stand-in HTTP server:
distinct connections, each answered; an unhealthy server opens none; a sender that is gone opens none and
waits for nothing."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from soakd.engine.sender import SenderProcess


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[str, set[int], list[int]]]:
    """A server whose GET /health answers `status[0]` and notes each connection's client port."""
    peers: set[int] = set()
    status = [200]

    async def health(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.add(request.transport.get_extra_info("peername")[1])
        await asyncio.sleep(0.05)  # held a moment: concurrent requests cannot share a connection
        return web.Response(status=status[0])

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", peers, status
    finally:
        await runner.cleanup()


async def test_warm_opens_distinct_connections(stand_in: tuple[str, set[int], list[int]]) -> None:
    url, peers, status = stand_in
    sender = SenderProcess(url, {}, 0)
    await sender.start()
    try:
        before = len(peers)  # the child's own first connection, made as it starts
        assert await sender.warm(6) == 6
        assert len(peers) - before >= 5  # its first connection may serve one of the six
        status[0] = 503
        assert await sender.warm(3) == 0  # answered, but not healthy: none counted
        pid = sender.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            if not sender.running:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(sender.warm(4), 1.0) == 0
    finally:
        await sender.stop()


async def test_a_sender_asked_for_a_lower_nice_value_reports_the_one_in_force(
    stand_in: tuple[str, set[int], list[int]],
) -> None:
    url, _, _ = stand_in
    own = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(own, 0) - 3
    sender = SenderProcess(url, {}, 0, nice=want)
    await sender.start()
    try:
        pid = sender.pid
        assert pid is not None
        assert sender.nice == os.getpriority(os.PRIO_PROCESS, pid)  # what it says is what the kernel has
        if sender.nice_error:  # unprivileged: refused, and said so, at soakd's own level
            assert sender.nice == own
        else:
            assert sender.nice == want
    finally:
        await sender.stop()


def test_a_refused_nice_value_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from soakd.engine import sender_child

    def refuse(which: int, who: int, value: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    nice, error = sender_child._renice(-10)
    assert nice == os.getpriority(os.PRIO_PROCESS, 0)
    assert "PermissionError" in error and "not permitted" in error
    assert sender_child._renice(0) == (os.getpriority(os.PRIO_PROCESS, 0), "")
