"""The `replay` series: how the replay keeps up with the trace (backlog, admission, lateness)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from soakd.metric import Sample


class _Snapshots(Protocol):
    def snapshot(self) -> dict[str, float | int]: ...


class ReplayCollector:
    """Samples the running replay each telemetry interval; nothing before the replay starts."""

    name = "replay"

    def __init__(self, source: Callable[[], _Snapshots | None]) -> None:
        self._source = source

    def collect(self, now_ns: int) -> Sequence[Sample]:
        replayer = self._source()
        if replayer is None:
            return []
        return [Sample("replay", replayer.snapshot(), now_ns)]

    def close(self) -> None:
        return None
