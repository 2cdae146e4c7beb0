"""Durations as people write them ("90s", "10m", "1h30m", "250ms"), bounded: the one parser the config,
the command line and the criteria language share."""

from __future__ import annotations

import math
import re

# Matched at one position at a time, its digits possessive: linear in the text (a search for it over a
# long run of digits without a unit was quadratic).
_DURATION_PART = re.compile(r"(\d++(?:\.\d++)?+)(ms|s|m|h|d)")
MAX_DURATION_CHARS = 64
"""A duration written longer than this ("1h30m" is 5) is not one."""
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_DURATION_S = 366 * 86400.0
"""Every duration and interval: a soak of a year is far beyond any use, and a bound keeps sleeps, timers
and the JSON that records them finite."""


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as "90s", "10m", "8h", "1h30m", "250ms"."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 90s, 10m or 8h")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError("a duration must be a finite number of seconds")
        if value < 0:
            raise ValueError("a duration cannot be negative")
        if value > MAX_DURATION_S:
            raise ValueError(f"a duration is at most {MAX_DURATION_S / 86400:.0f} days")
        return float(value)
    if not isinstance(value, str):
        raise ValueError("expected a duration such as 90s, 10m or 8h")
    text = value.strip().replace(" ", "")
    if len(text) > MAX_DURATION_CHARS:
        raise ValueError(f"a duration of {len(text)} characters is not one (at most {MAX_DURATION_CHARS})")
    pos = 0
    total = 0.0
    while (match := _DURATION_PART.match(text, pos)) is not None:
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ValueError(f"{value!r} is not a duration (examples: 90s, 10m, 8h, 1h30m)")
    if total > MAX_DURATION_S:
        raise ValueError(f"a duration is at most {MAX_DURATION_S / 86400:.0f} days")
    return total


def format_duration(seconds: float) -> str:
    """A duration as people write it in a config: 1h, 5m, 90s (the largest unit that divides it)."""
    if seconds > 0 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds > 0 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"
