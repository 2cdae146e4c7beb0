"""A run's request records folded into a `RequestSummary`: counts, tokens and latency percentiles in
bounded memory (`Quantiles`). The run-level metrics fold and the verdict build on it."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from soakd.metric import Sample

QUEUE_WAITED_S = 0.001
"""An admission wait over this is a request the concurrency ceiling held back (a free slot is taken in
microseconds)."""


def offered_s(fields: Mapping[str, object], stamped: str, sent: str) -> float | None:
    """A request's latency as offered (`stamped`: ttft_offered_s, e2e_offered_s) from its record's fields;
    for a record written before soakd stamped it, the sum of its parts: its `sent` figure (ttft_s,
    e2e_s) plus its admission wait and lateness."""
    value = _num(fields.get(stamped))
    if value is not None:
        return value
    from_send = _num(fields.get(sent))
    if from_send is None:
        return None
    return from_send + (_num(fields.get("queue_s")) or 0.0) + (_num(fields.get("lateness_s")) or 0.0)


def waited_share(share: float) -> str:
    """The share of requests that waited at the admission ceiling, in words: a few are never 0 %."""
    return f"{100 * share:.0f} %" if share >= 0.01 else "under 1 %"


def _pct(values: npt.NDArray[np.float64], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


class Quantiles:
    """Percentiles of a stream of non-negative values in bounded memory.

    The first `exact_limit` values are kept as they are (exact percentiles, as numpy computes them);
    past that the values move into a log-bucketed histogram whose buckets are `1 + rel_error` wide
    (from 1 microsecond up; smaller values share the lowest bucket), so a percentile is within
    `rel_error / 2` of the true one and memory stays ~100 KB however long the soak. Keeping every
    sample, as k6 does, grows a multi-hour run's memory without end; so does a plain array (8 bytes per
    request, 32 MB per million requests for four latencies).
    """

    __slots__ = ("_counts", "_exact", "_floor", "_limit", "_log_step", "_max", "_min", "_n", "_sum")

    def __init__(self, exact_limit: int = 8192, rel_error: float = 0.005, floor: float = 1e-6) -> None:
        self._exact: array[float] | None = array("d")
        self._counts: npt.NDArray[np.int64] | None = None
        self._n = 0
        self._sum = 0.0
        self._max = -math.inf
        self._min = math.inf
        self._log_step = math.log1p(rel_error)
        self._floor = floor
        self._limit = exact_limit

    def __len__(self) -> int:
        return self._n

    def add(self, value: float) -> None:
        self._n += 1
        self._sum += value
        self._max = max(self._max, value)
        self._min = min(self._min, value)
        if self._exact is not None:
            self._exact.append(value)
            if len(self._exact) > self._limit:
                self._to_histogram()
            return
        assert self._counts is not None
        self._counts[self._bucket(value)] += 1

    def _bucket(self, value: float) -> int:
        if value <= self._floor:
            return 0
        # Values beyond the last bucket (over ~4 days in seconds) share it; max stays exact.
        return min(int(math.log(value / self._floor) / self._log_step) + 1, _BUCKETS - 1)

    def _to_histogram(self) -> None:
        assert self._exact is not None
        self._counts = np.zeros(_BUCKETS, dtype=np.int64)
        for value in self._exact:
            self._counts[self._bucket(value)] += 1
        self._exact = None

    def percentile(self, q: float) -> float | None:
        if self._n == 0:
            return None
        if self._exact is not None:
            return _pct(np.frombuffer(self._exact, dtype=np.float64), q)
        assert self._counts is not None
        rank = max(1, math.ceil(q / 100.0 * self._n))
        if rank >= self._n:
            return self._max
        index = int(np.searchsorted(np.cumsum(self._counts), rank))
        # Bucket i >= 1 holds [floor * (1+e)^(i-1), floor * (1+e)^i): its geometric middle is within
        # half a bucket of every value in it.
        value = self._floor * math.exp((index - 0.5) * self._log_step) if index else self._min
        return min(max(value, self._min), self._max)

    @property
    def max(self) -> float | None:
        return self._max if self._n else None

    @property
    def min(self) -> float | None:
        return self._min if self._n else None

    @property
    def mean(self) -> float | None:
        return self._sum / self._n if self._n else None


_BUCKETS = 6000  # (1 + 0.005) ** 6000 ~ 1e13: 1 us .. ~4 months


@dataclass(slots=True)
class LatencyStats:
    """Percentiles of one latency, in milliseconds."""

    count: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, seconds: Sequence[float] | Quantiles) -> LatencyStats:
        if not isinstance(seconds, Quantiles):
            q = Quantiles(exact_limit=len(seconds))
            for v in seconds:
                q.add(float(v))
            seconds = q

        def ms(value: float | None) -> float | None:
            return value * 1000.0 if value is not None else None

        return cls(
            count=len(seconds),
            p50_ms=ms(seconds.percentile(50)),
            p90_ms=ms(seconds.percentile(90)),
            p99_ms=ms(seconds.percentile(99)),
            max_ms=ms(seconds.max),
        )


@dataclass(slots=True)
class RequestSummary:
    """What the request records of a run add up to."""

    scheduled: int = 0
    completed: int = 0
    failed: int = 0
    shed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    first_ns: int | None = None
    last_ns: int | None = None
    ttft: LatencyStats | None = None
    """From the send to the first token: the server's view."""
    tpot: LatencyStats | None = None
    e2e: LatencyStats | None = None
    """From the send to the last token: the server's view."""
    lateness: LatencyStats | None = None
    ttft_offered: LatencyStats | None = None
    """From the due time to the first token (admission wait, lateness, connection included): the user's
    view, what the `ttft_p99_ms` criterion judges."""
    e2e_offered: LatencyStats | None = None
    """From the due time to the last token: the user's view."""
    queue: LatencyStats | None = None
    """Wait at soakd's admission gate (the concurrency ceiling), of answered requests."""
    waited: int = 0
    """Answered requests that waited at the admission gate (over QUEUE_WAITED_S): the ceiling bound."""
    errors: dict[str, int] = field(default_factory=dict)
    incomplete: int = 0
    """Requests the replay's end left unfinished (status `incomplete`): the unserved backlog at the end,
    apart from the failures. In `completed_ratio`'s denominator, not in `error_rate`."""
    incomplete_unsent: int = 0
    """Of `incomplete`, those still waiting at soakd's admission gate (never sent to the engine)."""
    lost_in_flight: int = 0
    """Requests in flight when the daemon died (a resumed run): scheduled, never completed, counted as
    failed; the spool has no record of them, the due-journal does."""

    def with_lost(self, lost: int) -> RequestSummary:
        """The whole run's figures: these records plus the requests lost in flight at crashes."""
        if lost <= 0:
            return self
        errors = dict(self.errors)
        errors["lost in flight (daemon restart)"] = errors.get("lost in flight (daemon restart)", 0) + lost
        return replace(
            self,
            scheduled=self.scheduled + lost,
            failed=self.failed + lost,
            errors=errors,
            lost_in_flight=self.lost_in_flight + lost,
        )

    @property
    def error_rate(self) -> float | None:
        done = self.completed + self.failed
        return self.failed / done if done else None

    @property
    def completed_ratio(self) -> float | None:
        return self.completed / self.scheduled if self.scheduled else None

    @property
    def admission_wait_share(self) -> float | None:
        """Share of answered requests that waited at the admission gate: > 0 means the ceiling bound."""
        return self.waited / self.completed if self.completed else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["error_rate"] = self.error_rate
        d["completed_ratio"] = self.completed_ratio
        d["admission_wait_share"] = self.admission_wait_share
        return d


class RequestFolder:
    """Folds `requests` samples into a RequestSummary one at a time.

    `soakd run` feeds it as records are written, so the verdict needs no re-read of a night's spool at
    shutdown (when systemd's stop timeout is running); `soakd report` feeds it from the spool. Both
    go through this one fold, so they agree. Latencies go into bounded `Quantiles` (exact for the first
    8192 values, then within 0.25%), so a night's memory does not grow with the number of requests.
    """

    def __init__(self) -> None:
        self._s = RequestSummary()
        self._ttft = Quantiles()
        self._tpot = Quantiles()
        self._e2e = Quantiles()
        self._late = Quantiles()
        self._ttft_offered = Quantiles()
        self._e2e_offered = Quantiles()
        self._queue = Quantiles()

    def add(self, sample: Sample) -> None:
        if sample.measurement != "requests":
            return
        s = self._s
        f = sample.fields
        s.scheduled += 1
        s.first_ns = sample.time_ns if s.first_ns is None else min(s.first_ns, sample.time_ns)
        s.last_ns = sample.time_ns if s.last_ns is None else max(s.last_ns, sample.time_ns)
        status = sample.tags.get("status", "error")
        if status == "shed":
            s.shed += 1
            return
        if status == "incomplete":
            s.incomplete += 1
            s.incomplete_unsent += int(str(f.get("error", "")).endswith("before admission"))
        elif status == "ok":
            s.completed += 1
            # Of requests that were sent and answered, as the other latencies: a shed or unsent
            # request's 0 would thin the tail.
            late = _num(f.get("lateness_s")) or 0.0
            queue = _num(f.get("queue_s")) or 0.0
            self._late.add(late)
            self._queue.add(queue)
            if queue > QUEUE_WAITED_S:
                s.waited += 1
            for name, dest in (("ttft_s", self._ttft), ("tpot_s", self._tpot), ("e2e_s", self._e2e)):
                value = _num(f.get(name))
                if value is not None:
                    dest.add(value)
            for name, sent, dest in (
                ("ttft_offered_s", "ttft_s", self._ttft_offered),
                ("e2e_offered_s", "e2e_s", self._e2e_offered),
            ):
                value = offered_s(f, name, sent)
                if value is not None:
                    dest.add(value)
        else:
            s.failed += 1
            kind = str(f.get("error", "unknown")).split(":", 1)[0]
            s.errors[kind] = s.errors.get(kind, 0) + 1
        tokens_in = f.get("input_tokens", 0)
        tokens_out = f.get("output_tokens", 0)
        s.input_tokens += int(tokens_in) if isinstance(tokens_in, int) else 0
        s.output_tokens += int(tokens_out) if isinstance(tokens_out, int) else 0

    def quantiles(self, name: str) -> Quantiles:
        """One latency's distribution (seconds) by its criteria name (lang.criteria.DISTRIBUTIONS)."""
        return {
            "ttft_ms": self._ttft,
            "tpot_ms": self._tpot,
            "e2e_ms": self._e2e,
            "lateness_ms": self._late,
            "ttft_offered_ms": self._ttft_offered,
            "e2e_offered_ms": self._e2e_offered,
            "queue_ms": self._queue,
        }[name]

    def summary(self) -> RequestSummary:
        s = self._s
        s.ttft = LatencyStats.of(self._ttft)
        s.tpot = LatencyStats.of(self._tpot)
        s.e2e = LatencyStats.of(self._e2e)
        s.lateness = LatencyStats.of(self._late)
        s.ttft_offered = LatencyStats.of(self._ttft_offered)
        s.e2e_offered = LatencyStats.of(self._e2e_offered)
        s.queue = LatencyStats.of(self._queue)
        return s


def _num(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def summarize(samples: Iterable[Sample]) -> RequestSummary:
    """Fold `requests` samples (one per request) into a summary; other measurements are ignored."""
    folder = RequestFolder()
    for sample in samples:
        folder.add(sample)
    return folder.summary()
