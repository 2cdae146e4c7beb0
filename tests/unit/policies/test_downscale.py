"""The batch policy: recorded H200 telemetry through the collector, the harm judge and the policy, and
hand-made worlds in which a downscale pays or does not, for the trial, the revert, the block, the
upscale, dry run and the saved state."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.nvml import NvmlCollector, RecordedNvml
from soakd.policies.downscale import (
    ActionResult,
    BatchAction,
    BatchPolicy,
    BatchSettings,
    Tick,
    objective_value,
)

PHASES = Path(__file__).parents[2] / "data" / "h200" / "phases" / "nvml_phases.jsonl.gz"

Out = list[BatchAction | ActionResult]


@dataclass
class World:
    """A served workload: tokens/s and goodput as functions of the ceiling in force and the harm."""

    tps: Callable[[int, bool], float]
    good_share: Callable[[int, bool], float] = lambda _limit, _harm: 1.0
    demand: int = 100
    """Requests that want to run: the ceiling binds below this."""


def drive(
    policy: BatchPolicy, world: World, harm: Callable[[float], bool], seconds: int, t0: float = 0.0
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
    (res,) = results(out)
    assert not res.kept and res.before == 2560.0 and res.after == 200.0 * 12 * 0.8
    assert res.t_s == downs[0].t_s + 30  # settle 10 s + eval 20 s
    assert len(reverts) == 1 and reverts[0].to_limit == 16 and reverts[0].t_s == res.t_s
    # 12 is blocked for retry_s: no second trial during the rest of the harm (400 s), and 16 held.
    assert limits[-1] == 16 and policy.reverted == 1 and policy.kept == 0
    assert sum(1 for x in limits if x < 16) == 30  # the trial's cost: 30 s at 12
    assert policy.levels()["12"]["seconds"] == 30.0


def test_a_downscale_that_pays_is_kept_and_the_next_step_is_tried() -> None:
    # An edge GPU: the big batch's clock loss costs more than the batch gives (12 serves best).
    best = {16: 1000.0, 12: 1400.0, 9: 1100.0}
    world = World(tps=lambda limit, harm: best.get(limit, 500.0) if harm else 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, limits = drive(policy, world, lambda t: 10 <= t < 300, 300)
    res = results(out)
    assert [(r.from_limit, r.to_limit, r.kept) for r in res] == [(16, 12, True), (12, 9, False)]
    assert res[0].after == 1400.0 and res[0].before == 1000.0
    assert [a.to_limit for a in actions(out, "revert")] == [12]
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


def test_the_ceiling_comes_back_up_the_way_it_came_once_the_harm_is_gone() -> None:
    world = World(tps=lambda limit, harm: (3000.0 - 100.0 * limit) if harm else 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, limits = drive(policy, world, lambda t: 10 <= t < 200, 400)
    downs = [(a.from_limit, a.to_limit) for a in actions(out, "downscale")]
    ups = actions(out, "upscale")
    assert downs[:2] == [(16, 12), (12, 9)]
    assert [(a.from_limit, a.to_limit) for a in ups][-1][1] == 16
    # Up by the path it came down (9 -> 12 -> 16 ...), the first 30 s after the harm ended.
    # The harm ended during the last trial (5 -> 4): that level is kept, the way up starts 10 s later.
    assert ups[0].t_s == 200 + SETTINGS.settle_s and ups[0].from_limit == limits[198]
    # Each upscale returns to the level the matching downscale came from, in reverse order.
    kept = [(a.from_limit, a.to_limit) for a in actions(out) if a.kind in ("downscale", "revert")]
    path = [frm for frm, to in kept if to < frm]
    assert [a.to_limit for a in ups] == [x for x in reversed(path) if x > limits[198]][: len(ups)]
    assert limits[-1] == 16
    # Upscales are measured, never reverted.
    assert all(r.kept for r in results(out) if r.kind == "upscale")


def test_harm_that_ends_during_the_trial_is_inconclusive_and_the_ceiling_returns_after_the_settle() -> None:
    # Seen on an H200: the outside load ended 14 s into a trial; the cool-down then cost 30 s at 12.
    world = World(tps=lambda limit, harm: 100.0 * limit)
    policy = BatchPolicy(SETTINGS)
    out, limits = drive(policy, world, lambda t: 10 <= t < 45, 200)
    (down,) = actions(out, "downscale")
    (res, up) = (
        r for r in out if r not in (down,) and not (isinstance(r, ActionResult) and r.kind == "upscale")
    )
    assert isinstance(res, ActionResult) and res.kept and res.after is None and "ended" in res.reason
    assert res.t_s == 45 and actions(out, "revert") == []
    assert isinstance(up, BatchAction) and up.kind == "upscale" and up.t_s == 45 + SETTINGS.settle_s
    assert sum(1 for x in limits if x < 16) == up.t_s - down.t_s
    assert policy._blocked == {}  # never judged: not blocked


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
    assert policy._blocked == {} and policy.in_force == 16 and down.t_s < 28


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


def _kw(s: BatchSettings) -> dict[str, object]:
    return {name: getattr(s, name) for name in s.__dataclass_fields__}


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
