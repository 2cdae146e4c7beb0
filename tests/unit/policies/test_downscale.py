"""The batch policy: recorded H200 telemetry through the collector, the harm judge and the policy, and
hand-made worlds in which a downscale pays or does not, for the trial, the revert, the block, the
upscale, dry run and the saved state."""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.nvml import NvmlCollector, RecordedNvml
from soakd.policies.downscale import (
    ActionResult,
    BatchAction,
    BatchPolicy,
    BatchSettings,
    Tick,
    TrialSkipped,
    objective_se,
    objective_value,
    wait_reach,
)

PHASES = Path(__file__).parents[2] / "data" / "h200" / "phases" / "nvml_phases.jsonl.gz"

Out = list[BatchAction | ActionResult | TrialSkipped]


@dataclass
class World:
    """A served workload: tokens/s and goodput as functions of the ceiling in force and the harm."""

    tps: Callable[[int, bool], float]
    good_share: Callable[[int, bool], float] = lambda _limit, _harm: 1.0
    demand: int = 100
    """Requests that want to run: the ceiling binds below this."""


def drive(
    policy: BatchPolicy,
    world: World,
    harm: Callable[[float], bool],
    seconds: int,
    t0: float = 0.0,
    source: str = "",
) -> tuple[Out, list[int]]:
    out: Out = []
    limits: list[int] = []
    for i in range(1, seconds + 1):
        t = t0 + i
        h = harm(t)
        level = policy.in_force
        tokens = world.tps(level, h)
        tick = Tick(
            t_s=t,
            interval_s=1.0,
            harm=h,
            harm_kind="power" if h else "",
            harm_source=source if h else "",
            binding=world.demand > level,
            tokens=tokens,
            good_tokens=tokens * world.good_share(level, h),
        )
        out += policy.update(tick)
        limits.append(policy.in_force)
    return out, limits


def actions(out: Out, kind: str | None = None) -> list[BatchAction]:
    return [a for a in out if isinstance(a, BatchAction) and (kind is None or a.kind == kind)]


def results(out: Out) -> list[ActionResult]:
    return [r for r in out if isinstance(r, ActionResult)]


def trials(out: Out) -> list[BatchAction]:
    """The downscales that start a trial (not the re-application of a level kept after one)."""
    return [a for a in actions(out, "downscale") if "trial_leg" not in a.evidence]


def legs(out: Out) -> list[BatchAction]:
    """The reverts that start a trial's A' leg (back to the level before, not a verdict)."""
    return [a for a in actions(out, "revert") if a.evidence.get("trial_leg") == "A'"]


SETTINGS = BatchSettings(
    start=16,
    floor=4,
    objective="tokens",
    dwell_s=10,
    settle_s=10,
    eval_s=20,
    recover_s=30,
    retry_s=600,
)


def _kw(s: BatchSettings) -> dict[str, object]:
    return {name: getattr(s, name) for name in s.__dataclass_fields__}


GOODPUT = BatchSettings(**{**_kw(SETTINGS), "objective": "goodput"})


def test_a_downscale_that_does_not_pay_is_reverted_and_its_level_blocked() -> None:
    # Bandwidth-bound decode at the power cap: a smaller batch only gives up tokens (the H200 case).
    world = World(tps=lambda limit, harm: 200.0 * limit * (0.8 if harm else 1.0))
    policy = BatchPolicy(SETTINGS)
    out, limits = drive(policy, world, lambda t: 20 <= t < 400, 420)
    downs, reverts = actions(out, "downscale"), actions(out, "revert")
    assert len(downs) == 1 and (downs[0].from_limit, downs[0].to_limit) == (16, 12)
    # Harm from 20 s: dwell 10 s and a full 20 s before-window under harm.
    assert 39 <= downs[0].t_s <= 40
    assert downs[0].evidence["objective_before"] == 200.0 * 16 * 0.8
    # A-B-A: after settle 10 s + eval 20 s at 12 (B), back to 16 for the A' leg, not a verdict.
    assert len(reverts) == 1 and reverts == legs(out) and reverts[0].to_limit == 16
    assert reverts[0].t_s == downs[0].t_s + 30 and "not a verdict" in reverts[0].reason
    (res,) = results(out)
    # The verdict after settle + eval at 16 again (A'): B below both A legs, beyond a noise of 0.
    assert res.t_s == reverts[0].t_s + 30 and res.decided_by == "aba_bracket" and res.verdict == "no_gain"
    assert not res.kept and res.before == res.again == 2560.0 and res.after == 200.0 * 12 * 0.8
    assert res.noise == 0.0 and res.blocked_s == SETTINGS.retry_s
    # 12 is blocked for retry_s: no second trial during the rest of the harm (400 s), and 16 held.
    assert limits[-1] == 16 and policy.reverted == 1 and policy.kept == 0 and policy.inconclusive == 0
    assert policy._blocked == {12: res.t_s + SETTINGS.retry_s}
    assert sum(1 for x in limits if x < 16) == 30  # the trial's cost: 30 s at 12 (the B leg)
    assert policy.levels()["12"]["seconds"] == 30.0


def test_a_downscale_that_pays_is_kept_and_the_next_step_is_tried() -> None:
    # An edge GPU: the big batch's clock loss costs more than the batch gives (12 serves best).
    best = {16: 1000.0, 12: 1400.0, 9: 1100.0}
    world = World(tps=lambda limit, harm: best.get(limit, 500.0) if harm else 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, limits = drive(policy, world, lambda t: 10 <= t < 300, 300)
    res = results(out)
    assert [(r.from_limit, r.to_limit, r.kept) for r in res] == [(16, 12, True), (12, 9, False)]
    assert res[0].after == 1400.0 and res[0].before == res[0].again == 1000.0 and res[0].verdict == "gain"
    assert res[1].verdict == "no_gain" and res[1].again == 1400.0
    # Each trial goes back for its A' leg; the kept one is re-applied at its verdict.
    assert [a.to_limit for a in legs(out)] == [16, 12] and actions(out, "revert") == legs(out)
    (again,) = [a for a in actions(out, "downscale") if a not in trials(out)]
    assert (again.from_limit, again.to_limit, again.t_s) == (16, 12, res[0].t_s)
    assert again.reason.startswith("kept after A-B-A") and again.evidence["trial_leg"] == "kept"
    assert [(a.from_limit, a.to_limit) for a in trials(out)] == [(16, 12), (12, 9)]
    assert limits[-1] == 12 and policy.kept == 1 and policy.reverted == 1


def test_no_action_without_harm_or_when_the_ceiling_does_not_bind() -> None:
    world = World(tps=lambda limit, harm: 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, _ = drive(policy, world, lambda t: False, 300)
    assert out == []
    # Harmful, but only 8 requests want to run under a ceiling of 16: lowering it changes nothing.
    world = World(tps=lambda limit, harm: 800.0, demand=8)
    policy = BatchPolicy(SETTINGS)
    out, _ = drive(policy, world, lambda t: True, 300)
    assert out == []


def test_the_ceiling_goes_back_to_the_level_before_the_harm_in_one_step_once_it_is_gone() -> None:
    world = World(tps=lambda limit, harm: (3000.0 - 100.0 * limit) if harm else 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    # Each A-B-A trial takes 60 s (B and A' legs) and the next one 30 s after it: two kept trials by
    # 179 s, the third (9 -> 7) begins at 209 s and the harm ends 6 s into it (at 215 s).
    out, limits = drive(policy, world, lambda t: 10 <= t < 215, 500)
    downs = [(a.from_limit, a.to_limit) for a in trials(out)]
    assert downs == [(16, 12), (12, 9), (9, 7)]
    # The harm ended during the last trial's B leg: in the same tick the ceiling is back at 16 in one
    # step (12 and 9 were kept for the harm that is over), measured, nothing blocked.
    (up,) = actions(out, "upscale")
    assert (up.from_limit, up.to_limit) == (7, 16) and up.t_s == 215
    assert up.evidence["levels_skipped"] == "9,12" and "the level before the harm" in up.reason
    assert "the harm ended during the trial of 7" in up.reason
    assert limits[int(up.t_s) - 1 :] == [16] * (500 - int(up.t_s) + 1)
    (measured,) = [r for r in results(out) if r.kind == "upscale"]
    # Measured, never judged; the seconds before it were the trial's B leg, under the harm: no "before".
    assert measured.kept and measured.after is not None and measured.before is None
    assert "objective_before" not in up.evidence and policy._path == [] and policy._blocked == {}


def test_the_way_back_stops_under_a_blocked_level_and_takes_it_once_its_block_runs_out() -> None:
    world = World(tps=lambda limit, harm: (3000.0 - 100.0 * limit) if harm else 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    # Two trials kept by 179 s; the harm ends at 185 s, before a third begins.
    out, _ = drive(policy, world, lambda t: 10 <= t < 185, 190)
    assert [(a.from_limit, a.to_limit) for a in trials(out)] == [(16, 12), (12, 9)]
    assert policy.limit == 9 and policy._path == [16, 12] and not policy.trial
    policy._blocked[16] = 400.0  # as if 16 had brought harm back earlier
    more, limits = drive(policy, world, lambda _t: False, 400, t0=190)
    ups = [(a.from_limit, a.to_limit) for a in actions(more, "upscale")]
    # 15, the highest level under the blocked 16, in one step (12 skipped); 16 once its block ran out.
    assert ups == [(9, 15), (15, 16)]
    first, second = actions(more, "upscale")
    assert "16, the level before the harm, is blocked" in first.reason
    assert first.evidence["levels_skipped"] == "12" and second.t_s >= 400.0
    assert limits[-1] == 16 and policy._path == []


def test_harm_that_ends_during_the_trial_is_inconclusive_and_the_ceiling_returns_at_once() -> None:
    # Seen on an H200: the outside load ended 14 s into a trial; the cool-down then cost 30 s at 12. On
    # an H100 the settle wait that replaced it still held 36 for 11 s after the harm had ended.
    world = World(tps=lambda limit, harm: 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, limits = drive(policy, world, lambda t: 10 <= t < 45, 200)
    (down,) = actions(out, "downscale")
    (res, up) = (
        r for r in out if r not in (down,) and not (isinstance(r, ActionResult) and r.kind == "upscale")
    )
    assert isinstance(res, ActionResult) and not res.kept and res.after is None and "ended" in res.reason
    assert res.decided_by == "harm_ended" and res.verdict == "inconclusive" and res.blocked_s == 0
    assert res.t_s == 45 and actions(out, "revert") == [] and policy.kept == 0
    assert isinstance(up, BatchAction) and up.kind == "upscale" and up.t_s == 45 and up.to_limit == 16
    assert sum(1 for x in limits if x < 16) == up.t_s - down.t_s
    assert policy._blocked == {}  # never judged: not blocked


def test_harm_back_before_a_cut_short_trials_way_back_restores_the_cool_down() -> None:
    # The way back after a cut-short trial comes at once only while the harm stays over: here every level
    # above 12 is blocked when the harm ends (no way back yet), the harm returns for 3 s, and once it is
    # over again the way back waits `recover_s` as after any harm, not the blocks' end.
    world = World(tps=lambda limit, harm: 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, _ = drive(policy, world, lambda t: 10 <= t <= 40, 40)
    (down,) = actions(out, "downscale")
    assert policy.trial and policy.in_force == down.to_limit == 12
    for level in range(13, 17):
        policy._blocked[level] = 60.0
    more, limits = drive(policy, world, lambda t: 47 <= t < 50, 120, t0=40)
    res, measured = results(more)
    assert res.decided_by == "harm_ended" and res.t_s == 41 and not actions(more, "downscale")
    assert measured.kind == "upscale" and measured.decided_by == "measured"
    (up,) = actions(more, "upscale")
    assert up.t_s == 50 + SETTINGS.recover_s and up.to_limit == 16
    assert set(limits[: int(up.t_s) - 41]) == {12}


def test_a_queue_that_empties_during_the_trial_is_no_evidence() -> None:
    # Seen on the CPU engine: a burst drained just as the ceiling went down; the "after" was an idle
    # engine. Not a verdict on the level: back up, nothing blocked.
    policy = BatchPolicy(SETTINGS)
    out: Out = []
    for i in range(1, 120):
        t = float(i)
        binding = t < 28
        level = policy.in_force
        out += policy.update(
            Tick(t, 1.0, True, "power", binding=binding, tokens=100.0 * level if binding else 5.0)
        )
    (down,) = actions(out, "downscale")
    (res,) = results(out)
    (back,) = actions(out, "revert")
    assert not res.kept and "stopped binding" in res.reason and back.to_limit == 16
    assert res.decided_by == "not_binding" and res.verdict == "no_evidence" and res.blocked_s == 0
    assert "trial_leg" not in back.evidence  # a plain revert, not an A' leg
    assert policy._blocked == {} and policy.in_force == 16 and down.t_s < 28


def drive_in_time(
    policy: BatchPolicy,
    good: Callable[[float, int], float],
    seconds: int,
    harm: Callable[[float], bool] = lambda t: t >= 10,
) -> tuple[Out, list[int]]:
    """Every request waits for admission; `good(t, level)` is the goodput of the second ending at t with
    that ceiling in force: the drift of a growing queue, bursts, a level's own effect."""
    out: Out = []
    limits: list[int] = []
    for i in range(1, seconds + 1):
        t = float(i)
        h = harm(t)
        g = good(t, policy.in_force)
        out += policy.update(
            Tick(t, 1.0, h, "power" if h else "", binding=True, tokens=2000.0, good_tokens=g)
        )
        limits.append(policy.in_force)
    return out, limits


def test_a_falling_objective_with_a_move_that_does_nothing_is_inconclusive_and_only_briefly_blocked() -> None:
    # A queue that grows under harm: fewer requests meet the TTFT limit (from their due time) each second,
    # whatever the ceiling. A before/after reads the fall as the move's loss and blocks 12 for retry_s.
    policy = BatchPolicy(GOODPUT)
    out, _ = drive_in_time(policy, lambda t, _level: 2000.0 * (1 - t / 400), 300)
    first, second = results(out)[:2]
    assert first.decided_by == "aba_bracket" and first.verdict == "inconclusive" and not first.kept
    assert first.before is not None and first.after is not None and first.again is not None
    assert first.before > first.after > first.again  # B inside the bracket: the trend explains it
    assert first.after < first.before * (1 + GOODPUT.min_gain)  # what the old rule blocked for retry_s
    assert "inconclusive (drift), 12 blocked for 80 s" in first.reason
    # Blocked 2 x (dwell + settle + eval) = 80 s, not retry_s: then a fresh trial on fresh A legs.
    assert first.blocked_s == 80.0 < GOODPUT.retry_s
    assert [a.t_s for a in trials(out)][1] == first.t_s + 80.0
    # The next inconclusive verdict in a row on 12 doubles its block; none is a loss.
    assert second.verdict == "inconclusive" and second.blocked_s == 160.0
    assert policy.reverted == 0 and policy.kept == 0 and policy.inconclusive == len(results(out))
    assert policy.in_force == 16


def test_a_real_gain_beats_both_a_legs_beyond_the_noise_and_is_re_applied() -> None:
    # A falling background with +-5 % scatter per second; 12 serves 40 % more than 16 at any moment.
    rng = random.Random(7)

    def good(t: float, level: int) -> float:
        return 2000.0 * (1 - t / 1000) * (1.4 if level < 16 else 1.0) * rng.uniform(0.95, 1.05)

    policy = BatchPolicy(GOODPUT)
    out, limits = drive_in_time(policy, good, 100)
    assert [(a.kind, a.to_limit) for a in actions(out)] == [
        ("downscale", 12),
        ("revert", 16),
        ("downscale", 12),
    ]
    (res,) = results(out)
    assert res.verdict == "gain" and res.kept and res.decided_by == "aba_bracket" and res.blocked_s == 0
    assert res.before is not None and res.after is not None and res.again is not None
    assert res.noise is not None and 0 < res.noise < res.after - max(res.before, res.again)
    assert res.after >= max(res.before, res.again) * (1 + GOODPUT.min_gain)
    again = actions(out)[-1]
    assert again.t_s == res.t_s and again.reason.startswith("kept after A-B-A")
    assert limits[-1] == 12 and policy.kept == 1 and policy._path == [16] and policy._blocked == {}


def test_a_real_loss_on_a_flat_trend_blocks_the_level_for_retry() -> None:
    rng = random.Random(11)

    def good(_t: float, level: int) -> float:
        return 2000.0 * (0.8 if level < 16 else 1.0) * rng.uniform(0.95, 1.05)

    policy = BatchPolicy(GOODPUT)
    out, limits = drive_in_time(policy, good, 400)
    (res,) = results(out)
    assert res.verdict == "no_gain" and not res.kept and res.blocked_s == GOODPUT.retry_s
    assert res.before is not None and res.after is not None and res.again is not None
    assert res.noise is not None and 0 < res.noise < min(res.before, res.again) - res.after
    assert "no gain of 3%, 12 blocked for 600 s" in res.reason
    assert len(trials(out)) == 1 and policy._blocked == {12: res.t_s + GOODPUT.retry_s}
    assert limits[-1] == 16 and policy.reverted == 1 and policy.inconclusive == 0


@pytest.mark.parametrize("bursty", [False, True])
def test_goodput_that_collapses_at_both_levels_is_inconclusive_not_a_loss(bursty: bool) -> None:
    # Measured on an H200 (Llama-3.1-8B shape, a matmul process beside it): 64 -> 48 gave goodput 736/s
    # before, 0 at 48 and 23 back at 64, while advice-only (no move) fell 648 -> 23 over the same
    # windows: the queue only grows and every request misses the TTFT limit from its due time, at any
    # level. The old before/after blocked 48 for an hour. A' as 23 every second, or as one burst of 460.
    policy = BatchPolicy(BatchSettings(**{**_kw(GOODPUT), "start": 64, "floor": 16}))
    moved = [False]

    def good(t: float, level: int) -> float:
        if level < 64:
            moved[0] = True
            return 0.0
        if not moved[0]:
            return 736.0
        return (460.0 if int(t) % 20 == 0 else 0.0) if bursty else 23.0

    out, limits = drive_in_time(policy, good, 120)
    (res,) = results(out)
    assert (res.from_limit, res.to_limit, res.before, res.after) == (64, 48, 736.0, 0.0)
    assert res.again == pytest.approx(23.0)
    assert res.verdict == "inconclusive" and res.blocked_s == 80.0 and policy._blocked == {48: res.t_s + 80}
    if bursty:  # one burst in A': its noise (2 x 23) covers the 23 between A' and B
        assert res.noise == pytest.approx(46.0) and "inconclusive (drift)" in res.reason
    else:  # A' under a quarter of A: the objective collapsed for reasons outside the level
        assert res.reason == (
            "goodput 0 at 48 vs 736 before and 23 after at 64 (noise ±0): inconclusive (collapse), "
            "48 blocked for 80 s"
        )
    assert policy.reverted == 0 and limits[-1] == 64


def test_a_gain_within_the_measured_noise_is_inconclusive() -> None:
    # Goodput scatters +-30 % from second to second (requests finish in bursts); 12 gives 5 % more, above
    # min_gain (3 %), which a before/after would have kept, but inside twice the standard error.
    def good(t: float, level: int) -> float:
        return 1000.0 * (1.05 if level < 16 else 1.0) * (1.3 if int(t) % 2 else 0.7)

    policy = BatchPolicy(GOODPUT)
    out, limits = drive_in_time(policy, good, 100)
    (res,) = results(out)
    assert res.before == res.again == pytest.approx(1000.0) and res.after == pytest.approx(1050.0)
    assert res.noise is not None and res.after - 1000.0 < res.noise == pytest.approx(199.6, abs=0.1)
    assert res.verdict == "inconclusive" and "inconclusive (noise)" in res.reason and res.blocked_s == 80.0
    assert limits[-1] == 16 and [a.kind for a in actions(out)] == ["downscale", "revert"]


def test_harm_that_ends_during_the_a_prime_leg_leaves_the_level_before_and_blocks_nothing() -> None:
    world = World(tps=lambda limit, harm: 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, limits = drive(policy, world, lambda t: 10 <= t < 65, 200)
    (down,) = trials(out)
    (leg,) = legs(out)
    assert leg.t_s == down.t_s + 30 < 65
    (res,) = results(out)
    assert res.t_s == 65 and res.decided_by == "harm_ended" and res.verdict == "inconclusive"
    assert not res.kept and res.after == 1200.0 and res.again is None and "A' leg" in res.reason
    assert policy._blocked == {} and policy._path == [] and set(limits[int(leg.t_s) :]) == {16}
    assert [a.kind for a in actions(out)] == ["downscale", "revert"]


def test_a_restart_during_the_a_prime_leg_restores_the_level_before_and_no_block() -> None:
    world = World(tps=lambda limit, harm: 200.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, _ = drive(policy, world, lambda t: t >= 20, 75)
    (leg,) = legs(out)
    assert policy.trial and leg.t_s < 75 < leg.t_s + 30  # inside the A' leg
    state = json.loads(json.dumps(policy.to_state(now_s=75.0)))
    again = BatchPolicy.from_state(SETTINGS, state, now_s=1075.0)
    assert again.limit == 16 and not again.trial and again._path == [] and again._blocked == {}
    assert again.results == [] and again.reverted == again.kept == 0
    # Under the same harm the restored policy tries 12 afresh once the A' revert is settle + eval old.
    out, _ = drive(again, world, lambda t: True, 40, t0=1075.0)
    assert [(a.from_limit, a.to_limit) for a in trials(out)] == [(16, 12)]


def test_objective_se_is_the_ratio_estimators() -> None:
    ticks = [Tick(1, 1.0, True, tokens=100, good_tokens=100), Tick(2, 1.0, True, tokens=300, good_tokens=0)]
    # Equal intervals: the standard error of the mean of per-tick rates (sd 141.4 / sqrt 2).
    assert objective_se("tokens", ticks) == pytest.approx(100.0)
    assert objective_se("goodput", ticks) == pytest.approx(50.0)
    assert objective_se("tokens", ticks[:1]) is None
    # Unequal intervals: the ratio estimator's; 200 tok/s for 1 s and 3 s is no scatter.
    assert objective_se("tokens", [Tick(1, 1.0, True, tokens=200), Tick(4, 3.0, True, tokens=600)]) == 0.0
    # tokens_per_joule: ticks without joules carry no value, as in objective_value.
    metered = [Tick(1, 1.0, True, tokens=100, joules=10.0), Tick(2, 1.0, True, tokens=100)]
    assert objective_se("tokens_per_joule", metered) is None
    metered.append(Tick(3, 1.0, True, tokens=300, joules=10.0))
    assert objective_se("tokens_per_joule", metered) == pytest.approx(10.0)


def test_goodput_objective_counts_only_tokens_within_the_slo() -> None:
    # Under the cap, 16 running pushes TPOT past the limit for most requests; 12 keeps it for all.
    world = World(
        tps=lambda limit, harm: 100.0 * limit,
        good_share=lambda limit, harm: (0.3 if limit > 12 else 1.0) if harm else 1.0,
    )
    policy = BatchPolicy(BatchSettings(**{**_kw(SETTINGS), "objective": "goodput"}))
    out, limits = drive(policy, world, lambda t: 10 <= t < 200, 200)
    first = results(out)[0]
    assert first.kept and first.before == 480.0 and first.after == 1200.0
    assert 12 in limits[-5:]


def test_dry_run_advises_once_per_harm_episode_and_keeps_figures_with_the_level_in_force() -> None:
    world = World(tps=lambda limit, harm: 100.0 * limit)
    policy = BatchPolicy(BatchSettings(**{**_kw(SETTINGS), "dry_run": True}))
    out, limits = drive(policy, world, lambda t: 10 <= t < 100 or 150 <= t < 250, 300)
    advice = actions(out)
    assert [a.kind for a in advice] == ["downscale", "downscale"]
    assert all(a.evidence.get("advice") == 1 for a in advice)
    assert set(limits) == {16} and results(out) == []
    assert list(policy.levels()) == ["16"] and policy.levels()["16"]["tokens_per_s"] == 1600.0


def test_a_level_that_brings_harm_back_after_an_upscale_is_blocked() -> None:
    # Harm whenever 16 runs: the device holds 12, not 16.
    policy = BatchPolicy(SETTINGS)
    state = {"limit": 16}
    world = World(tps=lambda limit, harm: 2000.0 - 50.0 * limit if harm else 100.0 * limit)

    def harm(t: float) -> bool:
        return state["limit"] >= 16

    out: Out = []
    for i in range(1, 500):
        h = harm(i)
        level = policy.in_force
        tk = world.tps(level, h)
        out += policy.update(Tick(float(i), 1.0, h, "power" if h else "", binding=True, tokens=tk))
        state["limit"] = policy.in_force
    ups = actions(out, "upscale")
    downs = actions(out, "downscale")
    assert downs and downs[0].to_limit == 12
    # After the first bounce back to 16, 16 is blocked: at most one more try within retry_s.
    assert sum(1 for a in ups if a.to_limit == 16) <= 1
    # Blocked at 16, the policy settles on the highest level that holds (15 in this world).
    assert policy.in_force == 15 and 16 in policy._blocked


def test_objective_is_a_ratio_of_sums() -> None:
    ticks = [Tick(1, 1.0, True, tokens=100, good_tokens=50, joules=10.0), Tick(2, 3.0, True, tokens=100)]
    assert objective_value("tokens", ticks) == 50.0
    assert objective_value("goodput", ticks) == 12.5
    assert objective_value("tokens_per_joule", ticks) == 10.0  # only the metered tick
    assert objective_value("tokens_per_joule", ticks[1:]) is None


def test_state_round_trip_keeps_blocks_path_and_levels() -> None:
    world = World(tps=lambda limit, harm: 200.0 * limit)
    policy = BatchPolicy(SETTINGS)
    drive(policy, world, lambda t: 20 <= t < 400, 100)
    state = policy.to_state(now_s=100.0)
    again = BatchPolicy.from_state(SETTINGS, state, now_s=5000.0)
    assert again.limit == policy.limit and again.reverted == policy.reverted == 1
    assert again.levels() == policy.levels()
    assert again._blocked == {12: 5000.0 + (policy._blocked[12] - 100.0)}
    assert again.results == policy.results


def phases() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (PHASES.parent / "phases.jsonl").read_text().splitlines()]


def source_start_wall() -> float:
    with gzip.open(PHASES, "rt") as f:
        f.readline()  # the header
        return int(json.loads(f.readline())["wall_ns"]) / 1e9


def test_recorded_h200_matmul_load_is_harm_and_the_trial_is_reverted() -> None:
    """The H200 phases recording (idle 10 s, load 20 s, idle 15 s, load 20 s, idle 15 s; the matmul load
    at the 700 W cap) through the collector, the harm judge and the policy at 1 Hz, with a served
    workload whose tokens fall with the ceiling: harm within 3 s of each load, one trial, reverted."""
    t = [0.0]
    source = RecordedNvml(PHASES, lambda: t[0])
    events: list[tuple[float, str]] = []
    watch = GpuThrottleWatch(
        {0: source.static(0).max_sm_mhz}, lambda kind, _msg, **_f: events.append((t[0], kind))
    )
    collector = NvmlCollector(source, on_fast=watch.observe)
    settings = BatchSettings(start=16, floor=4, objective="tokens", dwell_s=3, settle_s=3, eval_s=5)
    policy = BatchPolicy(settings)
    out: Out = []
    k = 0
    while not source.finished:
        collector.sample_fast(t[0])
        if k % 10 == 0:
            collector.sample_slow()
            kind = watch.harm()
            tokens = 100.0 * policy.in_force
            out += policy.update(Tick(t[0], 1.0, bool(kind), kind, binding=True, tokens=tokens))
        k += 1
        t[0] = k / 10
    enters = [ts for ts, kind in events if kind == "harm_enter"]
    leaves = [ts for ts, kind in events if kind == "harm_leave"]
    t0_wall = source_start_wall()
    loads = [p["start_wall"] - t0_wall for p in phases() if p["phase"] == "load" and "start_wall" in p]
    assert len(enters) == 2 and len(leaves) == 2
    assert all(0 < e - s <= 3.0 for e, s in zip(enters, loads, strict=True))
    assert watch.energy_j() > 0
    downs, reverts = actions(out, "downscale"), actions(out, "revert")
    assert downs and len(reverts) == len([r for r in results(out) if not r.kept and r.kind == "downscale"])
    assert policy.in_force == 16


def drive_queue(
    policy: BatchPolicy, wait: Callable[[float, int], float], seconds: int, harm_from: float = 10.0
) -> Out:
    """Every request waits for admission under harm from `harm_from`, 2 requests finish a second;
    `wait(t, level)` is how long the head of the admission queue has waited at t with that ceiling."""
    out: Out = []
    for i in range(1, seconds + 1):
        t = float(i)
        h = t >= harm_from
        w = wait(t, policy.in_force)
        out += policy.update(_queued(t, h, w))
    return out


def _queued(t: float, harm: bool, wait: float) -> Tick:
    return Tick(
        t,
        1.0,
        harm,
        "power" if harm else "",
        binding=True,
        tokens=2000.0,
        good_tokens=1500.0,
        wait_s=wait,
        finished=2,
    )


LIMITED = BatchSettings(**{**_kw(GOODPUT), "ttft_limit_s": 10.0})


def test_wait_reach_is_the_wait_plus_its_trend_over_the_span_plus_the_stall() -> None:
    # 0.5 s of wait per second; 2 requests finish a second, so 4 over the new limit take 2 s to drain.
    rising = [Tick(float(t), 1.0, True, wait_s=0.5 * t, finished=2) for t in range(10)]
    assert wait_reach(rising, span_s=60.0, excess=4) == pytest.approx(4.5 + 30.0 + 2.0)
    falling = [Tick(float(t), 1.0, True, wait_s=9.0 - 0.5 * t, finished=2) for t in range(10)]
    assert wait_reach(falling, span_s=60.0, excess=4) == pytest.approx(4.5 + 2.0)  # a trend never below 0
    stuck = [Tick(float(t), 1.0, True, wait_s=1.0) for t in range(10)]  # nothing finished: no end to it
    assert wait_reach(stuck, span_s=60.0, excess=4) == float("inf")
    assert wait_reach([], span_s=60.0, excess=4) == float("inf")


def test_no_trial_where_the_queue_would_cross_the_ttft_limit_within_it() -> None:
    # The head of the queue gains 0.15 s a second: 2.85 s at the first chance of a trial (t = 29, 19 s
    # into the harm), projected over B and A' (60 s) by 9 s, plus the stall of 16 -> 12 (4 requests at 2
    # a second): 13.85 s, past the 10 s TTFT limit.
    policy = BatchPolicy(LIMITED)
    out = drive_queue(policy, lambda t, _level: 0.15 * max(0.0, t - 10), 100)
    assert actions(out) == [] and policy.in_force == 16
    (skip,) = [o for o in out if isinstance(o, TrialSkipped)]  # once per harm episode, not every tick
    assert skip.t_s == 29.0 and (skip.from_limit, skip.to_limit) == (16, 12)
    assert skip.evidence["wait_s"] == pytest.approx(2.85)
    assert skip.evidence["wait_reach_s"] == pytest.approx(13.85)
    assert "past the 10 s TTFT limit" in skip.reason and policy.skipped == 1
    # The harm ends and comes back: a new episode says it again.
    for i in range(101, 106):
        out += policy.update(_queued(float(i), False, 9.0))
    for i in range(106, 160):
        out += policy.update(_queued(float(i), True, 9.0))
    assert len([o for o in out if isinstance(o, TrialSkipped)]) == 2 and policy.skipped == 2
    assert actions(out) == []


@pytest.mark.parametrize(
    "settings",
    [LIMITED, GOODPUT, BatchSettings(**{**_kw(SETTINGS), "ttft_limit_s": 10.0})],
    ids=["headroom", "no-ttft-limit", "objective-tokens"],
)
def test_a_trial_starts_where_the_queue_has_headroom_or_goodput_has_no_ttft_limit(
    settings: BatchSettings,
) -> None:
    # A flat 7 s head wait: 7 s + no trend + a 2 s stall = 9 s, under the 10 s limit; where no TTFT limit
    # counts (none set, or an objective without one) even a 9.5 s wait is no reason to skip.
    wait = 7.0 if settings is LIMITED else 9.5
    policy = BatchPolicy(settings)
    out = drive_queue(policy, lambda _t, _level: wait, 60)
    assert [o for o in out if isinstance(o, TrialSkipped)] == []
    assert [(a.from_limit, a.to_limit) for a in trials(out)] == [(16, 12)]


def test_advice_only_says_the_skip_too() -> None:
    policy = BatchPolicy(BatchSettings(**{**_kw(LIMITED), "dry_run": True}))
    out = drive_queue(policy, lambda _t, _level: 9.0, 100)
    assert actions(out) == [] and policy.advice == 0
    assert len([o for o in out if isinstance(o, TrialSkipped)]) == 1


def test_a_ttft_limit_that_is_not_a_positive_number_is_refused() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="ttft_limit_s"):
            BatchSettings(**{**_kw(GOODPUT), "ttft_limit_s": bad})


def test_a_window_in_which_no_request_finished_skips_the_trial_and_says_why() -> None:
    # Tokens flow but no request ends (long outputs): the lower ceiling's stall has no end in sight.
    policy = BatchPolicy(LIMITED)
    out: Out = []
    for i in range(1, 60):
        h = i >= 10
        tick = Tick(float(i), 1.0, h, "power" if h else "", binding=True, tokens=2000.0, good_tokens=1500.0)
        out += policy.update(tick)
    (skip,) = [o for o in out if isinstance(o, TrialSkipped)]
    assert actions(out) == [] and skip.evidence["wait_reach_s"] == float("inf")
    assert "no request finished in the before-window" in skip.reason and "inf" not in skip.reason


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_evidence_names_the_gpu_the_harm_is_on(dry_run: bool) -> None:
    """A tensor-parallel engine held back by one GPU: the action (or the advice) says which."""
    world = World(tps=lambda limit, harm: 100.0 * limit)
    policy = BatchPolicy(BatchSettings(**{**_kw(SETTINGS), "dry_run": dry_run}))
    out, _ = drive(policy, world, lambda t: t >= 10, 60, source="GPU 1")
    first = actions(out, "downscale")[0]
    assert first.evidence["harm_source"] == "GPU 1" and "harm (power on GPU 1) for " in first.reason
    plain, _ = drive(
        BatchPolicy(BatchSettings(**{**_kw(SETTINGS), "dry_run": dry_run})), world, lambda t: t >= 10, 60
    )
    assert "harm_source" not in actions(plain, "downscale")[0].evidence


def test_no_trial_starts_while_the_harm_is_in_its_tail() -> None:
    """Harm held long enough with the ceiling binding, but its loss in the band (fading): no trial, and
    no advice in dry run; once the loss is back at the threshold a trial starts."""
    for dry in (False, True):
        policy = BatchPolicy(BatchSettings(**{**_kw(SETTINGS), "dry_run": dry}))
        out: Out = []
        for i in range(1, 121):
            fading = i <= 60
            out += policy.update(
                Tick(
                    t_s=float(i),
                    interval_s=1.0,
                    harm=True,
                    harm_kind="power",
                    fading=fading,
                    binding=True,
                    tokens=100.0,
                    good_tokens=100.0,
                )
            )
            if i == 60:
                assert actions(out) == [], dry
        (first,) = actions(out, "downscale")
        # Its A leg (eval_s) is harm now throughout: none of it from the tail.
        assert first.t_s >= 60 + SETTINGS.eval_s
