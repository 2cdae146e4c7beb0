"""The sink registry: every destination that ships from the spool (InfluxDB, the alert webhook).

A sink is one module plus one `register_sink` line here. Its `open` reads its secrets at start (a bad
credential is bad input: exit 2 before anything is written) and names the environment variables to
drop before the engine's processes inherit them; its `build` makes, for one run, the part that drains
it at the end, its health collector, and the periodic job that ships (most of one interval, so a
backlog after an outage drains at the receiver's pace without the job outliving its interval).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from soakd.config import Config
from soakd.lifecycle import Component
from soakd.rundir import SPOOL_DIR
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.health import SinkHealth
from soakd.sinks.influx import make_writer
from soakd.sinks.parts import ForwarderPart, WebhookPart
from soakd.sinks.webhook import WebhookHealth, WebhookSink, make_sender
from soakd.sinks.writer import SampleWriter

if TYPE_CHECKING:
    from soakd.collectors.base import Collector


@dataclass(frozen=True, slots=True)
class BuiltSink:
    name: str
    part: Component
    """Stopped after the verdict is in the spool: the final drain."""
    health: Collector
    tick: Callable[[float], Awaitable[None]]
    """One scheduler run: ship for up to the given seconds."""
    interval_s: float


@dataclass(frozen=True, slots=True)
class SinkSpec:
    name: str
    enabled: Callable[[Config], bool]
    secrets: Callable[[Config], Sequence[str]]
    """Environment variables that hold its secrets (dropped from the environment once read)."""
    open: Callable[[Config, Mapping[str, str]], Any]
    """Reads the secrets and returns the connection (sender, writer) `build` takes."""
    build: Callable[[Config, Path, SampleWriter, Any], BuiltSink]


SINKS: list[SinkSpec] = []


def register_sink(spec: SinkSpec) -> None:
    SINKS.append(spec)


@dataclass(frozen=True, slots=True)
class Opened:
    """The enabled sinks of a config, connected (secrets read), not yet bound to a run."""

    items: tuple[tuple[SinkSpec, Any], ...]

    def build(self, cfg: Config, run_dir: Path, writer: SampleWriter) -> list[BuiltSink]:
        return [spec.build(cfg, run_dir, writer, handle) for spec, handle in self.items]


def open_sinks(cfg: Config, env: Mapping[str, str]) -> tuple[Opened, list[str]]:
    """Every enabled sink opened with its secrets; and the names of the secret variables to drop."""
    items = tuple((spec, spec.open(cfg, env)) for spec in SINKS if spec.enabled(cfg))
    names = [name for spec in SINKS for name in spec.secrets(cfg)]
    return Opened(items), names


# -- InfluxDB ------------------------------------------------------------------------------------------


def _influx(cfg: Config, run_dir: Path, writer: SampleWriter, lines: Any) -> BuiltSink:
    icfg = cfg.sinks.influx

    def on_event(kind: str, fields: dict[str, float | int | str]) -> None:
        writer.event(kind, f"InfluxDB {kind.removeprefix('sink_')}", **fields)

    forwarder = Forwarder(run_dir / SPOOL_DIR, lines, icfg.batch_lines, on_event=on_event)

    async def tick(budget_s: float) -> None:
        deadline = time.monotonic() + budget_s
        while await forwarder.step() > 0 and time.monotonic() < deadline:
            pass

    part = ForwarderPart(forwarder, icfg.final_drain_timeout)
    return BuiltSink("influx", part, SinkHealth(forwarder), tick, icfg.interval)


register_sink(
    SinkSpec(
        "influx",
        enabled=lambda cfg: cfg.sinks.influx.enabled,
        secrets=lambda cfg: (cfg.sinks.influx.token_env, cfg.sinks.influx.password_env),
        open=lambda cfg, env: make_writer(cfg.sinks.influx, env),
        build=_influx,
    )
)


# -- the alert webhook ---------------------------------------------------------------------------------


def _webhook(cfg: Config, run_dir: Path, writer: SampleWriter, sender: Any) -> BuiltSink:
    wcfg = cfg.sinks.webhook

    def on_event(kind: str, fields: dict[str, float | int | str]) -> None:
        writer.event(kind, f"alert webhook {kind.removeprefix('webhook_')}", **fields)

    sink = WebhookSink(run_dir / SPOOL_DIR, sender, wcfg, on_event=on_event)
    part = WebhookPart(sink, wcfg.final_drain_timeout)
    return BuiltSink("webhook", part, WebhookHealth(sink), sink.tick, wcfg.interval)


register_sink(
    SinkSpec(
        "webhook",
        enabled=lambda cfg: cfg.sinks.webhook.enabled,
        secrets=lambda cfg: (cfg.sinks.webhook.token_env, cfg.sinks.webhook.password_env),
        open=lambda cfg, env: make_sender(cfg.sinks.webhook, env),
        build=_webhook,
    )
)
