"""CUDA-graph capture sizes from a tokens-per-step histogram, and the re-capture policy."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from soakd.collectors.engine import quantile_of_counts
from soakd.policies.recapture import (
    MAX_CANDIDATES,
    RecaptureAction,
    RecapturePolicy,
    RecaptureSettings,
    compute_capture_sizes,
    nearest_rank,
    padding_stats,
)
from soakd.testing import least_time

# --- compute_capture_sizes on hand histograms --------------------------------------------------------


def test_two_values_two_sizes() -> None:
    assert compute_capture_sizes({3: 10, 7: 10}, max_sizes=2) == [3, 7]
    assert compute_capture_sizes({3: 10, 7: 10}, max_sizes=12) == [3, 7]


def test_one_size_is_the_quantile() -> None:
    assert compute_capture_sizes({3: 10, 7: 10}, max_sizes=1) == [7]


def test_quantile_cut_leaves_outliers_eager() -> None:
    hist = {4: 500, 16: 490, 5000: 10}  # p99 of 1000 steps is rank 990: 16
    sizes = compute_capture_sizes(hist, quantile=0.99)
    assert sizes == [4, 16]
    assert padding_stats(hist, sizes).hit_rate == pytest.approx(0.99)
    assert compute_capture_sizes(hist, quantile=1.0) == [4, 16, 5000]


def test_dp_picks_least_padding() -> None:
    # Two sizes: [1, 4] pads 3 tokens (2->4, 3->4); [2, 4] pads 100, [3, 4] pads 201.
    assert compute_capture_sizes({1: 100, 2: 1, 3: 1, 4: 100}, max_sizes=2, quantile=1.0) == [1, 4]
    # Three sizes: [1, 3, 4] pads 1 (2->3), [1, 2, 4] pads 2 (3->4 twice).
    assert compute_capture_sizes({1: 100, 2: 1, 3: 2, 4: 100}, max_sizes=3, quantile=1.0) == [1, 3, 4]


def test_align_rounds_every_size_up() -> None:
    assert compute_capture_sizes({3: 10, 7: 10}, align=8) == [8]
    assert compute_capture_sizes({3: 10, 9: 20, 17: 5}, align=8, quantile=1.0) == [8, 16, 24]
    # Two sizes: [8, 24] pads 50 + 300 + 35 = 385, [16, 24] pads 130 + 140 + 35 = 305.
    assert compute_capture_sizes({3: 10, 9: 20, 17: 5}, align=8, quantile=1.0, max_sizes=2) == [16, 24]


def test_max_size_caps_the_largest() -> None:
    assert compute_capture_sizes({10: 50, 100: 50}, quantile=1.0, max_size=64) == [10, 64]
    # The cap wins over the alignment: the largest size may be unaligned.
    assert compute_capture_sizes({10: 50, 100: 50}, quantile=1.0, max_size=60, align=8) == [16, 60]
    # Nothing under the cap: still one size, the cap.
    assert compute_capture_sizes({100: 5}, max_size=8) == [8]


def test_zero_counts_are_ignored() -> None:
    assert compute_capture_sizes({3: 10, 7: 10, 500: 0}) == [3, 7]


@pytest.mark.parametrize(
    ("hist", "kwargs"),
    [
        ({}, {}),
        ({5: 0}, {}),
        ({0: 3}, {}),
        ({5: -1}, {}),
        ({5: 1}, {"quantile": 0.0}),
        ({5: 1}, {"quantile": 1.5}),
        ({5: 1}, {"max_sizes": 0}),
        ({5: 1}, {"align": 0}),
        ({5: 1}, {"max_size": 0}),
    ],
)
def test_bad_input_raises(hist: dict[int, int], kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        compute_capture_sizes(hist, **kwargs)  # type: ignore[arg-type]


def test_many_distinct_values_are_bucketed_and_fast() -> None:
    hist = {v: 1 + (v * 7919) % 13 for v in range(1, 3 * MAX_CANDIDATES)}
    sizes = compute_capture_sizes(hist, quantile=1.0)
    # Bucketed: three times MAX_CANDIDATES distinct values cost about what MAX_CANDIDATES do (the search
    # grows faster than linearly in the values it is given: unbucketed, ~6x), timed alongside.
    at_max = {v: n for v, n in hist.items() if v <= MAX_CANDIDATES}
    many = least_time(lambda: compute_capture_sizes(hist, quantile=1.0), runs=3, calls=1)
    capped = least_time(lambda: compute_capture_sizes(at_max, quantile=1.0), runs=3, calls=1)
    assert many < 3 * capped, (many, capped)
    assert len(sizes) == 12
    assert sizes[-1] == 3 * MAX_CANDIDATES - 1
    assert (
        padding_stats(hist, sizes).padded_tokens
        <= padding_stats(hist, _naive(hist, 1.0, 12, None, 1)).padded_tokens
    )


# --- padding_stats ------------------------------------------------------------------------------------


def test_padding_stats_by_hand() -> None:
    stats = padding_stats({3: 10, 5: 4, 7: 6, 40: 2}, [8, 4])
    assert stats.steps == 22
    assert stats.steps_in_graph == 20
    assert stats.hit_rate == pytest.approx(20 / 22)
    # Tokens 30 + 20 + 42 + 80 = 172, of which 92 in graph steps.
    assert stats.token_hit_rate == pytest.approx(92 / 172)
    # Padding 3->4 x10, 5->8 x4, 7->8 x6 = 10 + 12 + 6.
    assert stats.padded_tokens == 28
    assert stats.padding_waste == pytest.approx(28 / 120)


def test_padding_stats_without_graphs_or_steps() -> None:
    eager = padding_stats({3: 10}, [])
    assert (eager.steps, eager.steps_in_graph, eager.hit_rate, eager.padded_tokens) == (10, 0, 0.0, 0)
    assert eager.padding_waste == 0.0
    empty = padding_stats({}, [4])
    assert (empty.steps, empty.hit_rate, empty.token_hit_rate, empty.padding_waste) == (0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        padding_stats({3: 1}, [0, 4])


# --- properties -------------------------------------------------------------------------------------

hists = st.dictionaries(st.integers(1, 300), st.integers(1, 50), min_size=1, max_size=40)
quantiles = st.sampled_from([0.5, 0.9, 0.95, 0.99, 1.0]) | st.floats(0.01, 1.0)


def _top(hist: dict[int, int], quantile: float, max_size: int | None, align: int) -> int:
    top = -(-quantile_of_counts(hist, quantile) // align) * align
    return top if max_size is None else min(top, max_size)


def _naive(
    hist: dict[int, int], quantile: float, max_sizes: int, max_size: int | None, align: int
) -> list[int]:
    """Powers of two (times align) below the largest size, plus it, the largest max_sizes of them."""
    top = _top(hist, quantile, max_size, align)
    below = [align << e for e in range(64) if align << e < top]
    return [*below, top][-max_sizes:]


@settings(max_examples=200, deadline=None)
@given(hists, quantiles, st.integers(1, 8), st.sampled_from([1, 2, 8, 16]), st.none() | st.integers(1, 400))
def test_sizes_properties(
    hist: dict[int, int], quantile: float, max_sizes: int, align: int, max_size: int | None
) -> None:
    sizes = compute_capture_sizes(
        hist, quantile=quantile, max_sizes=max_sizes, max_size=max_size, align=align
    )
    top = _top(hist, quantile, max_size, align)
    assert sizes == sorted(set(sizes))
    assert sizes[0] >= 1
    assert 1 <= len(sizes) <= max_sizes
    assert sizes[-1] == top
    assert all(size % align == 0 for size in sizes[:-1])
    # Every step up to the quantile runs under a graph.
    stats = padding_stats(hist, sizes)
    assert stats.steps_in_graph == sum(c for v, c in hist.items() if v <= top)
    naive = padding_stats(hist, _naive(hist, quantile, max_sizes, max_size, align))
    assert stats.padded_tokens <= naive.padded_tokens
    assert stats.hit_rate == naive.hit_rate


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.integers(1, 12), st.integers(1, 20), min_size=1, max_size=12), st.integers(1, 4))
def test_sizes_are_optimal_by_brute_force(hist: dict[int, int], max_sizes: int) -> None:
    sizes = compute_capture_sizes(hist, quantile=1.0, max_sizes=max_sizes)
    top = max(hist)
    best = min(
        padding_stats(hist, [*below, top]).padded_tokens
        for n in range(max_sizes)
        for below in itertools.combinations(range(1, top), n)
    )
    assert padding_stats(hist, sizes).padded_tokens == best


@settings(max_examples=200, deadline=None)
@given(hists, quantiles)
def test_nearest_rank_matches_the_collector(hist: dict[int, int], quantile: float) -> None:
    assert nearest_rank(hist, quantile) == quantile_of_counts(hist, quantile)


# --- RecapturePolicy --------------------------------------------------------------------------------

SETTINGS = RecaptureSettings(idle_s=60, min_steps=100, cooldown_s=1800, long_idle_s=3600)
OLD_SIZES = (1, 2, 4, 8)
# Half the steps above 8 tokens: graph hit rate 0.5 under OLD_SIZES.
NIGHT = {3: 50, 8: 50, 30: 60, 60: 40}


def _policy(hist: dict[int, int] | None = None, s: RecaptureSettings = SETTINGS) -> RecapturePolicy:
    policy = RecapturePolicy(s, OLD_SIZES)
    policy.observe_steps(NIGHT if hist is None else hist)
    return policy


def test_no_action_while_busy() -> None:
    policy = _policy()
    assert policy.decide(10_000.0, 0.0) is None
    assert policy.decide(10_000.0, 59.0) is None


def test_no_action_before_min_steps() -> None:
    policy = _policy({3: 20, 60: 79})
    assert policy.decide(0.0, 100.0) is None
    policy.observe_steps({60: 1})
    assert policy.decide(0.0, 100.0) is not None


def test_action_when_idle_with_a_low_hit_rate() -> None:
    action = _policy().decide(500.0, 60.0)
    assert isinstance(action, RecaptureAction)
    assert action.sizes == (3, 8, 30, 60)
    assert action.previous == OLD_SIZES
    assert action.t_s == 500.0
    assert action.reason == (
        "graph hit rate 0.50 < 0.90 over 200 steps; new sizes cover 1.00 of steps with 0% padding"
    )
    assert action.evidence == {
        "steps": 200,
        "hit_rate": 0.5,
        "new_hit_rate": 1.0,
        "padding_waste": pytest.approx(50 / 600),  # 3 -> 4 pads 50 of 150 + 50 + 400 slots
        "new_padding_waste": 0.0,
        "quantile_tokens": 60,
        "idle_for_s": 60.0,
    }
    json.dumps(action.evidence)


def test_same_action_until_reported_then_window_resets() -> None:
    policy = _policy()
    first = policy.decide(500.0, 60.0)
    assert first is not None
    assert policy.decide(501.0, 61.0) == RecaptureAction(
        first.sizes, first.previous, first.reason, {**first.evidence, "idle_for_s": 61.0}, 501.0
    )
    policy.applied(502.0, first.sizes)
    assert policy.current_sizes == first.sizes
    assert policy.last_capture_s == 502.0
    assert policy.window_steps == 0
    assert policy.window() == {}


def test_no_action_in_cooldown() -> None:
    policy = _policy()
    policy.applied(1000.0, OLD_SIZES)  # a capture that kept the sizes that fit badly
    policy.observe_steps(NIGHT)
    assert policy.decide(1000.0 + 1799.0, 100.0) is None
    assert policy.decide(1000.0 + 1800.0, 100.0) is not None


def test_failed_starts_the_cooldown_and_keeps_sizes_and_window() -> None:
    policy = _policy()
    assert policy.decide(100.0, 60.0) is not None
    policy.failed(100.0)
    assert policy.current_sizes == OLD_SIZES
    assert policy.window_steps == 200
    assert policy.last_capture_s is None
    assert policy.decide(200.0, 60.0) is None
    assert policy.decide(1900.0, 60.0) is not None


def test_action_after_long_idle_when_traffic_changed() -> None:
    # The sizes cover every step (hit rate 1.0) but pad 100 -> 128 and 200 -> 256.
    policy = RecapturePolicy(SETTINGS, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    policy.observe_steps({100: 200, 200: 200})
    assert policy.decide(0.0, 3599.0) is None  # good hit rate, not idle long enough
    action = policy.decide(0.0, 3600.0)
    assert action is not None
    assert action.sizes == (100, 200)
    assert action.evidence["padding_waste"] == pytest.approx(16_800 / 76_800)
    assert action.reason == (
        "idle 3,600 s and traffic changed since the last capture: graph hit rate 1.00 -> 1.00, "
        "padding 22% -> 0% over 400 steps"
    )


def test_no_action_when_the_gain_is_too_small() -> None:
    # Long idle, traffic barely changed: 100 -> 101 padding only.
    policy = RecapturePolicy(SETTINGS, [101, 200])
    policy.observe_steps({100: 200, 200: 200})
    assert policy.decide(0.0, 4000.0) is None
    # Same sizes as proposed: nothing to do.
    same = RecapturePolicy(SETTINGS, [100, 200])
    same.observe_steps({100: 200, 200: 200})
    assert same.decide(0.0, 4000.0) is None
    # Low hit rate, but the quantile size set only lifts it from 0.95 to 0.97.
    low = RecaptureSettings(min_steps=100, min_hit_rate=0.99, quantile=0.97)
    hist = {10: 95, 12: 2, 1000: 3}
    policy = RecapturePolicy(low, [10])
    policy.observe_steps(hist)
    assert policy.decide(0.0, 100.0) is None
    policy = RecapturePolicy(
        RecaptureSettings(min_steps=100, min_hit_rate=0.99, quantile=0.97, min_gain=0.02), [10]
    )
    policy.observe_steps(hist)
    action = policy.decide(0.0, 100.0)
    assert action is not None
    assert action.sizes == (10, 12)


def test_less_padding_does_not_buy_lower_coverage_below_the_floor() -> None:
    hist = {10: 90, 200: 10}  # current [256] covers all, but pads 246 tokens on 90% of steps
    keep = RecapturePolicy(RecaptureSettings(min_steps=100, min_hit_rate=0.9, quantile=0.9), [256])
    keep.observe_steps(hist)
    action = keep.decide(0.0, 3600.0)
    assert action is not None
    assert action.sizes == (10,)
    strict = RecapturePolicy(RecaptureSettings(min_steps=100, min_hit_rate=0.95, quantile=0.9), [256])
    strict.observe_steps(hist)
    assert strict.decide(0.0, 3600.0) is None


def test_state_round_trip() -> None:
    policy = _policy()
    policy.applied(1_700_000_000.0, (3, 8, 30, 60))
    policy.failed(1_700_000_100.0)
    state = json.loads(json.dumps(policy.to_state()))
    assert state == {
        "sizes": [3, 8, 30, 60],
        "last_capture_s": 1_700_000_000.0,
        "cooldown_from_s": 1_700_000_100.0,
    }
    back = RecapturePolicy.from_state(state, SETTINGS)
    assert back.current_sizes == (3, 8, 30, 60)
    assert back.last_capture_s == 1_700_000_000.0
    assert back.to_state() == state
    back.observe_steps({3: 10, 500: 190})
    assert back.decide(1_700_000_100.0 + 1799.0, 100.0) is None  # the cooldown survived the restart
    assert back.decide(1_700_000_100.0 + 1800.0, 100.0) is not None
    fresh = RecapturePolicy.from_state(RecapturePolicy(SETTINGS, [4]).to_state())
    assert fresh.to_state() == {"sizes": [4], "last_capture_s": None, "cooldown_from_s": None}


@pytest.mark.parametrize(
    "state",
    [{}, {"sizes": "1,2"}, {"sizes": [1, True]}, {"sizes": [0]}, {"sizes": [1], "last_capture_s": "x"}],
)
def test_bad_state_raises(state: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RecapturePolicy.from_state(state)


def test_a_clock_before_the_cooldown_start_waits_one_cooldown() -> None:
    policy = _policy()
    policy.failed(1_700_000_000.0)  # wall time, then decide() is fed a new origin
    assert policy.decide(5.0, 100.0) is None
    assert policy.decide(5.0 + 1800.0, 100.0) is not None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"idle_s": -1},
        {"cooldown_s": -1},
        {"idle_s": 100, "long_idle_s": 50},
        {"min_hit_rate": 1.5},
        {"min_gain": -0.1},
        {"min_steps": 0},
        {"quantile": 0.0},
        {"max_sizes": 0},
        {"align": 0},
        {"max_size": 0},
    ],
)
def test_bad_settings_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RecaptureSettings(**kwargs)  # type: ignore[arg-type]
