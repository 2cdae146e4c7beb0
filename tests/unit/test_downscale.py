"""The batch policy: driven by the throttle detector over recorded H200 telemetry, by noisy synthetic
input through the same detector, and by hand-made sequences for the floor, the ceiling and the state."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.nvml import NvmlCollector, RecordedNvml
from soakd.policies.downscale import BatchAction, BatchPolicy, BatchSettings
from soakd.policies.throttle import ThrottleDetector, ThrottleInput, ThrottleSettings, ThrottleState

PHASES = Path(__file__).parents[1] / "data" / "h200" / "phases" / "nvml_phases.jsonl.gz"


def replay_phases(settings: BatchSettings) -> tuple[list[BatchAction], list[tuple[float, str]]]:
    """The H200 phases recording (idle 10 s, load 20 s, idle 15 s, load 20 s, idle 15 s) through the
    collector and the detector at 10 Hz; the policy decides once a second on the detector's state."""
    t = [0.0]
    source = RecordedNvml(PHASES, lambda: t[0])
    transitions: list[tuple[float, str]] = []
    watch = GpuThrottleWatch(
        {0: source.static(0).max_sm_mhz},
        lambda kind, _msg, **_f: transitions.append((t[0], kind)),
        ThrottleSettings(min_dwell_s=2.0, recover_s=5.0),
    )
    collector = NvmlCollector(source, on_fast=watch.observe)
    policy = BatchPolicy(settings)
    actions: list[BatchAction] = []
    k = 0
    while not source.finished:
        collector.sample_fast(t[0])
        if k % 10 == 0:
            collector.sample_slow()
            throttled = watch._detectors[0].state is ThrottleState.THROTTLED
            actions += policy.update(t[0], throttled, tokens=100.0, interval_s=1.0)
        k += 1
        t[0] = k / 10
    return actions, transitions


def test_recorded_h200_power_cap_downscales_within_the_dwell_and_upscales_after_the_cool_down() -> None:
    settings = BatchSettings(start=16, floor=4, step=0.25, dwell_s=5.0, settle_s=8.0, cooldown_s=6.0)
    actions, transitions = replay_phases(settings)
    enters = [t for t, kind in transitions if kind == "throttle_enter"]
    assert len(enters) == 2  # one per load phase
    downs = [a for a in actions if a.kind == "downscale"]
    ups = [a for a in actions if a.kind == "upscale"]
    # The first downscale comes once the detector has held "throttled" for the dwell (polled each second).
    assert enters[0] + 5.0 <= downs[0].t_s <= enters[0] + 6.0
    assert (downs[0].from_limit, downs[0].to_limit) == (16, 12)
    assert "throttled for" in downs[0].reason and downs[0].evidence["throttled_for_s"] >= 5.0
    # Settle between downscales: never two within 8 s, and each step is a quarter of the ceiling.
    for a, b in itertools.pairwise(downs):
        assert b.t_s - a.t_s >= 8.0 and b.to_limit == max(4, a.to_limit - max(1, a.to_limit // 4))
    # The idle phases are quiet for longer than the cool-down: the ceiling comes back up, not above 16.
    assert ups and all(a.to_limit <= 16 for a in ups)
    assert all(a.to_limit >= 4 for a in actions)
    # No flapping: actions alternate direction at most once per phase change (4 changes in the recording).
    flips = sum(1 for a, b in itertools.pairwise(actions) if a.kind != b.kind)
    assert flips <= 4


def test_noisy_throttling_through_the_detector_does_not_flap() -> None:
    rng = random.Random(7)
    det = ThrottleDetector(ThrottleSettings(min_dwell_s=5.0, recover_s=20.0), max_mhz=1980)
    policy = BatchPolicy(BatchSettings(start=32, floor=8, dwell_s=10.0, settle_s=20.0, cooldown_s=60.0))
    actions: list[BatchAction] = []
    t = 0.0
    for k in range(int(600 / 0.1)):
        t = k * 0.1
        noisy = t < 300  # 5 min of a power cap flickering in 60 % of samples, then 5 min quiet
        cap = noisy and rng.random() < 0.6
        mhz = (1450 if cap else 1900) + rng.uniform(-30, 30)
        det.update(ThrottleInput(t, mhz, 0x4 if cap else 0, active=True))
        if k % 10 == 0:
            actions += policy.update(t, det.state is ThrottleState.THROTTLED, 50.0, 1.0)
    downs = [a for a in actions if a.kind == "downscale"]
    ups = [a for a in actions if a.kind == "upscale"]
    assert downs and all(a.t_s < 300 for a in downs)
    assert all(a.t_s > 300 for a in ups)  # never up while the cap flickers
    assert [a.kind for a in actions] == ["downscale"] * len(downs) + ["upscale"] * len(ups)
    assert min(a.to_limit for a in actions) >= 8


def test_floor_and_start_bound_the_ceiling() -> None:
    policy = BatchPolicy(BatchSettings(start=4, floor=2, step=0.5, dwell_s=1, settle_s=1, cooldown_s=5))
    limits = []
    for t in range(20):
        for a in policy.update(float(t), throttled=True):
            limits.append(a.to_limit)
    assert limits == [2] and policy.limit == 2  # 4 -> 2, then the floor
    for t in range(20, 100):
        for a in policy.update(float(t), throttled=False):
            limits.append(a.to_limit)
    assert limits == [2, 3, 4] and policy.limit == 4  # step of at least one, never above the start


def test_a_level_that_throttles_again_after_an_upscale_is_blocked() -> None:
    s = BatchSettings(start=8, floor=1, step=0.25, dwell_s=2, settle_s=2, cooldown_s=10, retry_s=100)
    policy = BatchPolicy(s)
    acts: list[BatchAction] = []
    t = 0
    for _ in range(3):  # throttled: 8 -> 6
        acts += policy.update(float(t), True)
        t += 1
    assert policy.limit == 6
    while policy.limit < 8:  # quiet: back to 7, 8
        acts += policy.update(float(t), False)
        t += 1
    up_at = t
    for _ in range(3):  # throttles again right after reaching 8
        acts += policy.update(float(t), True)
        t += 1
    assert policy.limit == 6 and t - up_at < s.cooldown_s
    last = acts[-1]
    assert last.kind == "downscale" and last.evidence["blocked_levels"] == "8"
    while t < up_at + 60:  # quiet again: 6 -> 7, but 8 stays blocked
        acts += policy.update(float(t), False)
        t += 1
    assert policy.limit == 7
    while t < up_at + 130:  # after retry_s, 8 is tried again
        acts += policy.update(float(t), False)
        t += 1
    assert policy.limit == 8


def test_sustained_point_and_throughput_per_level_and_state_round_trip() -> None:
    policy = BatchPolicy(BatchSettings(start=8, dwell_s=1, settle_s=1, cooldown_s=1000, sustain_s=30))
    for t in range(3):
        policy.update(float(t), True, tokens=500, interval_s=1)
    assert policy.limit == 6
    for t in range(3, 40):
        policy.update(float(t), False, tokens=600, interval_s=1)
    assert policy.sustained is not None and policy.sustained["limit"] == 6
    # Level 6 from the downscale at t=1: one more throttled second at 500, then 37 quiet ones at 600.
    assert policy.sustained["tokens_per_s"] == pytest.approx((500 + 600 * 37) / 38, abs=1e-3)
    assert policy.tokens_per_s(8) == pytest.approx(500.0)
    state = policy.to_state(now_s=40.0)
    back = BatchPolicy.from_state(policy.settings, state, now_s=1000.0)  # another clock after a restart
    assert back.limit == 6 and back.sustained == policy.sustained and back.actions == 1
    assert back.to_state(now_s=1000.0) == state
    with pytest.raises(ValueError):
        BatchSettings(start=4, floor=5)
