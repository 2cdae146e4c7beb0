"""Every pattern soakd matches against input (criteria checks, durations, config lines, text to redact)
takes time linear in the input: 100 times the length costs about 100 times the time (a few hundred
with the caches a 200 kB input no longer fits), where a pattern that backtracks costs 10 000 times
(quadratic) or more. Measured as a ratio within the test,
never against a wall-clock threshold, on the shapes that made each pattern backtrack."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from soakd.config import _find_line
from soakd.lang.criteria import MAX_TOKEN_CHARS, _tokens, parse_check
from soakd.redact import redact_text
from soakd.units import _DURATION_PART, parse_duration

SHORT = 2_000
LONG = 200_000
MAX_RATIO = 1000.0  # for 100 times the length: linear is ~100-300, quadratic ~10 000


def _cost(fn: Callable[[str], object], text: str) -> float:
    """The least time of a few calls of fn(text) (an exception is an answer too)."""
    best = float("inf")
    gc.disable()  # a collection's pause is not the pattern's cost
    try:
        for _ in range(5):
            t0 = time.perf_counter()
            with contextlib.suppress(ValueError):
                fn(text)
            best = min(best, time.perf_counter() - t0)
    finally:
        gc.enable()
    return best


def _duration_parts(text: str) -> int:
    # The duration pattern as parse_duration walks it, without parse_duration's length bound.
    pos = 0
    while (m := _DURATION_PART.match(text, pos)) is not None:
        pos = m.end()
    return pos


def _tokenize(text: str) -> int:
    # The criteria tokenizer on a long text: its length bound on tokens is checked after each match, so
    # feed it many short tokens ended by the hostile one.
    return len(_tokens(text))


PARSERS: dict[str, Callable[[str], object]] = {
    "criteria-tokens": _tokenize,
    "duration-parts": _duration_parts,
    "config-find-line": lambda text: _find_line(text, ["x"]),
    "redact-text": redact_text,
}
# Unit strings repeated to the length, each with a tail that makes a backtracking pattern fail late.
SHAPES: list[tuple[str, str, str, str]] = [
    ("criteria-tokens", "", "1", "x"),  # digits then a letter: the number pattern tried every split
    ("criteria-tokens", "", "1.", "x"),
    ("criteria-tokens", "", "1e1", "."),
    ("criteria-tokens", "", "a", "!"),
    ("criteria-tokens", "", "1 ", "x"),
    ("duration-parts", "", "1", "x"),
    ("duration-parts", "", "1.1", "x"),
    ("config-find-line", "[", " ", "x"),  # a header's name between optional spaces: cubic
    ("config-find-line", "[a", " a", " "),
    ("config-find-line", "", "a", " "),
    ("redact-text", "", "a.", ":/"),  # a scheme tried at every word boundary of one long run
    ("redact-text", "http://", "a", ""),
    ("redact-text", "", "a-", "://"),
]


def _text(head: str, unit: str, tail: str, length: int) -> str:
    return head + unit * ((length - len(head) - len(tail)) // len(unit)) + tail


@pytest.mark.parametrize(("parser", "head", "unit", "tail"), SHAPES, ids=[f"{s[0]}-{s[2]!r}" for s in SHAPES])
def test_each_input_pattern_is_linear(parser: str, head: str, unit: str, tail: str) -> None:
    fn = PARSERS[parser]
    short = _cost(fn, _text(head, unit, tail, SHORT))
    long = _cost(fn, _text(head, unit, tail, LONG))
    assert long < MAX_RATIO * max(short, 1e-6), (parser, unit, short, long)


@settings(max_examples=20, deadline=None)
@given(
    st.text(alphabet="0123456789.eE+-_ax(),=<> ", min_size=1, max_size=8), st.sampled_from(sorted(PARSERS))
)
def test_any_repeated_unit_is_linear(unit: str, parser: str) -> None:
    fn = PARSERS[parser]
    short = _cost(fn, _text("", unit, "x", SHORT))
    long = _cost(fn, _text("", unit, "x", LONG))
    assert long < MAX_RATIO * max(short, 1e-6), (parser, unit, short, long)


def test_a_long_number_in_a_check_is_a_short_clear_error() -> None:
    number = "1" * (MAX_TOKEN_CHARS + 1)
    with pytest.raises(ValueError, match=f"a number of {MAX_TOKEN_CHARS + 1} characters"):
        parse_check(f"p99(ttft_ms) < {number}")
    with pytest.raises(ValueError, match="a duration of") as err:
        parse_check(f"min(tokens_per_s, window={number}x) > 1")
    with pytest.raises(ValueError, match="a check is at most") as huge:
        parse_check("p99(ttft_ms) < " + "1" * 100_000 + "x")
    assert len(str(err.value)) < 200 and len(str(huge.value)) < 200


def test_a_long_duration_is_refused_by_length() -> None:
    with pytest.raises(ValueError, match="a duration of 100000 characters"):
        parse_duration("1" * 100_000)
    assert parse_duration("1h30m") == 5400.0
