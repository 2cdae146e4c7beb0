"""The collector interface: one source of telemetry, one module, one small protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from soakd.metric import Sample

if TYPE_CHECKING:
    from soakd.engine.base import EngineInfo


class Collector(Protocol):
    """A source of Samples, polled by the runner on its tier's interval.

    `collect` is synchronous and must be cheap (microseconds to a few milliseconds): it runs on the
    event loop. It raises CollectorError (or lets a narrow library error through) when one collection
    fails; the runner contains that. A signal the hardware does not support is simply absent.
    """

    name: str

    def collect(self, now_ns: int) -> Sequence[Sample]: ...

    def close(self) -> None: ...


@runtime_checkable
class RefreshingCollector(Collector, Protocol):
    """A collector whose source needs I/O (an RPC into the engine's workers, an HTTP scrape).

    The app awaits `refresh()` on the slow tier (`telemetry.slow_interval`); it does the I/O and keeps
    what it read. `collect()` then hands out what the last refreshes gathered, without I/O, so the fast
    tier never waits on a slow source. `refresh()` raises on failure like `collect()` does.
    """

    async def refresh(self) -> None: ...


@runtime_checkable
class EngineListener(Protocol):
    """A collector that tags or judges by the engine's configuration: told of every (re)start."""

    def engine_started(self, info: EngineInfo) -> None: ...
