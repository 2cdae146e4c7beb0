"""Speculative-decoding acceptance beyond the per-step counters: where in a request and in a
conversation drafts stop being accepted (`spec_profile`), and how acceptance drifts against the run's
first window (fields on `spec_decode`, and `spec_drift` events).

Field notes this is built for: a 1.8x ideal speed-up that fell to 1.2x over 20 turns of a chat, and
acceptance that fell to about 60 % late in long outputs. Both are invisible in a run-wide average.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from soakd.config import SpecDriftConfig
from soakd.metric import FieldValue, Sample

if TYPE_CHECKING:
    from soakd.engine.base import EngineInfo

# Output-token positions (the position of a verify step's first draft token), bucketed by their lower
# bound: fine where outputs are short and acceptance moves fast, coarse in the long tail.
OUTPUT_EDGES: tuple[int, ...] = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Turn indexes within a session, bucketed by their lower bound (turn 0: first turn or no session).
TURN_EDGES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

EventFn = Callable[..., None]


def _bucket(edges: tuple[int, ...], value: int) -> int:
    return edges[bisect.bisect_right(edges, value) - 1]


@dataclass(slots=True)
class _Counts:
    accepted: int = 0
    drafted: int = 0
    steps: int = 0


class SpecProfile:
    """Acceptance by output-token position and by turn, from vLLM's per-request per-step counts
    (`per_request_spec_decode_metrics = "detailed"`).

    `add` is called once per finished request; `collect` writes the interval's counts (fields, not tags:
    a bounded set per point) and keeps run totals for the summary.
    """

    name = "spec_profile"

    def __init__(self, config_id: str = "") -> None:
        self.config_id = config_id
        self._out: dict[int, _Counts] = {}
        self._turn: dict[int, _Counts] = {}
        self.total_out: dict[int, _Counts] = {}
        self.total_turn: dict[int, _Counts] = {}
        self.requests = 0
        self._interval_requests = 0

    def engine_started(self, info: EngineInfo) -> None:
        """After a rebuild the series carry the new configuration's id."""
        self.config_id = info.config_id

    def add(self, accepted: Sequence[int], drafted: Sequence[int], turn: int) -> None:
        """One request's verify steps, in order: draft tokens accepted and proposed at each."""
        if not drafted:
            return
        self.requests += 1
        self._interval_requests += 1
        tb = _bucket(TURN_EDGES, max(0, turn))
        pos = 1  # the prefill step produced output token 0; drafts start verifying at 1
        for acc, dr in zip(accepted, drafted, strict=False):
            ob = _bucket(OUTPUT_EDGES, pos)
            for table in (self._out, self.total_out):
                c = table.setdefault(ob, _Counts())
                c.accepted += acc
                c.drafted += dr
                c.steps += 1
            for table in (self._turn, self.total_turn):
                c = table.setdefault(tb, _Counts())
                c.accepted += acc
                c.drafted += dr
                c.steps += 1
            pos += acc + 1  # the accepted drafts plus the target model's own token

    def collect(self, now_ns: int) -> Sequence[Sample]:
        if not self._out and not self._turn:
            return []
        fields: dict[str, FieldValue] = {"requests": self._interval_requests}
        for prefix, table in (("out", self._out), ("turn", self._turn)):
            for lo, c in sorted(table.items()):
                fields[f"accepted_{prefix}{lo}"] = c.accepted
                fields[f"drafted_{prefix}{lo}"] = c.drafted
                if c.drafted:
                    fields[f"rate_{prefix}{lo}"] = c.accepted / c.drafted
        self._out = {}
        self._turn = {}
        self._interval_requests = 0
        tags = {"config": self.config_id} if self.config_id else {}
        return [Sample("spec_profile", fields, now_ns, tags=tags)]

    def summary(self) -> dict[str, object]:
        """Run totals: acceptance rate per output-position bucket and per turn bucket."""

        def rows(table: dict[int, _Counts]) -> list[dict[str, float | int]]:
            return [
                {
                    "from": lo,
                    "accepted": c.accepted,
                    "drafted": c.drafted,
                    "steps": c.steps,
                    "rate": c.accepted / c.drafted if c.drafted else 0.0,
                }
                for lo, c in sorted(table.items())
            ]

        return {
            "requests": self.requests,
            "by_output_position": rows(self.total_out),
            "by_turn": rows(self.total_turn),
        }

    def close(self) -> None:
        self._out = {}
        self._turn = {}


@dataclass(frozen=True, slots=True)
class DriftSettings:
    baseline_s: float
    """Length of the run's first window of speculative traffic, the reference."""
    window_s: float
    """Length of the trailing window compared against it."""
    threshold: float
    """Relative drop of the acceptance rate (0.2: 20 % below the baseline) that raises a `spec_drift`
    event; it clears when the window is back within half of it."""
    min_draft_tokens: int = SpecDriftConfig().min_draft_tokens
    """A window (or the baseline) with fewer draft tokens is not judged: too few to say anything."""

    @classmethod
    def from_config(cls, d: SpecDriftConfig) -> DriftSettings:
        """[telemetry.spec_drift]."""
        return cls(d.baseline, d.window, d.threshold, d.min_draft_tokens)


class AcceptanceDrift:
    """Acceptance (rate and mean acceptance length) of a trailing window against the run's first one.

    Fed once per collection interval with that interval's counts. Time is the caller's (seconds of
    speculative traffic seen), so a pause in traffic does not age the baseline.
    """

    def __init__(self, settings: DriftSettings, on_event: EventFn | None = None) -> None:
        self.s = settings
        self._on_event = on_event
        self._elapsed = 0.0
        self._base = [0, 0, 0]  # accepted, draft tokens, drafts
        self.baseline_done = False
        self._window: deque[tuple[float, int, int, int]] = deque()
        self._win = [0, 0, 0]
        self.drifting = False
        self.events = 0
        self.worst_drift: float | None = None

    def reset(self) -> None:
        """Start over: the next traffic is a new baseline (after a change of draft settings)."""
        self._elapsed = 0.0
        self._base = [0, 0, 0]
        self.baseline_done = False
        self._window.clear()
        self._win = [0, 0, 0]
        self.drifting = False

    def update(
        self, interval_s: float, accepted: int, draft_tokens: int, drafts: int
    ) -> dict[str, FieldValue]:
        """Fields for this interval's `spec_decode` point (empty until a baseline exists)."""
        self._elapsed += interval_s
        if not self.baseline_done:
            b = self._base
            b[0] += accepted
            b[1] += draft_tokens
            b[2] += drafts
            if self._elapsed >= self.s.baseline_s and b[1] >= self.s.min_draft_tokens:
                self.baseline_done = True
            return {}
        self._window.append((self._elapsed, accepted, draft_tokens, drafts))
        w = self._win
        w[0] += accepted
        w[1] += draft_tokens
        w[2] += drafts
        while self._window and self._window[0][0] <= self._elapsed - self.s.window_s:
            _, a, d, n = self._window.popleft()
            w[0] -= a
            w[1] -= d
            w[2] -= n
        base_rate = self._base[0] / self._base[1] if self._base[1] else 0.0
        base_len = 1.0 + self._base[0] / self._base[2] if self._base[2] else 1.0
        fields: dict[str, FieldValue] = {
            "baseline_acceptance_rate": base_rate,
            "baseline_acceptance_length": base_len,
        }
        if w[1] < self.s.min_draft_tokens or base_rate <= 0:
            return fields
        rate = w[0] / w[1]
        length = 1.0 + w[0] / w[2] if w[2] else 1.0
        drift = rate / base_rate - 1.0
        fields["window_acceptance_rate"] = rate
        fields["window_acceptance_length"] = length
        fields["acceptance_drift"] = drift
        # Mean acceptance length is tokens per target-model step: the speed-up speculation buys.
        fields["acceptance_length_drift"] = length / base_len - 1.0
        self.worst_drift = drift if self.worst_drift is None else min(self.worst_drift, drift)
        self._judge(drift, rate, base_rate)
        return fields

    def _judge(self, drift: float, rate: float, base_rate: float) -> None:
        thr = self.s.threshold
        if not self.drifting and drift <= -thr:
            self.drifting = True
            self.events += 1
            self._emit(
                "spec_drift",
                f"draft acceptance {rate:.1%} is {-drift:.0%} below the run's first window ({base_rate:.1%})",
                drift=drift,
                rate=rate,
                baseline=base_rate,
            )
        elif self.drifting and drift > -thr / 2:
            self.drifting = False
            self._emit(
                "spec_drift_cleared",
                f"draft acceptance {rate:.1%} back within {thr / 2:.0%} "
                f"of the first window ({base_rate:.1%})",
                drift=drift,
                rate=rate,
                baseline=base_rate,
            )

    def _emit(self, kind: str, message: str, **fields: FieldValue) -> None:
        if self._on_event is not None:
            self._on_event(kind, message, **fields)

    def summary(self) -> dict[str, object]:
        b = self._base
        return {
            "baseline_done": self.baseline_done,
            "baseline_acceptance_rate": b[0] / b[1] if b[1] else None,
            "baseline_acceptance_length": 1.0 + b[0] / b[2] if b[2] else None,
            "worst_drift": self.worst_drift,
            "drift_events": self.events,
            "threshold": self.s.threshold,
        }
