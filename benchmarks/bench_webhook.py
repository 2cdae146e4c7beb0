"""Webhook sink catch-up: how fast it reads a spool backlog for alerts, and how long it holds the loop.

Run by hand:  .venv/bin/python benchmarks/bench_webhook.py [--lines 1000000] [--json]

1. A spool of `--lines` realistic lines (bench_backfill.build_spool: the H200 runs' points in
   tests/data/h200, their real events included, repeated with shifted times).
2. A receiver on loopback (aiohttp, in this process) accepting every POST.
3. From a fresh cursor, `WebhookSink.drain()` with the default [sinks.webhook] settings reads the whole
   backlog (a receiver down since the start of an 8 h run, then back). Reported: lines/s, alerts and
   POSTs, and the event loop's lag seen by a 10 ms probe task: the longest the sink held the loop.
4. The app's job emulated from a fresh cursor: `tick(0.8 * interval)` every `interval` (2 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from soakd.config import WebhookConfig
from soakd.logs import configure as configure_logs
from soakd.sinks.webhook import STATE_FILE, WebhookSink, make_sender

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backfill import build_spool


class LagProbe:
    """Wakes every 10 ms and records how late it woke: what any other task would have waited."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.01
            await asyncio.sleep(0.01)
            self.lags.append(max(0.0, loop.time() - due))

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> dict[str, float]:
        lags = sorted(self.lags) or [0.0]
        return {
            "max_ms": round(1000 * lags[-1], 1),
            "p99_ms": round(1000 * lags[int(0.99 * (len(lags) - 1))], 1),
        }


async def measure(spool_dir: Path) -> dict[str, Any]:
    received = {"posts": 0, "alerts": 0}

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        received["posts"] += 1
        received["alerts"] += len(body)
        return web.Response()

    app = web.Application()
    app.router.add_post("/api/v2/alerts", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = WebhookConfig(enabled=True, url=f"http://127.0.0.1:{port}/api/v2/alerts")
    out: dict[str, Any] = {"batch_lines": cfg.batch_lines}
    try:
        sink = WebhookSink(spool_dir, make_sender(cfg, {}), cfg)
        backlog = sink.forwarder.backlog_lines()
        with LagProbe() as probe:
            t0 = time.perf_counter()
            done = await sink.drain(600.0)
            took = time.perf_counter() - t0
        out["drain"] = {
            "caught_up": done,
            "lines": backlog,
            "s": round(took, 2),
            "lines_per_s": round(backlog / took),
            "alerts": sink.counters.alerts_sent,
            "posts": sink.counters.posts,
            "loop_lag": probe.summary(),
        }
        await sink.aclose()
        out["received"] = dict(received)

        (spool_dir / STATE_FILE).unlink()
        sink = WebhookSink(spool_dir, make_sender(cfg, {}), cfg)
        ticks = 0
        with LagProbe() as probe:
            t0 = time.perf_counter()
            while sink.forwarder.backlog_lines() > 0:
                start = time.perf_counter()
                await sink.tick(0.8 * cfg.interval)
                ticks += 1
                await asyncio.sleep(max(0.0, cfg.interval - (time.perf_counter() - start)))
            took = time.perf_counter() - t0
        out["job"] = {
            "interval_s": cfg.interval,
            "ticks": ticks,
            "s": round(took, 2),
            "lines_per_s": round(backlog / took),
            "loop_lag": probe.summary(),
        }
        await sink.aclose()
    finally:
        await runner.cleanup()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure_logs(level="warning")
    root = Path(tempfile.mkdtemp(prefix="bench-webhook-"))
    try:
        spool = build_spool(root / "spool", args.lines)
        result = {"spool": spool, **asyncio.run(measure(root / "spool"))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    d, j = result["drain"], result["job"]
    print(f"spool: {spool['lines']} lines, {spool['bytes'] / 1e6:.0f} MB, {spool['segments']} segments")
    print(
        f"drain: {d['lines_per_s']:,} lines/s ({d['s']} s), {d['alerts']} alerts in {d['posts']} POSTs, "
        f"loop lag max {d['loop_lag']['max_ms']} ms, p99 {d['loop_lag']['p99_ms']} ms"
    )
    print(
        f"job:   {j['lines_per_s']:,} lines/s ({j['ticks']} ticks of {j['interval_s']} s), "
        f"loop lag max {j['loop_lag']['max_ms']} ms, p99 {j['loop_lag']['p99_ms']} ms"
    )


if __name__ == "__main__":
    main()
