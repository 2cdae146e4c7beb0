"""Runs collectors, times each one, and contains their failures so one broken source never stops a soak."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from soakd.collectors.base import Collector, RefreshingCollector
from soakd.metric import Sample

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class CollectorHealth:
    """Running account of one collector."""

    runs: int = 0
    failures: int = 0
    last_error: str = ""
    last_duration_s: float = 0.0
    max_duration_s: float = 0.0


class CollectorRunner:
    """Polls a set of collectors; emits their samples plus a `collector` sample about each run."""

    def __init__(
        self,
        collectors: Sequence[Collector],
        emit: Callable[[Sequence[Sample]], None],
        wall_ns: Callable[[], int] = time.time_ns,
        perf: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._collectors = list(collectors)
        self._emit = emit
        self._wall_ns = wall_ns
        self._perf = perf
        self.health: dict[str, CollectorHealth] = {c.name: CollectorHealth() for c in collectors}

    def add(self, collector: Collector) -> None:
        """A collector whose source exists only once the engine runs (allocator RPC, /metrics)."""
        self._collectors.append(collector)
        self.health[collector.name] = CollectorHealth()

    @property
    def collectors(self) -> list[Collector]:
        return list(self._collectors)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self._collectors]

    def run_once(self) -> None:
        now_ns = self._wall_ns()
        out: list[Sample] = []
        for collector in self._collectors:
            health = self.health[collector.name]
            t0 = self._perf()
            ok = True
            try:
                out.extend(collector.collect(now_ns))
            # The runner is the containment boundary (as node_exporter's execute()): whatever one
            # collector raises is logged with its name and counted, and the others still run.
            except Exception as err:  # noqa: BLE001
                ok = False
                self._failed(collector.name, err)
            duration = self._perf() - t0
            health.runs += 1
            health.last_duration_s = duration
            health.max_duration_s = max(health.max_duration_s, duration)
            out.append(
                Sample(
                    "collector",
                    {"duration_s": duration, "ok": int(ok), "failures": health.failures},
                    now_ns,
                    tags={"collector": collector.name},
                )
            )
        self._emit(out)

    async def refresh(
        self,
        timeout_s: float,
        exclude: frozenset[str] = frozenset(),
        only: frozenset[str] | None = None,
    ) -> None:
        """The slow tier: await each refreshing collector's I/O, one after the other, each bounded by
        `timeout_s`; a failure or a timeout is counted against that collector like a failed collect.
        `only` names the collectors of a tier of their own (the GPU's, at its faster interval)."""
        for collector in self._collectors:
            if not isinstance(collector, RefreshingCollector) or collector.name in exclude:
                continue
            if only is not None and collector.name not in only:
                continue
            try:
                await asyncio.wait_for(collector.refresh(), timeout_s)
            # Same containment boundary as run_once, for the I/O half of a slow collector.
            except Exception as err:  # noqa: BLE001
                self._failed(collector.name, err)

    def _failed(self, name: str, err: BaseException) -> None:
        health = self.health[name]
        health.failures += 1
        text = "timed out" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
        health.last_error = text[:200]
        # Log the first failure and then every 100th, so a persistent fault cannot flood the journal.
        if health.failures == 1 or health.failures % 100 == 0:
            log.warning("collector_failed", collector=name, error=health.last_error, failures=health.failures)

    def close(self) -> None:
        for collector in self._collectors:
            collector.close()
