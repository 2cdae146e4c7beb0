"""The control A/B recorded on an H200 (tests/data/h200/control_ab, benchmarks/h200_control): a Qwen3-8B
shape with dummy weights, a load-free run, and the same replay with a bf16 matmul load at the power cap
once with control on and once advice-only. What it must show: brief power-cap touches are recorded and
never acted on; control costs no throughput beside advice-only; the recorded harm and load, replayed
through today's policy, give the decisions the policy stands for."""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from soakd.control import Slo
from soakd.policies import downscale
from soakd.policies.downscale import (
    ActionResult,
    BatchAction,
    BatchPolicy,
    BatchSettings,
    Tick,
    judge_aba,
    objective_value,
)
from soakd.policies.throttle import ThroughputJudge
from soakd.testing import load_script

DATA = Path(__file__).parents[2] / "data" / "h200" / "control_ab"
PAYS = Path(__file__).parents[2] / "data" / "h200" / "control_pays"
FIGURES = Path(__file__).parents[3] / "benchmarks" / "h200_control" / "figures.py"


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    return load_script(FIGURES, "h200_control_figures")


def summary(arm: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DATA / arm / "summary.json").read_text())
    return doc


def events(arm: str) -> list[str]:
    with gzip.open(DATA / arm / "spool.lp.gz", "rt") as f:
        return [line.split("kind=")[1].split(",")[0] for line in f if line.startswith("events,")]


def test_load_free_run_records_its_power_cap_touches_and_makes_no_action() -> None:
    doc = summary("free")
    gpu = doc["gpu_throttle"]["0"]
    # vLLM alone at ~310-350 W: the power-cap counter grew (44.8 s in all) and episodes were recorded...
    assert gpu["enters"] >= 5 and gpu["per_reason_s"]["power"] > 40
    # ...but the SM clock never fell (max 1 s median loss < 1 %): no harm, no action.
    assert gpu["harm"]["episodes"] == 0 and gpu["harm"]["max_clock_loss"] < 0.01
    assert doc["control"]["batch_actions"] == 0 and doc["control"]["advice"] == 0
    kinds = events("free")
    assert "throttle_enter" in kinds and not {"harm_enter", "downscale", "upscale", "revert"} & set(kinds)


def test_control_costs_no_throughput_beside_advice_only(figures: ModuleType) -> None:
    arms = {name: figures.load_arm(DATA / name) for name in ("control", "dryrun")}
    for name, arm in arms.items():
        assert arm.load is not None and 30 < arm.load[0] < 50, name  # the load's start, in replay time
    spans = {}
    for name, arm in arms.items():
        spans[name] = [(0.0, arm.load[0]), arm.load, (arm.load[1], arm.end)]
    for k in range(3):
        tps = {name: arms[name].window(*spans[name][k])["tokens_per_s"] for name in arms}
        # Measured: +1.5 %, -1.7 %, -2.1 % (before, under, after the load); the load-free run's two
        # halves differ by 4.8 %: run-to-run noise of this size.
        assert abs(tps["control"] / tps["dryrun"] - 1) < 0.05, (k, tps)
    for name in arms:
        verdict = json.loads((DATA / name / "verdict.json").read_text())["verdict"]
        assert verdict == "FAIL"  # both: the trace outruns one H200 with this shape (requests dropped)


def test_the_matmul_load_at_the_cap_costs_little_clock_and_harm_is_brief(figures: ModuleType) -> None:
    for name in ("control", "dryrun"):
        arm = figures.load_arm(DATA / name)
        under = arm.window(*arm.load)
        # Power at the cap nearly all the time, the SM clock 6-7 % down: normal operation at the limit.
        assert under["power_cap_share"] > 0.95 and 0.04 < under["clock_loss_p50"] < 0.10
        gpu = summary(name)["gpu_throttle"]["0"]
        assert gpu["harm"]["episodes"] == 1 and gpu["harm"]["harm_s"] < 40


def test_dry_run_summary_shows_only_the_level_in_force() -> None:
    control = summary("dryrun")["control"]
    assert control["dry_run"] is True and control["batch_actions"] == 0
    assert list(control["levels"]) == ["16"] and control["ceiling"] == 16


def dispatch_end(folder: Path) -> int:
    """The second the replay stopped dispatching (its start plus the run's duration): the drain after it
    does not count as binding (`ControlInputs.draining`)."""
    duration = json.loads((folder / "meta.json").read_text())["config"]["run"]["duration"]
    with gzip.open(folder / "spool.lp.gz", "rt") as f:
        start = min(int(line.rsplit(" ", 1)[1]) for line in f if line.startswith("replay,"))
    return start // 1_000_000_000 + int(duration)


@dataclass(frozen=True, slots=True)
class RecordedTick(Tick):
    """A tick with the output tokens of every request that finished in it, within the SLO or not (a
    failed one's: the tokens it got): the SLO-met share's denominator (product_goodput)."""

    finished_tokens: float = 0.0


def replay_ticks(arm: str, slo: Slo, data: Path = DATA) -> list[RecordedTick]:
    """Per control point of the recorded run: its harm, whether requests waited, the output tokens
    generated since the last point, the tokens of the requests that finished (within the SLO, and in
    all), how many finished, and how long the head of the admission queue had waited at its end (from
    the requests' due times and admission waits: the recorded control points predate that field)."""
    control: dict[int, dict[str, Any]] = {}
    replay: dict[int, int] = {}
    good: dict[int, float] = defaultdict(float)
    finished: dict[int, float] = defaultdict(float)
    done: dict[int, int] = defaultdict(int)
    queued: list[tuple[float, float]] = []  # (due, admitted) in wall seconds
    end = dispatch_end(data / arm)
    with gzip.open(data / arm / "spool.lp.gz", "rt") as f:
        for line in f:
            if not line.startswith(("control,", "replay,", "requests,")):
                continue
            rest, ts = line.rstrip("\n").rsplit(" ", 1)
            head, body = rest.split(" ", 1)
            sec = int(ts) // 1_000_000_000
            fields = dict(kv.split("=", 1) for kv in body.split(",") if "=" in kv)
            if head.startswith("control,"):
                control[sec] = fields
            elif head.startswith("replay,"):
                replay[sec] = int(fields["output_tokens"].rstrip("i"))
            elif head.startswith("requests,"):
                finished[sec] += int(fields["output_tokens"].rstrip("i"))
                if "due_ns" in fields:
                    due = int(fields["due_ns"].rstrip("i")) / 1e9
                    queued.append((due, due + float(fields.get("queue_s", "0"))))
                    if "e2e_offered_s" in fields:
                        done[int(due + float(fields["e2e_offered_s"]))] += 1
                if "status=ok" not in head:
                    continue
                # TTFT as offered; these recordings predate its field: the sum of its parts.
                ttft = float(fields.get("ttft_s", "inf")) + float(fields.get("queue_s", "0"))
                ttft += float(fields.get("lateness_s", "0"))
                tpot = float(fields["tpot_s"]) if "tpot_s" in fields else None
                if slo.met(ttft, tpot):
                    good[sec] += int(fields["output_tokens"].rstrip("i"))
    ticks = []
    last = None
    for sec in sorted(control):
        fields = control[sec]
        tokens = replay.get(sec)
        if tokens is None:
            continue
        harm = fields["harm"].rstrip("i") == "1"
        delta = 0 if last is None else max(0, tokens - last)
        last = tokens
        ticks.append(
            RecordedTick(
                float(sec),
                1.0,
                harm,
                "power" if harm else "",
                binding=int(fields["waiting"].rstrip("i")) > 0 and sec < end,
                tokens=float(delta),
                good_tokens=good.get(sec, 0.0),
                finished_tokens=finished.get(sec, 0.0),
                wait_s=max((sec - d for d, a in queued if d <= sec < a), default=0.0),
                finished=done.get(sec, 0),
            )
        )
    return ticks


def test_recorded_h200_run_through_todays_policy() -> None:
    """The control arm's recorded harm, queue and tokens through the policy with the run's settings: the
    one trial comes 19 s into the harm (dwell 10 s and a full 20 s before-window), the load ends 14 s into
    it, and the ceiling is back in the tick the harm ends (the recorded run, on the first version of this
    policy, waited the 30 s cool-down)."""
    ticks = replay_ticks("control", Slo(ttft_s=60.0, tpot_s=6.49e-3))
    policy = BatchPolicy(BatchSettings(start=16, floor=4, objective="goodput"))
    out: list[BatchAction | ActionResult] = []
    for tick in ticks:
        out += policy.update(tick)
    actions = [a for a in out if isinstance(a, BatchAction)]
    harm_at = next(t.t_s for t in ticks if t.harm)
    harm_end = next(t.t_s for t in ticks if t.t_s > harm_at and not t.harm)
    assert [(a.kind, a.from_limit, a.to_limit) for a in actions] == [
        ("downscale", 16, 12),
        ("upscale", 12, 16),
    ]
    down, up = actions
    assert 19 <= down.t_s - harm_at <= 21 and down.evidence["binding_share"] == 1.0
    (verdict,) = [r for r in out if isinstance(r, ActionResult) and r.kind == "downscale"]
    assert not verdict.kept and "harm ended" in verdict.reason and verdict.t_s == harm_end
    assert up.t_s == harm_end
    # Recorded: the upscale came 31 s after the harm ended.
    recorded = summary("control")["control"]["results"]
    assert [r["kind"] for r in recorded] == ["downscale", "upscale"]
    assert recorded[1]["action_t_s"] - recorded[0]["t_s"] > 30


def throughput_inputs(
    arm: str, data: Path = DATA
) -> tuple[list[tuple[float, float, bool, bool]], dict[str, float] | None]:
    """Per second of the recorded run: tokens/s, whether requests waited (before the drain), whether the
    GPU was capped in most of its samples; and the load's times."""
    rows: dict[int, dict[str, Any]] = defaultdict(dict)
    last = None
    end = dispatch_end(data / arm)
    with gzip.open(data / arm / "spool.lp.gz", "rt") as f:
        for line in f:
            if not line.startswith(("control,", "replay,", "gpu,")):
                continue
            rest, ts = line.rstrip("\n").rsplit(" ", 1)
            head, body = rest.split(" ", 1)
            fields = dict(kv.split("=", 1) for kv in body.split(",") if "=" in kv)
            sec = int(ts) // 1_000_000_000
            if head.startswith("replay,"):
                tokens = int(fields["output_tokens"].rstrip("i"))
                if last is not None:
                    rows[sec]["tps"] = float(tokens - last)
                last = tokens
            elif head.startswith("control,"):
                rows[sec]["binding"] = int(fields["waiting"].rstrip("i")) > 0 and sec < end
            elif "samples" in fields:
                rows[sec]["limited"] = float(fields.get("reason_sw_power_cap_share", "0")) >= 0.5
    times_path = data / arm / "times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else None
    ticks = [
        (float(sec), r["tps"], r["binding"], r.get("limited", False))
        for sec, r in sorted(rows.items())
        if "tps" in r and "binding" in r
    ]
    return ticks, times


def test_throughput_harm_begins_within_3_s_of_the_shared_load_and_never_without_it() -> None:
    """The matmul beside vLLM costs 6 % of the clock but 35 % of the tokens: the throughput judge sees it
    within 3 s of the load's start, both arms; the load-free run, capped at times, never loses tokens."""
    for arm in ("control", "dryrun"):
        ticks, times = throughput_inputs(arm)
        assert times is not None
        judge = ThroughputJudge()
        changes = [
            (t, c)
            for t, tps, b, lim in ticks
            if (c := judge.update(t, tps, binding=b, limited=lim)) is not None
        ]
        began = [t for t, c in changes if c]
        assert began and 0 <= began[0] - times["load_start"] <= 3.0, (arm, began[0] - times["load_start"])
        ended = [t for t, c in changes if not c]
        assert ended and 0 <= ended[0] - times["load_end"] <= 15.0, arm
        assert judge.episodes == 1
    ticks, _ = throughput_inputs("free")
    judge = ThroughputJudge()
    for t, tps, b, lim in ticks:
        judge.update(t, tps, binding=b, limited=lim)
    assert judge.episodes == 0 and sum(1 for *_, lim in ticks if lim) > 5


# The SLO-bound case (tests/data/h200/control_pays, benchmarks/h200_control/pays.sh): 64 requests with
# long multi-turn contexts, the trace at 1.4 x its rate; advice-only, control on, advice-only again; the
# goodput SLO is TPOT <= 12.79 ms (the first advice-only arm's p25 under the matmul load).
PAYS_TPOT_MS = 12.79


def test_an_slo_bound_downscale_pays_under_the_shared_load(figures: ModuleType) -> None:
    assert float((PAYS / "tpot_limit_ms").read_text()) == PAYS_TPOT_MS
    arms = {name: figures.load_arm(PAYS / name) for name in ("dryrun1", "control", "dryrun2")}
    under = {}
    for name, arm in arms.items():
        arm.slo_tpot_ms = PAYS_TPOT_MS
        assert arm.load is not None and 85 < arm.load[0] < 95, name
        under[name] = arm.window(*arm.load)
    # Goodput under the load: control 3,123 good tok/s, advice-only 1,280 and 1,545 (the two advice-only
    # arms differ by 21 %); tokens/s 12-13 % lower: the SLO-bound objective trades tokens for requests
    # served within the limit.
    for dry in ("dryrun1", "dryrun2"):
        assert under["control"]["goodput_tps"] > 1.8 * under[dry]["goodput_tps"], dry
        assert 0.8 < under["control"]["tokens_per_s"] / under[dry]["tokens_per_s"] < 0.95, dry
        assert under["control"]["tpot_p50_ms"] < under[dry]["tpot_p50_ms"], dry
    assert abs(under["dryrun2"]["goodput_tps"] / under["dryrun1"]["goodput_tps"] - 1) < 0.3
    # The evidence the control arm acted on: 64 -> 48 kept on a goodput gain, 48 -> 36 reverted.
    results = summary_of(PAYS, "control")["control"]["results"]
    assert [(r["from"], r["to"], r["kept"]) for r in results] == [(64, 48, True), (48, 36, False)]
    assert results[0]["after"] > 1.3 * results[0]["before"] and results[1]["after"] < results[1]["before"]
    for dry in ("dryrun1", "dryrun2"):
        control = summary_of(PAYS, dry)["control"]
        assert control["batch_actions"] == 0 and control["advice"] >= 1


def summary_of(folder: Path, arm: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((folder / arm / "summary.json").read_text())
    return doc


@pytest.mark.parametrize(
    ("folder", "arm"),
    [(DATA, "control"), (DATA, "dryrun"), (PAYS, "dryrun1"), (PAYS, "control"), (PAYS, "dryrun2")],
)
def test_throughput_harm_follows_the_load_and_not_the_engine_alone_at_the_cap(folder: Path, arm: str) -> None:
    """Five recorded arms with the matmul load (16 requests and 64): throughput harm begins within 4 s of
    the load and is over within 15 s of its end, although vLLM alone at 64 requests stays at the power
    cap in most seconds after the load with tokens/s that wander 6-11k from second to second. Any other
    episode is shorter than a trial's 30 s of harm (dwell and before-window)."""
    ticks, times = throughput_inputs(arm, folder)
    assert times is not None
    judge = ThroughputJudge()
    changes = [
        (t, c) for t, tps, b, lim in ticks if (c := judge.update(t, tps, binding=b, limited=lim)) is not None
    ]
    began = [t for t, c in changes if c]
    ended = [t for t, c in changes if not c]
    assert 0 <= began[0] - times["load_start"] <= 4.0, began[0] - times["load_start"]
    assert 0 <= ended[0] - times["load_end"] <= 15.0, ended[0] - times["load_end"]
    for start, stop in zip(began[1:], ended[1:], strict=False):
        assert stop - start < 30.0, (start - times["load_end"], stop - start)
    if folder == PAYS:  # the engine alone at the cap after the load
        after = [lim for t, _tps, _b, lim in ticks if times["load_end"] + 20 < t < times["load_end"] + 80]
        assert sum(after) > 0.65 * len(after)


def test_recorded_slo_bound_run_through_todays_policy() -> None:
    """The control arm's recorded harm, queue and tokens through the policy. The recorded run (the old
    before/after) kept 64 -> 48 on 2,701 -> 3,911 good tok/s and reverted 48 -> 36. Replayed through
    the A-B-A trial, 64 -> 48 is inconclusive: B (4,221 at 48) is 55 % over A and 29 % over A', but
    within the noise (per-tick goodput under the load scatters by 1,500-2,000 good tok/s, so twice the
    standard error of the difference is ~960). The replay is open-loop: its A' leg reads the recorded
    seconds, which ran at 36 (the recorded run's own trial), not at 64. 48 is blocked for 80 s, not an
    hour, and the ceiling is back at 64 from the A' leg on: the throughput harm, judged against the
    engine's own level, is over 6 s after the load's end, before the block would let 48 be tried again
    (the recorded run, whose throughput harm outlived the load, stayed at 48 to the end: 9-10 % fewer
    tokens after the load than advice-only)."""
    ticks = replay_ticks("control", Slo(tpot_s=PAYS_TPOT_MS / 1000), data=PAYS)
    ticks_tp, times = throughput_inputs("control", PAYS)
    assert times is not None
    judge = ThroughputJudge()
    tp_harm = {}
    for t, tps, b, lim in ticks_tp:
        judge.update(t, tps, binding=b, limited=lim)
        tp_harm[t] = judge.harmful
    policy = BatchPolicy(BatchSettings(start=64, floor=16, objective="goodput"))
    out: list[BatchAction | ActionResult] = []
    for recorded in ticks:
        tick = recorded
        if not tick.harm and tp_harm.get(tick.t_s):
            tick = replace(tick, harm=True, harm_kind="throughput")
        out += policy.update(tick)
    actions = [(a.kind, a.from_limit, a.to_limit) for a in out if isinstance(a, BatchAction)]
    assert actions == [("downscale", 64, 48), ("revert", 48, 64)]
    verdicts = [r for r in out if isinstance(r, ActionResult) and r.kind == "downscale"]
    assert [(r.to_limit, r.kept, r.decided_by, r.verdict) for r in verdicts] == [
        (48, False, "aba_bracket", "inconclusive"),
    ]
    first = verdicts[0]
    assert first.before is not None and first.after is not None and first.again is not None
    assert first.noise is not None and 900 < first.noise < 1000
    assert 1.25 * max(first.before, first.again) < first.after < max(first.before, first.again) + first.noise
    assert first.blocked_s == 80.0 and "inconclusive (noise)" in first.reason
    harm_over = max(t for t, on in tp_harm.items() if on) + 1
    assert 0 < harm_over - times["load_end"] < 15 and harm_over < first.t_s + first.blocked_s
    assert policy.limit == 64


Legs = tuple[list[RecordedTick], list[RecordedTick], list[RecordedTick]]


def null_trials(effect: float = 1.0) -> list[Legs]:
    """A-B-A legs cut from the three advice-only arms, where nothing moved: every 80 s run of seconds
    with a queue that crosses neither the load's start nor its end (+15 s), as A (20 s), settle (10 s),
    B (20 s), settle (10 s), A' (20 s). `effect` scales B's tokens, goodput and finished tokens (a level's
    own effect: throughput changes, the SLO-met share does not)."""
    out = []
    arms = [
        (PAYS, "dryrun1", Slo(tpot_s=PAYS_TPOT_MS / 1000)),
        (PAYS, "dryrun2", Slo(tpot_s=PAYS_TPOT_MS / 1000)),
        (DATA, "dryrun", Slo(ttft_s=60.0, tpot_s=6.49e-3)),
    ]
    for data, arm, slo in arms:
        ticks = [t for t in replay_ticks(arm, slo, data=data) if t.binding]
        _, times = throughput_inputs(arm, data)
        assert times is not None
        bounds = (times["load_start"], times["load_end"] + 15)
        for k in range(len(ticks) - 80):
            t0, t1 = ticks[k].t_s, ticks[k + 79].t_s
            if t1 - t0 > 85 or any(t0 - 5 <= b <= t1 for b in bounds):
                continue
            out.append(aba_legs(ticks, k, effect))
    return out


def aba_legs(ticks: list[RecordedTick], k: int, effect: float) -> Legs:
    """The A-B-A legs of 80 seconds of ticks from `k`: A (20 s), settle (10 s), B (20 s), settle (10 s),
    A' (20 s); `effect` scales B's tokens, goodput and finished tokens (a level's own effect:
    throughput changes, the SLO-met share does not)."""
    b = [
        replace(
            t,
            tokens=t.tokens * effect,
            good_tokens=t.good_tokens * effect,
            finished_tokens=t.finished_tokens * effect,
        )
        for t in ticks[k + 30 : k + 50]
    ]
    return ticks[k : k + 20], b, ticks[k + 60 : k + 80]


def test_null_trials_cut_from_advice_only_runs_rarely_read_as_a_gain() -> None:
    """The noise margin on recorded H200 traffic: legs cut from advice-only runs (no move) are judged a
    gain in 2 % of 321 trials on goodput and in none on tokens; the old before/after (kept at +3 %)
    kept 42 % and 25 %. Per-tick goodput under the load is autocorrelated (lag 1: 0.6-0.75), so the
    per-tick standard error understates a 20 s leg's by 3-6x; the bracket's max and min make up for it.
    With a real effect on B: +30 % tokens reads as a gain in 85 %, never as no gain; -30 % tokens as no
    gain in all; goodput's +30 % is a gain only in 8 % (its noise is that large) and no gain in under 1 %."""
    null = null_trials()
    assert len(null) == 321
    for objective, most, old_least in (("goodput", 0.03, 0.35), ("tokens", 0.0, 0.2)):
        verdicts = [judge_aba(objective, 0.03, *legs) for legs in null]
        gains = sum(1 for v in verdicts if v is not None and v.verdict == "gain") / len(null)
        old = sum(
            1
            for a, b, _ in null
            if (objective_value(objective, b) or 0) >= (objective_value(objective, a) or 0) * 1.03
        ) / len(null)
        assert gains <= most and old >= old_least, (objective, gains, old)
    for effect, objective, check in (
        (1.3, "tokens", lambda n: n["gain"] >= 0.8 and n["no_gain"] == 0),
        (0.7, "tokens", lambda n: n["no_gain"] == 1.0),
        (1.3, "goodput", lambda n: n["no_gain"] <= 0.01),
    ):
        trials = null_trials(effect)
        shares = Counter(
            v.verdict if v is not None else "none"
            for v in (judge_aba(objective, 0.03, *legs) for legs in trials)
        )
        n = {k: shares[k] / len(trials) for k in ("gain", "no_gain", "inconclusive")}
        assert check(n), (effect, objective, n)


def product_goodput(ticks: Iterable[RecordedTick]) -> float | None:
    """Goodput estimated as throughput x token-weighted SLO attainment: (tokens generated / seconds) x
    (good tokens / finished tokens). Unknown (None) when tokens came but nothing finished."""
    seconds = tokens = good = finished = 0.0
    for tk in ticks:
        seconds, tokens = seconds + tk.interval_s, tokens + tk.tokens
        good, finished = good + tk.good_tokens, finished + tk.finished_tokens
    if seconds <= 0 or (finished <= 0 and tokens > 0):
        return None
    return 0.0 if finished <= 0 else tokens / seconds * good / finished


def product_goodput_se(ticks: Iterable[RecordedTick]) -> float | None:
    """Its standard error by the delta method (covariance included): per tick the linearised influence
    z = s (y - tp x) / X + tp (g - s f) / F, tp = Y / X (tokens y, seconds x), s = G / F (good g, finished
    f); se = sqrt(n / (n - 1) x sum z^2), the ratio estimator's when either factor is constant."""
    legs = list(ticks)
    n = len(legs)
    seconds = sum(tk.interval_s for tk in legs)
    finished = sum(tk.finished_tokens for tk in legs)
    if n < 2 or seconds <= 0 or finished <= 0:
        return None
    tp = sum(tk.tokens for tk in legs) / seconds
    share = sum(tk.good_tokens for tk in legs) / finished
    z = [
        share * (tk.tokens - tp * tk.interval_s) / seconds
        + tp * (tk.good_tokens - share * tk.finished_tokens) / finished
        for tk in legs
    ]
    return math.sqrt(n / (n - 1) * sum(x * x for x in z))


def verdict_shares(trials: list[Legs]) -> dict[str, float]:
    verdicts = Counter(
        v.verdict if v is not None else "none" for v in (judge_aba("goodput", 0.03, *legs) for legs in trials)
    )
    return {k: verdicts[k] / len(trials) for k in ("gain", "no_gain", "inconclusive")}


def test_goodput_as_throughput_times_slo_share_is_no_less_noisy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tried and not taken: goodput of a leg as throughput x the SLO-met share of the finished requests'
    output tokens (product_goodput, its delta-method noise product_goodput_se) against today's good
    tokens / seconds, on the same 321 recorded null trials. With no effect: a gain in 3.7 % (today 2.2 %);
    +30 % on B: a gain in 10.0 % (today 8.4 %); -30 %: no gain in 1.2 % (both), but a gain in 1.6 %
    (today none). Why: the burst is not which requests finish in a 20 s leg (finished tokens/s vary from
    leg to leg as little as tokens/s do, sd of log(B / mean of A, A') 0.10 and 0.09) but whether they met
    the SLO: their share swings 0 to 0.8 between legs 30 s apart (sd of that log 2.2 where no leg is 0).
    Even without noise, B x 1.3 exceeds both A legs by 3 % in 26.5 % of the trials on either goodput
    estimator (91 % on tokens): over 20 s legs the quantity itself, not its estimator, drifts."""
    null = null_trials()
    assert len(null) == 321
    old = {effect: verdict_shares(null_trials(effect)) for effect in (1.0, 1.3, 0.7)}

    original_value, original_se = downscale.objective_value, downscale.objective_se

    def value(objective: str, ticks: Iterable[Tick]) -> float | None:
        if objective != "goodput":
            return original_value(objective, ticks)
        return product_goodput(t for t in ticks if isinstance(t, RecordedTick))

    def se(objective: str, ticks: Iterable[Tick]) -> float | None:
        if objective != "goodput":
            return original_se(objective, ticks)
        return product_goodput_se(t for t in ticks if isinstance(t, RecordedTick))

    monkeypatch.setattr(downscale, "objective_value", value)
    monkeypatch.setattr(downscale, "objective_se", se)
    new = {effect: verdict_shares(null_trials(effect)) for effect in (1.0, 1.3, 0.7)}
    assert old[1.0]["gain"] <= 0.03 and 0.03 <= new[1.0]["gain"] <= 0.05, (old, new)
    assert 0.06 <= old[1.3]["gain"] <= 0.11 and 0.08 <= new[1.3]["gain"] <= 0.12, (old, new)
    assert new[1.3]["gain"] - old[1.3]["gain"] < 0.05  # not clearly better: today's estimator stays
    assert old[0.7]["no_gain"] <= 0.02 and new[0.7]["no_gain"] <= 0.02, (old, new)
    assert old[0.7]["gain"] == 0 and new[0.7]["gain"] > 0, (old, new)

    def spread(f: Any) -> float:
        logs = []
        for a, b, a2 in null:
            x, y, z = f(a), f(b), f(a2)
            if x > 0 and y > 0 and z > 0:
                logs.append(math.log(y / (0.5 * (x + z))))
        return statistics.pstdev(logs)

    def rate(attr: str) -> Any:
        return lambda leg: sum(getattr(t, attr) for t in leg) / sum(t.interval_s for t in leg)

    def share(leg: list[RecordedTick]) -> float:
        return sum(t.good_tokens for t in leg) / max(1.0, sum(t.finished_tokens for t in leg))

    assert spread(rate("tokens")) < 0.12 and spread(rate("finished_tokens")) < 0.12
    assert spread(share) > 1.5 and spread(rate("good_tokens")) > 1.5
    for f in (product_goodput, lambda leg: objective_value("goodput", leg)):
        beyond = sum(1 for a, b, a2 in null if 1.3 * (f(b) or 0) >= 1.03 * max(f(a) or 0, f(a2) or 0, 1e-9))
        assert 0.22 < beyond / len(null) < 0.31, beyond
    tokens = sum(
        1
        for a, b, a2 in null
        if 1.3 * (objective_value("tokens", b) or 0)
        >= 1.03 * max(objective_value("tokens", a) or 0, objective_value("tokens", a2) or 0)
    )
    assert tokens / len(null) > 0.85, tokens
