"""Open-loop pacing: when each request of a (looped) trace is due, on trace time x speed."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from soakd.traces.model import RequestSpec


@dataclass(frozen=True, slots=True)
class Scheduled:
    """A request with the time it is due, in seconds from the start of the replay."""

    spec: RequestSpec
    loop: int
    """0 for the first pass over the trace, 1 for the second, ..."""
    due_s: float
    """Replay-relative time the request is due (trace time / speed, shifted per loop)."""


def loop_period(span_s: float, requests: int) -> float:
    """Trace seconds one pass occupies before the next pass starts.

    The next pass starts one mean inter-arrival gap after the last request, so the seam between passes
    looks like the rest of the trace instead of a burst of two requests at once.
    """
    if requests <= 1:
        return max(span_s, 1.0)
    return span_s + span_s / (requests - 1) if span_s > 0 else 1.0


def schedule(
    trace: Iterable[RequestSpec],
    *,
    span_s: float,
    requests: int,
    speed: float,
    duration_s: float,
    loop: bool,
) -> Iterator[Scheduled]:
    """Every request due within `duration_s` of replay time, in order, looping the trace if asked.

    The trace is re-iterated for each pass (streamed, never held in memory).
    """
    if speed <= 0:
        raise ValueError("speed must be > 0")
    period = loop_period(span_s, requests)
    n = 0
    while True:
        offset = n * period
        if offset / speed >= duration_s:
            return  # no request of this pass can be due in time; don't even open the trace
        emitted = False
        for spec in trace:
            due = (spec.arrival_s + offset) / speed
            if due >= duration_s:
                return
            emitted = True
            yield Scheduled(spec=spec, loop=n, due_s=due)
        if not loop or not emitted:
            return
        n += 1
