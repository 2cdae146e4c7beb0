"""CUDA-graph re-capture: choose capture sizes that fit the observed tokens-per-step shape, and decide when.

vLLM runs a step of N tokens under the graph of the smallest captured size >= N (the rest is padding) and
runs a step above the largest captured size eagerly. Sizes captured for one traffic shape fit another
badly (night traffic gave a 70% graph hit rate in the field), so this module:

1. `compute_capture_sizes`: from a histogram {tokens per step: steps}, the largest size is a quantile of
   the steps (the outliers above it run eagerly: every size costs memory and capture time), and at most
   `max_sizes` sizes below it are chosen to minimise the total padding (exact, by dynamic programming);
2. `padding_stats`: the graph hit rate and padding waste of any sizes over a histogram;
3. `RecapturePolicy`: a pure state machine that, fed each interval's new step counts and the engine's
   idle time, says when a re-capture is worth it (engine idle, cooldown over, enough steps, a low hit
   rate or a long idle after a traffic change, and a real gain).

No I/O and no clock of its own: times are passed in (`t_s`, `idle_for_s`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from soakd.config import RecaptureControlConfig

__all__ = [
    "MAX_CANDIDATES",
    "CoverageStats",
    "RecaptureAction",
    "RecapturePolicy",
    "RecaptureSettings",
    "compute_capture_sizes",
    "nearest_rank",
    "padding_stats",
]

MAX_CANDIDATES: Final = 4096
"""Distinct candidate sizes the optimiser works on; above this, neighbouring values are bucketed."""

# Float slack for "at least min_gain" comparisons: 0.95 - 0.90 is 0.0499999... in binary.
_EPS: Final = 1e-9


def _clean_hist(hist: Mapping[int, int]) -> dict[int, int]:
    """The histogram without zero counts; ValueError on values < 1 or negative counts."""
    out: dict[int, int] = {}
    for value, count in hist.items():
        if value < 1 or count < 0:
            raise ValueError(f"bad histogram entry {value}: {count} (need tokens >= 1, count >= 0)")
        if count:
            out[int(value)] = int(count)
    return out


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """Sizes sorted and unique; ValueError on a size < 1."""
    if any(size < 1 for size in sizes):
        raise ValueError(f"capture sizes must be >= 1, got {list(sizes)}")
    return tuple(sorted({int(size) for size in sizes}))


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def nearest_rank(hist: Mapping[int, int], q: float) -> int:
    """The q-quantile (0 < q <= 1, nearest rank over the step counts) of a {value: count} histogram.

    Same rank as `soakd.collectors.engine.quantile_of_counts`, so the value matches the reported
    tokens_per_step_p99; kept here so this policy does not depend on the collectors.
    """
    counts = _clean_hist(hist)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("empty histogram")
    if not 0 < q <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    rank = min(total, max(1, math.ceil(q * total - _EPS)))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return max(counts)  # not reached: the counts sum to total >= rank


def compute_capture_sizes(
    hist: Mapping[int, int],
    *,
    quantile: float = 0.99,
    max_sizes: int = 12,
    max_size: int | None = None,
    align: int = 1,
) -> list[int]:
    """Capture sizes (ascending, unique, >= 1, at most `max_sizes`) for a {tokens per step: steps} histogram.

    The largest size is the `quantile` of the steps rounded up to `align` and capped at `max_size`; steps
    above it are accepted as eager. The other sizes are multiples of `align` chosen to minimise the total
    padding (sum over graph steps of size used - tokens). Exact unless the histogram has more than
    `MAX_CANDIDATES` distinct values, which are then bucketed (each bucket served by its largest value).
    """
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    if max_sizes < 1:
        raise ValueError(f"max_sizes must be >= 1, got {max_sizes}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    counts = _clean_hist(hist)
    if not counts:
        raise ValueError("empty histogram")

    top = _round_up(nearest_rank(counts, quantile), align)
    if max_size is not None:
        top = min(top, max_size)
    # Each graph step is served by the smallest candidate >= its tokens: its value rounded up to the
    # alignment (the cap can make the top itself unaligned). Group steps and tokens by that candidate.
    groups: dict[int, list[int]] = {top: [0, 0]}
    for value, count in counts.items():
        if value <= top:
            group = groups.setdefault(min(_round_up(value, align), top), [0, 0])
            group[0] += count
            group[1] += value * count
    cands = sorted(groups)
    steps = [groups[c][0] for c in cands]
    tokens = [groups[c][1] for c in cands]
    if len(cands) > MAX_CANDIDATES:
        cands, steps, tokens = _bucket(cands, steps, tokens, MAX_CANDIDATES)
    if len(cands) <= max_sizes:
        return cands  # every candidate gets a graph: no padding beyond the alignment
    return _min_padding(cands, steps, tokens, max_sizes)


def _bucket(
    cands: list[int], steps: list[int], tokens: list[int], limit: int
) -> tuple[list[int], list[int], list[int]]:
    """Merge runs of neighbouring candidates into at most `limit` buckets, each kept at its largest value.

    Runs are counted from the top so the largest candidate (the quantile size) stays a bucket end.
    """
    stride = math.ceil(len(cands) / limit)
    out_c: list[int] = []
    out_s: list[int] = []
    out_t: list[int] = []
    for end in range(len(cands), 0, -stride):
        start = max(0, end - stride)
        out_c.append(cands[end - 1])
        out_s.append(sum(steps[start:end]))
        out_t.append(sum(tokens[start:end]))
    return out_c[::-1], out_s[::-1], out_t[::-1]


def _min_padding(cands: list[int], steps: list[int], tokens: list[int], k: int) -> list[int]:
    """The `k` of `cands` (ascending, the last one always kept) with the least total padding.

    Candidates i+1..j (1-based) served by size cands[j-1] pad cost(i, j) = cands[j-1] * steps(i, j) -
    tokens(i, j), with steps/tokens the sums over that run. f[l][j], the least padding of candidates
    1..j with l sizes the largest at cands[j-1], is min over i of f[l-1][i] + cost(i, j). cost is Monge
    (cost(a,c) + cost(b,d) - cost(a,d) - cost(b,c) = (cands[c-1] - cands[d-1]) * steps(a, b) <= 0), so
    the best i does not decrease with j and each layer is solved by divide and conquer in O(m log m).
    Using all k sizes is optimal (another size never adds padding), so the answer is f[k][m].
    Integers throughout: the padding is exact and ties resolve the same way every time.
    """
    m = len(cands)
    w = [0] * (m + 1)  # prefix sums of steps and tokens
    s = [0] * (m + 1)
    for j in range(m):
        w[j + 1] = w[j] + steps[j]
        s[j + 1] = s[j] + tokens[j]

    def cost(i: int, j: int) -> int:
        return cands[j - 1] * (w[j] - w[i]) - (s[j] - s[i])

    # Layer l only needs j in [l, m - (k - l)]: the k - l larger sizes need that many candidates above.
    prev = [0] * (m + 1)
    for j in range(1, m - k + 2):
        prev[j] = cost(0, j)
    choice: list[list[int]] = [[0] * (m + 1)]  # choice[l - 1][j]: best i for layer l (layer 1: i = 0)

    for layer in range(2, k + 1):
        cur = [0] * (m + 1)
        arg = [0] * (m + 1)
        # Explicit stack of (j_lo, j_hi, i_lo, i_hi); the leftmost best i is monotone for Monge costs.
        # The last layer needs only j = m.
        j_first = layer if layer < k else m
        stack = [(j_first, m - (k - layer), layer - 1, m - (k - layer) - 1)]
        while stack:
            j_lo, j_hi, i_lo, i_hi = stack.pop()
            if j_lo > j_hi:
                continue
            j = (j_lo + j_hi) // 2
            best_i = i_lo
            best = prev[i_lo] + cost(i_lo, j)
            for i in range(i_lo + 1, min(i_hi, j - 1) + 1):
                value = prev[i] + cost(i, j)
                if value < best:
                    best, best_i = value, i
            cur[j], arg[j] = best, best_i
            stack.append((j_lo, j - 1, i_lo, best_i))
            stack.append((j + 1, j_hi, best_i, i_hi))
        choice.append(arg)
        prev = cur

    sizes: list[int] = []
    j = m
    for layer in range(k, 0, -1):
        sizes.append(cands[j - 1])
        j = choice[layer - 1][j]
    return sizes[::-1]


@dataclass(frozen=True, slots=True)
class CoverageStats:
    """How a set of capture sizes serves a tokens-per-step histogram."""

    steps: int
    """Steps in the histogram."""
    steps_in_graph: int
    """Steps with tokens <= the largest size (run under a graph)."""
    hit_rate: float
    """steps_in_graph / steps (0 when there are no steps)."""
    token_hit_rate: float
    """Share of the scheduled tokens that ran in graph steps (0 when there are none)."""
    padded_tokens: int
    """Padding of the graph steps: sum of size used - tokens."""
    padding_waste: float
    """padded_tokens / token slots the graphs ran (tokens + padding), 0 when no step ran under a graph."""


def padding_stats(hist: Mapping[int, int], sizes: Sequence[int]) -> CoverageStats:
    """Graph hit rate and padding of `sizes` (any order; empty means no graphs) over `hist`."""
    counts = _clean_hist(hist)
    ordered = _check_sizes(sizes)
    top = ordered[-1] if ordered else 0
    steps = in_graph = tokens = graph_tokens = padded = 0
    for value, count in counts.items():
        steps += count
        tokens += value * count
        if value <= top:
            in_graph += count
            graph_tokens += value * count
            padded += (ordered[bisect_left(ordered, value)] - value) * count
    slots = graph_tokens + padded
    return CoverageStats(
        steps=steps,
        steps_in_graph=in_graph,
        hit_rate=in_graph / steps if steps else 0.0,
        token_hit_rate=graph_tokens / tokens if tokens else 0.0,
        padded_tokens=padded,
        padding_waste=padded / slots if slots else 0.0,
    )


# Defaults are written once, in the config's [control.recapture]; the settings take them from there.
_RECAPTURE = RecaptureControlConfig()


@dataclass(frozen=True, slots=True)
class RecaptureSettings:
    """When to re-capture and how to choose the sizes. Times in seconds of the caller's `t_s`."""

    idle_s: float = _RECAPTURE.idle
    """The engine must have been idle this long before a re-capture may run (it stalls serving)."""
    min_hit_rate: float = _RECAPTURE.min_hit_rate
    """A graph hit rate below this over the recent window makes a re-capture wanted (0-1)."""
    min_gain: float = _RECAPTURE.min_gain
    """The new sizes must raise the hit rate by this much, or cut the padding waste by this much (0-1)."""
    min_steps: int = _RECAPTURE.min_steps
    """Steps in the recent window before the sizes are judged at all."""
    cooldown_s: float = _RECAPTURE.cooldown
    """Time after a re-capture (or a failed one) before the next."""
    long_idle_s: float = _RECAPTURE.long_idle
    """After an idle period this long, re-capture whenever the gain test passes, even at a good hit rate."""
    quantile: float = _RECAPTURE.quantile
    """Quantile of the steps the largest size covers; steps above it run eagerly (0 < q <= 1)."""
    max_sizes: int = _RECAPTURE.max_sizes
    """At most this many capture sizes (each costs memory and capture time)."""
    max_size: int | None = _RECAPTURE.max_size or None
    """Cap on the largest size (tokens), e.g. what the engine's memory allows; None: no cap."""
    align: int = _RECAPTURE.align
    """Every size but a capped largest one is a multiple of this."""

    def __post_init__(self) -> None:
        if self.idle_s < 0 or self.cooldown_s < 0:
            raise ValueError("idle_s and cooldown_s must be >= 0")
        if self.long_idle_s < self.idle_s:
            raise ValueError("long_idle_s must be >= idle_s")
        if not 0 <= self.min_hit_rate <= 1 or not 0 <= self.min_gain <= 1:
            raise ValueError("min_hit_rate and min_gain must be in [0, 1]")
        if self.min_steps < 1:
            raise ValueError("min_steps must be >= 1")
        if not 0 < self.quantile <= 1:
            raise ValueError("quantile must be in (0, 1]")
        if self.max_sizes < 1 or self.align < 1:
            raise ValueError("max_sizes and align must be >= 1")
        if self.max_size is not None and self.max_size < 1:
            raise ValueError("max_size must be >= 1 when given")

    @classmethod
    def from_config(cls, r: RecaptureControlConfig) -> RecaptureSettings:
        """[control.recapture]'s thresholds (its `max_size` 0: no cap)."""
        return cls(
            idle_s=r.idle,
            min_hit_rate=r.min_hit_rate,
            min_gain=r.min_gain,
            min_steps=r.min_steps,
            cooldown_s=r.cooldown,
            long_idle_s=r.long_idle,
            quantile=r.quantile,
            max_sizes=r.max_sizes,
            max_size=r.max_size or None,
            align=r.align,
        )


@dataclass(frozen=True, slots=True)
class RecaptureAction:
    """A re-capture the controller should run; it reports back with `applied` or `failed`."""

    sizes: tuple[int, ...]
    """New capture sizes, ascending."""
    previous: tuple[int, ...]
    """Capture sizes in use when decided."""
    reason: str
    """One human sentence with the numbers, for the event log."""
    evidence: dict[str, float]
    """steps, hit_rate, new_hit_rate, padding_waste, new_padding_waste, quantile_tokens, idle_for_s."""
    t_s: float


class RecapturePolicy:
    """Decides when to re-capture CUDA graphs for the traffic seen since the last capture.

    The window is the step histogram since the last applied capture (sizes judged on the traffic they
    served); `applied` resets it. Pass times from a clock that survives restarts (wall time) when the
    state is persisted with `to_state`; a time before the cooldown start is taken as a new clock origin.
    """

    def __init__(self, settings: RecaptureSettings, current_sizes: Sequence[int]) -> None:
        self.settings = settings
        self._sizes = _check_sizes(current_sizes)
        self._window: Counter[int] = Counter()
        self._steps = 0
        self._version = 0  # bumped on every change of the window, to reuse the (costly) proposal
        self._proposal: tuple[int, tuple[int, ...], CoverageStats, CoverageStats, int] | None = None
        self._last_capture_s: float | None = None
        self._cooldown_from_s: float | None = None

    @property
    def current_sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def last_capture_s(self) -> float | None:
        return self._last_capture_s

    @property
    def window_steps(self) -> int:
        """Steps observed since the last capture."""
        return self._steps

    def window(self) -> dict[int, int]:
        """A copy of the recent-window histogram."""
        return dict(self._window)

    def observe_steps(self, hist_delta: Mapping[int, int]) -> None:
        """Add one interval's new {tokens per step: steps} counts to the window."""
        delta = _clean_hist(hist_delta)
        if delta:
            self._window.update(delta)
            self._steps += sum(delta.values())
            self._version += 1

    def _propose(self) -> tuple[tuple[int, ...], CoverageStats, CoverageStats, int]:
        """(new sizes, current stats, new stats, quantile value) for the window, cached per window."""
        if self._proposal is None or self._proposal[0] != self._version:
            s = self.settings
            sizes = tuple(
                compute_capture_sizes(
                    self._window,
                    quantile=s.quantile,
                    max_sizes=s.max_sizes,
                    max_size=s.max_size,
                    align=s.align,
                )
            )
            self._proposal = (
                self._version,
                sizes,
                padding_stats(self._window, self._sizes),
                padding_stats(self._window, sizes),
                nearest_rank(self._window, s.quantile),
            )
        return self._proposal[1:]

    def decide(self, t_s: float, idle_for_s: float) -> RecaptureAction | None:
        """A re-capture to run now, or None. `idle_for_s`: how long the engine has been idle (0 when busy).

        Returns the same action on every call until `applied` or `failed` is called.
        """
        s = self.settings
        if idle_for_s < s.idle_s:
            return None
        if self._cooldown_from_s is not None:
            # A time before the start means a new clock origin: wait one full cooldown, not forever.
            self._cooldown_from_s = min(self._cooldown_from_s, t_s)
            if t_s - self._cooldown_from_s < s.cooldown_s:
                return None
        if self._steps < s.min_steps:
            return None
        new_sizes, cur, new, q_value = self._propose()
        low = cur.hit_rate < s.min_hit_rate
        long_idle = idle_for_s >= s.long_idle_s
        if not (low or long_idle) or new_sizes == self._sizes:
            return None
        hit_gain = new.hit_rate - cur.hit_rate
        waste_drop = cur.padding_waste - new.padding_waste
        # Less padding is no gain if it costs coverage below both the current rate and the floor.
        keeps_coverage = new.hit_rate >= min(cur.hit_rate, s.min_hit_rate) - _EPS
        if not (hit_gain >= s.min_gain - _EPS or (waste_drop >= s.min_gain - _EPS and keeps_coverage)):
            return None
        if low:
            reason = (
                f"graph hit rate {cur.hit_rate:.2f} < {s.min_hit_rate:.2f} over {self._steps:,} steps; "
                f"new sizes cover {new.hit_rate:.2f} of steps with {new.padding_waste:.0%} padding"
            )
        else:
            reason = (
                f"idle {idle_for_s:,.0f} s and traffic changed since the last capture: graph hit rate "
                f"{cur.hit_rate:.2f} -> {new.hit_rate:.2f}, padding {cur.padding_waste:.0%} -> "
                f"{new.padding_waste:.0%} over {self._steps:,} steps"
            )
        return RecaptureAction(
            sizes=new_sizes,
            previous=self._sizes,
            reason=reason,
            evidence={
                "steps": self._steps,
                "hit_rate": cur.hit_rate,
                "new_hit_rate": new.hit_rate,
                "padding_waste": cur.padding_waste,
                "new_padding_waste": new.padding_waste,
                "quantile_tokens": q_value,
                "idle_for_s": idle_for_s,
            },
            t_s=t_s,
        )

    def applied(self, t_s: float, sizes: Sequence[int]) -> None:
        """A re-capture with `sizes` completed at `t_s`: new sizes, empty window, cooldown starts."""
        self._sizes = _check_sizes(sizes)
        self._window.clear()
        self._steps = 0
        self._version += 1
        self._last_capture_s = t_s
        self._cooldown_from_s = t_s

    def failed(self, t_s: float) -> None:
        """A re-capture failed at `t_s`: sizes and window stay, the cooldown starts (no retry loop)."""
        self._cooldown_from_s = t_s

    def to_state(self) -> dict[str, Any]:
        """JSON-able state to survive a daemon restart (the window is not kept: it restarts empty)."""
        return {
            "sizes": list(self._sizes),
            "last_capture_s": self._last_capture_s,
            "cooldown_from_s": self._cooldown_from_s,
        }

    @classmethod
    def from_state(
        cls, state: Mapping[str, Any], settings: RecaptureSettings | None = None
    ) -> RecapturePolicy:
        """The policy back from `to_state`'s dict; ValueError when it is malformed."""
        sizes = state.get("sizes")
        if not isinstance(sizes, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in sizes
        ):
            raise ValueError(f"state 'sizes' must be a list of ints, got {sizes!r}")
        policy = cls(settings or RecaptureSettings(), sizes)
        times: list[float | None] = []
        for key in ("last_capture_s", "cooldown_from_s"):
            value = state.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ValueError(f"state {key!r} must be a number or null, got {value!r}")
            times.append(None if value is None else float(value))
        policy._last_capture_s, policy._cooldown_from_s = times
        return policy
