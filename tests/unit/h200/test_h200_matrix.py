"""The control matrix recorded on an H200 (tests/data/h200/matrix, benchmarks/h200_matrix/run.sh): a
Qwen3-8B shape with dummy weights at 64 requests, three scenarios x {control, advice-only} (a shared GPU
with a bf16 matmul process from 20 s to 65 s of a 95 s replay, the SLO-bound case, the engine's own batch
at twice the trace's rate with no second process) and an A/A of soakd's scheduler class (load-free, no
action, with and without it). What it must show: the class costs nothing measurable; clock harm ends
within 30 s of the load; the throughput judge, replayed, sees every shared load within 5 s and nothing
without one (live it saw none: its reference formed from the loaded seconds); a trial whose "after" is
the drift comes out inconclusive, not a verdict; no action where there is no load."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_h200_control_ab import replay_ticks, throughput_inputs

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.config import BatchControlConfig
from soakd.control import Slo
from soakd.policies.downscale import ActionResult, BatchAction, BatchPolicy, BatchSettings, TrialSkipped
from soakd.policies.throttle import SW_POWER_CAP, HarmJudge, ThroughputJudge
from soakd.testing import load_script, recorded_gpu

DATA = Path(__file__).parents[2] / "data" / "h200" / "matrix"
FIGURES = Path(__file__).parents[3] / "benchmarks" / "h200_matrix" / "figures.py"
LOADED = ("shared-control", "shared-advice", "pays-control", "pays-advice")
LOAD_FREE = ("shared-free", "owncap-control", "owncap-advice")


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    arms: dict[str, Any] = FIG.load(DATA)
    return arms


FIG = load_script(FIGURES, "h200_matrix_figures")


def events(arm: str) -> list[tuple[str, dict[str, Any]]]:
    """(kind, fields) of every event in the arm's spool, read by the figures' line-protocol parser."""
    lines = FIG.FIG.lines(DATA / arm / "spool.lp.gz")
    return [(tags.get("kind", ""), fields) for name, tags, fields, _ in lines if name == "events"]


def test_the_scheduler_class_costs_nothing_measurable(matrix: dict[str, Any]) -> None:
    """A/A: the same load-free 60 s replay with soakd's scheduler class (advice-only runs it too now) and
    without it (control off). Measured: tokens/s 9,164 vs 9,218 (-0.6 %), TPOT p50 5.08 vs 5.34 ms. The
    noise beside it: the two owncap arms, which made no action either (the same engine, the same policy in
    force), differ by up to 18 % in tokens/s in a 20 s window and 4.3 % over the load's span."""
    meta = {a: json.loads((DATA / a / "meta.json").read_text()) for a in ("shared-free", "shared-noclass")}
    assert meta["shared-free"]["engine"]["live_active_seqs"] is True
    assert meta["shared-noclass"]["engine"]["live_active_seqs"] is False
    whole = {}
    for name in ("shared-free", "shared-noclass"):
        arm = matrix[name]["arm"]
        whole[name] = arm.window(0.0, arm.end)
    tps = whole["shared-free"]["tokens_per_s"] / whole["shared-noclass"]["tokens_per_s"] - 1
    tpot = whole["shared-free"]["tpot_p50_ms"] / whole["shared-noclass"]["tpot_p50_ms"] - 1
    noise = []
    for k in range(3):
        a, b = (matrix[n]["arm"].window(*matrix[n]["spans"][k]) for n in ("owncap-control", "owncap-advice"))
        noise.append(abs(a["tokens_per_s"] / b["tokens_per_s"] - 1))
    assert abs(tps) < 0.02 and abs(tps) < max(noise) / 4
    assert -0.10 < tpot < 0.02  # the class's arm was the faster one
    assert json.loads((DATA / "shared-free" / "summary.json").read_text())["control"]["batch_actions"] == 0


def test_no_action_and_no_harm_without_a_load() -> None:
    for arm in LOAD_FREE:
        kinds = [k for k, _ in events(arm)]
        assert not {"downscale", "upscale", "revert", "harm_enter"} & set(kinds), arm
        control = json.loads((DATA / arm / "summary.json").read_text())["control"]
        assert control["batch_actions"] == 0 and control["advice"] == 0


def nvml_rows(arm: str) -> Iterator[tuple[float, dict[str, Any], dict[str, Any]]]:
    """(wall s, fast reading, the latest slow reading) of GPU 0 from the arm's 10 Hz recording."""
    for _, wall, fast, slow in recorded_gpu(DATA / arm / "nvml.jsonl.gz"):
        yield wall, fast, slow


def load_times(arm: str) -> tuple[float, float]:
    times = json.loads((DATA / arm / "times.json").read_text())
    return float(times["load_start"]), float(times["load_end"])


@pytest.mark.parametrize("arm", LOADED)
def test_clock_harm_follows_the_load_live_and_replayed(arm: str) -> None:
    """Live: harm 1.8-1.9 s after the matmul load began, over 10.7-10.8 s after it ended (`ended_by`
    loss: the engine alone after the load ran within 1 % of its clock). The raw 10 Hz recording replayed
    through today's watch gives the same episode."""
    start, end = load_times(arm)
    got: list[tuple[str, dict[str, Any]]] = []
    watch = GpuThrottleWatch({0: 1980.0}, lambda kind, _msg, **f: got.append((kind, f)))
    when: list[float] = []
    for t, fast, slow in nvml_rows(arm):
        before = len(got)
        watch.observe(0, t, fast, slow)
        when += [t] * (len(got) - before)
    harm = [(t, k, f) for t, (k, f) in zip(when, got, strict=True) if k.startswith("harm_")]
    assert [k for _, k, _ in harm] == ["harm_enter", "harm_leave"], arm
    (t_in, _, _), (t_out, _, leave) = harm
    assert 0 < t_in - start < 3.0 and 0 < t_out - end < 30.0 and leave["ended_by"] == "loss"
    live = [(k, f) for k, f in events(arm) if k.startswith("harm_")]
    assert [k for k, _ in live] == ["harm_enter", "harm_leave"] and live[1][1]["ended_by"] == "loss"


def test_harm_from_a_shared_load_ends_at_the_engines_own_at_cap_clock() -> None:
    """The first failure this issue reported, on the recorded samples of an H200: an engine that sits at
    its power cap ~80 % of the time losing ~6 % of clock on its own (a Llama-3.1-8B shape at 16.6 req/s),
    harm from a shared load, and after it vLLM alone, draining at the cap, still 6 % down: under the 10 %
    that starts harm, over the 5 % (half) the old rule needed to end it, so the episode never ended.
    The pays-advice recording (this matrix's engine ran within 1 % of its clock outside the load) with
    the clock outside the load moved to that level on 80 % of the busy samples (x 0.94, the cap bit set;
    the others as recorded, unthrottled); the loaded seconds as recorded (14-15 % down). Today's judge
    ends the episode at the engine's own level."""
    start, end = load_times("pays-advice")
    judge = HarmJudge(max_mhz=1980.0)
    changes = []
    for k, (t, fast, slow) in enumerate(nvml_rows("pays-advice")):
        mhz, reasons = fast["sm_mhz"], fast["reasons"] or 0
        busy = slow.get("util_gpu", 0) > 0
        if not start <= t <= end and busy and k % 5:
            mhz, reasons = round(mhz * 0.94), reasons | SW_POWER_CAP
        ch = judge.update(t, mhz, reasons, active=busy, thermal_margin_c=slow.get("margin_c"))
        if ch is not None:
            changes.append((t, ch))
    assert [c.harmful for _, c in changes] == [True, False]
    (t_in, _), (t_out, leave) = changes
    assert 0 < t_in - start < 3.0 and 0 < t_out - end < 30.0
    assert leave.ended_by == "own_level" and leave.own_cap_mhz is not None
    # The old route could not have ended it: the loss against the unthrottled clock stays over half the
    # threshold after the load.
    assert 0.05 < 1 - leave.own_cap_mhz / 1980.0 < 0.10 and leave.loss > judge.settings.power_loss / 2


@pytest.mark.parametrize("arm", [*LOADED, *LOAD_FREE])
def test_the_throughput_judge_sees_every_shared_load_within_5_s_and_nothing_without(arm: str) -> None:
    """The second failure: live, no throughput harm in any arm (the summaries: 0 episodes), because no
    request waited before the load and the loaded seconds made the reference (the capacity figure needs
    a queue). Replayed through today's judge, which takes the load served with no queue as the reference
    until a queue has lasted: harm 3.1-4.3 s after each load, over 5.8-6.3 s after it; none without one."""
    recorded = json.loads((DATA / arm / "summary.json").read_text())["control"].get("throughput")
    # shared-free ran before the summary carried the judge's figures: its events say the same.
    assert (recorded or {}).get("episodes", 0) == 0
    assert not [f for k, f in events(arm) if k == "harm_enter" and f.get("harm_kind") == "throughput"]
    ticks, times = throughput_inputs(arm, DATA)
    judge = ThroughputJudge()
    changes = [
        (t, c) for t, tps, b, lim in ticks if (c := judge.update(t, tps, binding=b, limited=lim)) is not None
    ]
    if arm in LOAD_FREE:
        assert changes == [] and sum(1 for *_, lim in ticks if lim) >= 9
        return
    assert times is not None
    assert [c for _, c in changes] == [True, False]
    assert 0 <= changes[0][0] - times["load_start"] <= 5.0
    assert 0 <= changes[1][0] - times["load_end"] <= 15.0
    # No queue before the load: the served load was the reference when the harm began.
    first_queue = next(t for t, _tps, b, _lim in ticks if b)
    assert first_queue >= times["load_start"] - 1


def test_a_trial_whose_after_is_the_drift_is_inconclusive() -> None:
    """The third failure: a before/after on a drifting system measures the drift. In the shared arm the
    backlog grew under the load and goodput (admission wait + TTFT <= 10 s) collapsed whatever the level:
    A 4,147 good tok/s at 64, B 4,548 at 48, A' 406 back at 64. The before/after would have kept 48 on a
    +9.7 % "gain"; A-B-A reads it as the drift (B inside the bracket's reach) and blocks 48 for 40 s
    (2 x (dwell + settle + eval) at the matrix's halved times), not the hour a verdict costs. In the
    SLO-bound arm (TPOT <= 12.79 ms) B beat A by 19.5 % but A' did as well as B: inconclusive on the
    noise. Every verdict says which comparison decided it."""
    retry = BatchControlConfig().retry
    for arm, why in (("shared-control", "drift"), ("pays-control", "noise")):
        (result,) = [f for k, f in events(arm) if k == "action_result"]
        assert result["decided_by"] == "aba_bracket" and result["verdict"] == "inconclusive", arm
        before, after, again = (
            float(result[k]) for k in ("objective_before", "objective_after", "objective_again")
        )
        assert after > before * 1.03  # a "gain" the before/after would have kept
        assert float(result["blocked_s"]) < retry and f"inconclusive ({why})" in result["message"]
        kinds = [k for k, _ in events(arm) if k in ("downscale", "revert", "upscale")]
        assert kinds == ["downscale", "revert"], arm  # the trial and its A' leg; nothing else moved
        if why == "drift":
            assert again < 0.25 * before  # the collapse: the level before lost it too


def test_control_against_advice_only_per_window(matrix: dict[str, Any]) -> None:
    """Control vs advice-only, tokens/s per window (before, under, after the load), beside the noise of
    the owncap pair (no action in either: up to 18.2 %). Measured: shared -2.5 / -5.7 / -10.4 %, pays
    +3.2 / -3.5 / -1.0 %, owncap +18.2 / -4.3 / +0.6 %. Goodput after the shared load is the exception
    the RESULTS name: 19 vs 7,562 good tok/s, the trial's B leg left a backlog whose wait stayed just over
    the 10 s TTFT limit (queue p99 12-25 s against 9-10 s)."""
    noise = 0.0
    for k in range(3):
        a, b = (matrix[n]["arm"].window(*matrix[n]["spans"][k]) for n in ("owncap-control", "owncap-advice"))
        noise = max(noise, abs(a["tokens_per_s"] / b["tokens_per_s"] - 1))
    assert 0.1 < noise < 0.25
    for scenario in ("shared", "pays"):
        for k in range(3):
            c, d = (
                matrix[f"{scenario}-{p}"]["arm"].window(*matrix[f"{scenario}-{p}"]["spans"][k])
                for p in ("control", "advice")
            )
            assert c["tokens_per_s"] >= (1 - noise) * d["tokens_per_s"], (scenario, k)
    shared_after = [
        matrix[f"shared-{p}"]["arm"].window(*matrix[f"shared-{p}"]["spans"][2]) for p in ("control", "advice")
    ]
    assert shared_after[0]["goodput_tps"] < 0.05 * shared_after[1]["goodput_tps"]


@pytest.mark.parametrize(
    ("arm", "slo", "old_rule"),
    [
        ("shared-advice", Slo(ttft_s=10.0, tpot_s=0.025), "kept"),
        ("pays-advice", Slo(tpot_s=0.01279), "blocked"),
    ],
)
def test_a_trial_cut_from_an_arm_where_nothing_moved_is_no_verdict(arm: str, slo: Slo, old_rule: str) -> None:
    """The advice-only arms' recorded harm, queue and tokens through today's policy, open-loop: its "B" and
    "A'" legs ran at 64 like its A (nothing moved), so any verdict would be the drift's. The before/after
    would have kept 48 on shared (B 22 % over A) and reverted it, blocking 48 for an hour, on pays (B 11 %
    under A); the A-B-A trial reads both as drift: inconclusive, 48 blocked for 40 s."""
    ticks = replay_ticks(arm, slo, data=DATA)
    settings = BatchSettings(start=64, floor=16, objective="goodput", dwell_s=5, settle_s=5, eval_s=10)
    policy = BatchPolicy(settings)
    out: list[BatchAction | ActionResult] = []
    for tick in ticks:
        out += policy.update(tick)
    actions = [(a.kind, a.from_limit, a.to_limit) for a in out if isinstance(a, BatchAction)]
    assert actions == [("downscale", 64, 48), ("revert", 48, 64)]
    (result,) = [r for r in out if isinstance(r, ActionResult)]
    assert result.before is not None and result.after is not None
    gain = result.after / result.before - 1
    # What the before/after rule (keep on a 3 % gain, else revert and block for retry) would have done.
    assert (gain >= settings.min_gain) == (old_rule == "kept")
    assert result.decided_by == "aba_bracket" and result.verdict == "inconclusive"
    assert result.blocked_s == 2 * (settings.dwell_s + settings.settle_s + settings.eval_s) < settings.retry_s


def _queue(arm: Any) -> list[tuple[float, float]]:
    """(due, admitted) of every request of an arm, in seconds of its replay."""
    return [
        (f["due_ns"] / 1e9 - arm.t0, f["due_ns"] / 1e9 - arm.t0 + f.get("queue_s", 0.0))
        for _, f, _ in arm.requests
        if "due_ns" in f
    ]


def _head_wait(queue: list[tuple[float, float]], t: float) -> float:
    return max((t - d for d, a in queue if d <= t < a), default=0.0)


def test_the_trials_cost_is_its_stall_and_the_queue_it_pushed_past_the_ttft_limit(
    matrix: dict[str, Any],
) -> None:
    """Why goodput after the shared load was 19 against 7,562 good tok/s: the trial of 64 -> 48 admitted
    nothing for its first second and 33 requests in its first 5 s where advice-only, which moved nothing,
    admitted 53 over the same seconds; the head of the admission queue went from 5.0 to 10.0 s (advice-only
    4.5 to 6.2 s) and stayed ahead after the revert, so after the load nearly every request of the control
    arm missed the 10 s TTFT limit (from its due time) and about a third of advice-only's did."""
    control, advice = matrix["shared-control"]["arm"], matrix["shared-advice"]["arm"]
    (down,) = [t for t, k, _ in control.events if k == "downscale"]
    admitted, head = {}, {}
    for name, arm in (("control", control), ("advice", advice)):
        queue = _queue(arm)
        admitted[name] = [sum(1 for _, a in queue if down + i <= a < down + i + 1) for i in range(5)]
        head[name] = (_head_wait(queue, down), _head_wait(queue, down + 5))
    assert admitted["control"][0] == 0 and admitted["advice"][0] > 5
    assert sum(admitted["control"]) < 0.75 * sum(admitted["advice"])
    grew = {name: after - before for name, (before, after) in head.items()}
    assert grew["control"] > 2 * grew["advice"] and grew["control"] > 3.0
    missed = {}
    for name, arm in (("control", control), ("advice", advice)):
        after = [f for t, f, st in arm.requests if t >= 65 and st == "ok"]
        missed[name] = sum(1 for f in after if f.get("queue_s", 0.0) + f.get("ttft_s", 0.0) > 10.0) / len(
            after
        )
    assert missed["control"] > 0.95 and missed["advice"] < 0.5


@pytest.mark.parametrize("arm", ["shared-advice", "shared-control"])
def test_no_trial_where_the_queue_is_about_to_cross_the_ttft_limit(arm: str) -> None:
    """The shared arms' recorded seconds (up to the recorded trial: nothing had moved yet in either)
    through today's policy with the run's TTFT limit: where the recorded policy tried 64 -> 48, the head of
    the queue had waited ~5 s, gaining ~0.4 s a second, with ~10 requests finishing a second: projected
    past the 10 s limit within the trial, so no trial, said once. Without the limit the trial starts."""
    slo = Slo(ttft_s=10.0, tpot_s=0.025)
    ticks = replay_ticks(arm, slo, data=DATA)
    base = BatchSettings(start=64, floor=16, objective="goodput", dwell_s=5, settle_s=5, eval_s=10)
    outs = {}
    for limit in (10.0, None):
        policy = BatchPolicy(BatchSettings(**{**_fields(base), "ttft_limit_s": limit}))
        out: list[BatchAction | ActionResult | TrialSkipped] = []
        for tick in ticks:
            out += policy.update(tick)
            if any(isinstance(o, BatchAction | TrialSkipped) for o in out):
                break  # the first decision: after it the recorded control arm moved
        outs[limit] = out
    (skip,) = outs[10.0]
    assert isinstance(skip, TrialSkipped) and (skip.from_limit, skip.to_limit) == (64, 48)
    assert 3.0 < float(skip.evidence["wait_s"]) < 7.0 and float(skip.evidence["wait_reach_s"]) >= 10.0
    (trial,) = outs[None]
    assert isinstance(trial, BatchAction) and trial.kind == "downscale" and trial.t_s == skip.t_s


def _fields(s: BatchSettings) -> dict[str, Any]:
    return {name: getattr(s, name) for name in s.__dataclass_fields__}
