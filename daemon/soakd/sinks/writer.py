"""The one place every sample goes first: run-wide tags added, times kept increasing, into the spool."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import structlog

from soakd.metric import FieldValue, Sample
from soakd.sinks.spool import Spool

log = structlog.get_logger(__name__)


class SampleWriter:
    """Adds the run-wide tags and writes samples to the spool, the one place every sample goes first.

    InfluxDB keeps one point per series and timestamp: two points with equal time would overwrite each
    other, so times are kept strictly increasing per series.
    """

    def __init__(
        self,
        spool: Spool,
        tags: dict[str, str],
        wall_ns: Callable[[], int] = time.time_ns,
        after_ns: int = 0,
        observe: Callable[[Sample], None] | None = None,
    ) -> None:
        self._spool = spool
        self._observe = observe
        """Sees every point as written (the verdict's metrics fold), before the spool takes it: the
        verdict counts a point even if the disk refuses its line."""
        self._tags = tags
        self._wall_ns = wall_ns
        self._after_ns = after_ns
        """Every point is later than this (a resumed run's newest point), even if the clock was set back."""
        self.clock_behind = 0
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, samples: Iterable[Sample]) -> None:
        out: list[Sample] = []
        for s in samples:
            tags = {**s.tags, **self._tags}
            key = (s.measurement, tuple(sorted(tags.items())))
            t = s.time_ns
            if t <= self._after_ns:
                self.clock_behind += 1
                if self.clock_behind == 1:
                    log.warning("clock_behind_spool", behind_s=(self._after_ns - t) / 1e9)
                t = self._after_ns + 1
            last = self._last.get(key)
            if last is not None and t <= last:
                t = last + 1
            self._last[key] = t
            point = Sample(s.measurement, s.fields, t, tags)
            out.append(point)
            self.counts[s.measurement] = self.counts.get(s.measurement, 0) + 1
            if self._observe is not None:
                self._observe(point)
        self._spool.write(out)

    def event(self, kind: str, message: str, **fields: FieldValue) -> None:
        """An annotation: something soakd saw or did (Grafana draws these on every panel).

        After the spool is closed (the very end of a run) events go to the log only."""
        log.info("event", kind=kind, message=message, **fields)
        if not self._spool.closed:
            # One `events` measurement holds every kind's fields, and InfluxDB refuses a batch whose field
            # type differs from what the shard has (an `ok` bool here, an integer there; 0 beside 0.5):
            # numbers are written as floats, whatever their Python type.
            values = {k: float(v) if isinstance(v, int) else v for k, v in fields.items()}
            self([Sample("events", {"message": message, **values}, self._wall_ns(), tags={"kind": kind})])
