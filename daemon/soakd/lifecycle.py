"""Start a run's parts in order and stop them in reverse: the one place that knows shutdown order.

A part that fails to start leaves the parts before it stopped (in reverse) and the error raised. Every
stop runs, whatever the others did: each is bounded by its own `stop_timeout_s`, and a failure or a
timeout is logged with the part's name, then the next part stops. Summaries are read after the stop,
so a part can report what its stop did (a sink's final drain).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)

DEFAULT_STOP_TIMEOUT_S = 60.0


def guard_step(step: str, fn: Callable[[], object]) -> None:
    """Run one step of a run's end whose failure must not stop the rest (the verdict and the summary must
    still be written): a failure is logged by the step's name, and the run goes on."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        log.error("shutdown_step_failed", step=step, error=f"{type(err).__name__}: {err}")


class Component(Protocol):
    """One part of a run with a start and a stop (a sink, the collectors, the engine, the scheduler)."""

    name: str
    stop_timeout_s: float
    """The longest its stop may take before the stack goes on without it."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def summary(self) -> Mapping[str, Any]:
        """The part's entries in summary.json (top-level keys; a part may add several)."""
        ...


class Part:
    """A Component made of callables: for the parts whose start or stop is a line or two."""

    def __init__(
        self,
        name: str,
        *,
        start: Callable[[], Awaitable[None] | None] | None = None,
        stop: Callable[[], Awaitable[None] | None] | None = None,
        summary: Callable[[], Mapping[str, Any]] | None = None,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.stop_timeout_s = stop_timeout_s
        self._start = start
        self._stop = stop
        self._summary = summary

    async def start(self) -> None:
        if self._start is not None:
            out = self._start()
            if out is not None:
                await out

    async def stop(self) -> None:
        if self._stop is not None:
            out = self._stop()
            if out is not None:
                await out

    def summary(self) -> Mapping[str, Any]:
        return self._summary() if self._summary is not None else {}


class Stack:
    """Components started in order, stopped in reverse: `async with Stack(name, parts):`."""

    def __init__(self, name: str, components: Sequence[Component]) -> None:
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"stack {name}: part names repeat: {names}")
        self.name = name
        self._components = list(components)
        self._started: list[Component] = []
        self.stop_failures: dict[str, str] = {}
        """Part name -> why its stop failed (an error or a timeout), for the summary and the tests."""

    @property
    def started(self) -> list[str]:
        return [c.name for c in self._started]

    async def start(self) -> None:
        for component in self._components:
            try:
                await component.start()
            except BaseException:
                log.error("part_start_failed", group=self.name, part=component.name)
                await self.stop()
                raise
            self._started.append(component)

    async def stop(self) -> None:
        while self._started:
            component = self._started.pop()
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(component.stop(), component.stop_timeout_s)
            except TimeoutError:
                self._failed(component, f"did not stop within {component.stop_timeout_s:g} s")
            # The next part must stop whatever this one raised; the failure is logged by name.
            except Exception as err:  # noqa: BLE001
                self._failed(component, f"{type(err).__name__}: {err}"[:300])
            else:
                log.debug("part_stopped", group=self.name, part=component.name, took_s=time.monotonic() - t0)

    def _failed(self, component: Component, why: str) -> None:
        self.stop_failures[component.name] = why
        log.error("part_stop_failed", group=self.name, part=component.name, error=why)

    def summaries(self) -> dict[str, Any]:
        """Every part's summary entries, merged in start order; a summary that raises is logged and
        left out (the run's summary is still written)."""
        out: dict[str, Any] = {}
        for component in self._components:
            try:
                entries = component.summary()
            except Exception as err:  # noqa: BLE001  (as a failed stop: logged by name, others go on)
                log.error("part_summary_failed", group=self.name, part=component.name, error=repr(err)[:300])
                continue
            clash = set(entries) & set(out)
            if clash:
                raise ValueError(f"stack {self.name}: {component.name} repeats summary keys {sorted(clash)}")
            out.update(entries)
        return out

    async def __aenter__(self) -> Stack:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
