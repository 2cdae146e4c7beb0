"""The criteria language of `[criteria] checks`: parse `p99(ttft_offered_ms) < 500`-style lines (the config
validates them with it; `judge.criteria.measure` measures them).

One check is `METRIC OP NUMBER`, k6-threshold style:

    METRIC  := NAME | AGG "(" NAME ("," KEY "=" DURATION)* ")" | "events(" KIND ")"
    AGG     := pNN | pNN.N | min | max | mean | sustained_ratio
    OP      := < | <= | > | >= | == | !=

- a latency distribution (ttft_offered_ms, e2e_offered_ms: from the due time; ttft_ms, tpot_ms, e2e_ms:
  from the send; lateness_ms, queue_ms) takes pNN, min, max or mean;
- a windowed series (tokens_per_s, spec_acceptance, graph_hit_rate, sm_clock_ratio, temp_c ...) takes
  min/max/mean over windows (`window=`, default 1m), or `sustained_ratio(S, last=1h, first=1h)`: its
  value over the last span divided by its value over the first; one with a whole-run meaning (a ratio of
  sums, a rate) may also stand alone;
- a run scalar (errors, error_rate, throttle_time_pct, fragmentation_growth, engine_restarts ...)
  stands alone; `events(KIND)` counts events of one kind.

Parsing is strict (every unknown name, function or key is an error naming what is known), so a typo in
config.toml is exit 2 at load time, never a criterion that silently cannot fail.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from soakd.units import parse_duration

OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
}
# The user's view first (from the due time), then the server's (from the send) and its parts.
DISTRIBUTIONS = (
    "ttft_offered_ms",
    "e2e_offered_ms",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "lateness_ms",
    "queue_ms",
)
# Windowed series, and whether the bare name means something over the whole run (see metrics.SERIES).
SERIES_TOTAL = {
    "tokens_per_s": True,
    "requests_per_s": True,
    "spec_acceptance": True,
    "graph_hit_rate": True,
    "prefix_hit_rate": True,
    "error_rate_window": False,
    "throttle_pct": False,
    "sm_clock_ratio": False,
    "power_w": False,
    "temp_c": False,
    "fragmentation": False,
    "kv_cache_usage": False,
}
# Run scalars: from the fold (metrics.RunMetrics.scalars) or from the run itself (duration_s,
# interruptions, lost_in_flight).
SCALARS = (
    "requests",
    "completed",
    "errors",
    "incomplete",
    "shed",
    "error_rate",
    "completed_ratio",
    "admission_wait_share",
    "output_tokens",
    "input_tokens",
    "throttle_time_pct",
    "host_throttle_time_pct",
    "fragmentation_growth",
    "peak_gpu_mem_bytes",
    "peak_engine_rss_bytes",
    "soakd_cpu_pct",
    "harness_saturated_s",
    "peak_allocator_reserved_bytes",
    "engine_restarts",
    "engine_rebuilds",
    "throttle_episodes",
    "recaptures",
    "replay_s",
    "duration_s",
    "interruptions",
    "lost_in_flight",
)
AGGREGATES = ("min", "max", "mean", "sustained_ratio")
DEFAULT_WINDOW_S = 60.0
DEFAULT_SPAN_S = 3600.0

# Every pattern is linear in its input: each unbounded run is possessive (`++`, `*+`: never given back),
# so a token that does not fit one kind is refused after one scan, not after trying every way to split
# it (a 10k-digit number followed by a letter took seconds, 100k digits minutes). Tokens are then
# bounded in length (MAX_TOKEN_CHARS) and a check in characters (MAX_CHECK_CHARS).
_TOKEN = re.compile(
    r"\s*+(?:(?P<num>[-+]?+(?:\d++(?:\.\d*+)?+|\.\d++)(?:[eE][-+]?+\d++)?+)(?![\w.])|(?P<dur>\d[\w.]*+)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_.]*+)|(?P<op><=|>=|==|!=|<|>)|(?P<punct>[(),=]))"
)
MAX_TOKEN_CHARS = 64
"""A number, name or duration longer than this is a typo or an attack, never a criterion."""
MAX_CHECK_CHARS = 1000
"""A check is one comparison: a line of text, not a page."""
_PCT = re.compile(r"p(\d{1,2}(?:\.\d+)?)$")


@dataclass(frozen=True, slots=True)
class Check:
    """One parsed check."""

    text: str
    agg: str | None
    """None (a bare name), "p" (a percentile), min/max/mean/sustained_ratio, or "events"."""
    metric: str
    op: str
    threshold: float
    q: float | None = None
    kwargs: Mapping[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The metric as written canonically: `p99(ttft_ms)`, `min(spec_acceptance, window=300s)`."""
        if self.agg is None:
            return self.metric
        head = f"p{self.q:g}" if self.agg == "p" else self.agg
        args = [self.metric, *(f"{k}={v:g}s" for k, v in sorted(self.kwargs.items()))]
        return f"{head}({', '.join(args)})"


def _duration(text: str) -> float:
    seconds = parse_duration(text)
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be more than 0")
    return seconds


def _shown(text: str) -> str:
    """A check as an error quotes it: at most a line's worth of it."""
    return repr(text) if len(text) <= 80 else repr(text[:60]) + f"... ({len(text)} characters)"


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    stripped = text.rstrip()
    while pos < len(stripped):
        m = _TOKEN.match(stripped, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"{_shown(text)}: unexpected {stripped[pos:].lstrip()[:20]!r}")
        kind = m.lastgroup
        assert kind is not None
        token = m.group(kind)
        if len(token) > MAX_TOKEN_CHARS:
            what = {"num": "a number", "dur": "a duration", "name": "a name"}.get(kind, "a token")
            raise ValueError(f"{_shown(text)}: {what} of {len(token)} characters (at most {MAX_TOKEN_CHARS})")
        out.append((kind, token))
        pos = m.end()
    return out


def parse_check(text: str) -> Check:
    """Parse one check; ValueError says what is wrong, in words a config error can carry."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a check is a string like 'p99(ttft_offered_ms) < 500'")
    if len(text) > MAX_CHECK_CHARS:
        raise ValueError(f"{_shown(text)}: a check is at most {MAX_CHECK_CHARS} characters")
    toks = _tokens(text)
    ops = [i for i, (kind, _) in enumerate(toks) if kind == "op"]
    if len(ops) != 1:
        raise ValueError(f"{text!r}: expected one comparison (< <= > >= == !=) between a metric and a number")
    i = ops[0]
    left, op, right = toks[:i], toks[i][1], toks[i + 1 :]
    if len(right) != 1 or right[0][0] != "num":
        raise ValueError(f"{text!r}: the right side of {op} must be a number")
    threshold = float(right[0][1])
    if not math.isfinite(threshold):
        raise ValueError(f"{text!r}: the threshold must be finite")
    return _metric(text, left, op, threshold)


def _metric(text: str, toks: list[tuple[str, str]], op: str, threshold: float) -> Check:
    if not toks or toks[0][0] != "name":
        raise ValueError(f"{text!r}: the left side must be a metric")
    head = toks[0][1]
    if len(toks) == 1:
        if head in DISTRIBUTIONS:
            raise ValueError(f"{text!r}: {head} is a distribution: use p50/p99/min/max/mean({head})")
        if head in SERIES_TOTAL and not SERIES_TOTAL[head]:
            raise ValueError(f"{text!r}: {head} is a series: use min/max/mean({head}) or sustained_ratio")
        if head not in SCALARS and head not in SERIES_TOTAL:
            raise ValueError(f"{text!r}: unknown metric {head!r} (known: {', '.join(_known())})")
        return Check(text, None, head, op, threshold)
    if toks[1] != ("punct", "(") or toks[-1] != ("punct", ")") or len(toks) < 4 or toks[2][0] != "name":
        raise ValueError(f"{text!r}: expected {head}(METRIC ...) {op} NUMBER")
    arg = toks[2][1]
    kwargs = _kwargs(text, toks[3:-1])
    if head == "events":
        _no_kwargs(text, head, kwargs)
        return Check(text, "events", arg, op, threshold)
    pct = _PCT.match(head)
    if pct is not None:
        if arg not in DISTRIBUTIONS:
            raise ValueError(f"{text!r}: {head}() takes a latency ({', '.join(DISTRIBUTIONS)}), not {arg!r}")
        q = float(pct.group(1))
        if not 0 < q < 100:
            raise ValueError(f"{text!r}: percentile {q:g} must be between 0 and 100")
        _no_kwargs(text, head, kwargs)
        return Check(text, "p", arg, op, threshold, q=q)
    if head not in AGGREGATES:
        raise ValueError(f"{text!r}: unknown function {head!r} (known: pNN, {', '.join(AGGREGATES)}, events)")
    if head == "sustained_ratio":
        if arg not in SERIES_TOTAL:
            raise ValueError(
                f"{text!r}: sustained_ratio takes a series ({', '.join(SERIES_TOTAL)}), not {arg!r}"
            )
        unknown = set(kwargs) - {"last", "first"}
        if unknown:
            raise ValueError(
                f"{text!r}: sustained_ratio takes last= and first=, not {', '.join(sorted(unknown))}"
            )
        return Check(
            text, head, arg, op, threshold, kwargs={"first": DEFAULT_SPAN_S, "last": DEFAULT_SPAN_S} | kwargs
        )
    if arg in DISTRIBUTIONS:
        _no_kwargs(text, head, kwargs)
        return Check(text, head, arg, op, threshold)
    if arg not in SERIES_TOTAL:
        raise ValueError(
            f"{text!r}: {head}() takes a latency or a series "
            f"({', '.join([*DISTRIBUTIONS, *SERIES_TOTAL])}), not {arg!r}"
        )
    unknown = set(kwargs) - {"window"}
    if unknown:
        raise ValueError(f"{text!r}: {head}() takes window=, not {', '.join(sorted(unknown))}")
    return Check(text, head, arg, op, threshold, kwargs={"window": DEFAULT_WINDOW_S} | kwargs)


def _kwargs(text: str, toks: list[tuple[str, str]]) -> dict[str, float]:
    out: dict[str, float] = {}
    i = 0
    while i < len(toks):
        part = toks[i : i + 4]
        if (
            len(part) < 4
            or part[0] != ("punct", ",")
            or part[1][0] != "name"
            or part[2] != ("punct", "=")
            or part[3][0] not in ("num", "dur", "name")
        ):
            raise ValueError(f"{text!r}: expected ', key=DURATION' (like ', last=1h')")
        key, raw = part[1][1], part[3][1]
        if key in out:
            raise ValueError(f"{text!r}: {key}= given twice")
        try:
            out[key] = _duration(raw)
        except ValueError as err:
            raise ValueError(f"{text!r}: {key}={raw}: {err}") from None
        i += 4
    return out


def _no_kwargs(text: str, head: str, kwargs: Mapping[str, float]) -> None:
    if kwargs:
        raise ValueError(f"{text!r}: {head}() takes no {', '.join(sorted(kwargs))}=")


def _known() -> list[str]:
    return [*SCALARS, *(s for s, total in SERIES_TOTAL.items() if total)]


def validate(text: str) -> str:
    """For the config: the check as written, once it parses."""
    parse_check(text)
    return text
