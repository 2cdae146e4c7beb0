"""The throttle detector over the real H200 recording and over constructed readings."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from soakd.policies.throttle import (
    ThrottleDetector,
    ThrottleInput,
    ThrottleSettings,
    ThrottleState,
    Transition,
    counters_from_fields,
    host_input,
    reason_names,
)

RECORDING = Path(__file__).parents[2] / "data" / "h200" / "nvml_soak_then_matmul_burn.jsonl.gz"
OK, THROTTLED, RECOVERING = ThrottleState.OK, ThrottleState.THROTTLED, ThrottleState.RECOVERING


def _rows() -> list[dict[str, Any]]:
    with gzip.open(RECORDING, "rt") as fh:
        lines = [json.loads(line) for line in fh]
    assert "header" in lines[0]
    return lines[1:]


def _gpu_input(t: float, gpu: dict[str, Any]) -> ThrottleInput:
    return ThrottleInput(
        t_s=t,
        sm_mhz=gpu["sm_mhz"],
        reasons=gpu["reasons"],
        throttle_ns=counters_from_fields(gpu.get("fields", {})),
        thermal_margin_c=gpu.get("margin_c"),
        active=gpu["util_gpu"] > 0,
    )


def _feed(det: ThrottleDetector, inputs: list[ThrottleInput]) -> list[Transition]:
    out: list[Transition] = []
    for inp in inputs:
        out.extend(det.update(inp))
    return out


def test_h200_recording_burn_enters_once_and_recovers() -> None:
    rows = _rows()
    gpus = [r["gpus"][0] for r in rows]
    soak_start = next(r["t"] for r, g in zip(rows, gpus, strict=True) if g["util_gpu"] > 0)
    burn_start = next(
        r["t"] for r, g in zip(rows, gpus, strict=True) if r["t"] > soak_start and g["reasons"] & 0x4
    )
    burn_end = max(r["t"] for r, g in zip(rows, gpus, strict=True) if g["reasons"] & 0x4)
    with_fields = [g["fields"] for g in gpus if "fields" in g]
    power_growth_s = (with_fields[-1]["74"] - with_fields[0]["74"]) / 1e9
    assert power_growth_s == pytest.approx(25.35, abs=0.01)

    inputs = [_gpu_input(r["t"], g) for r, g in zip(rows, gpus, strict=True)]
    # The recording stops 1.5 s after the burn: extend it with idle readings (GpuIdle, counters unchanged)
    # so the detector can leave "throttled" and finish recovering.
    last_t = rows[-1]["t"]
    for i in range(1, 600):
        idle = {"sm_mhz": 345, "reasons": 0x1, "util_gpu": 0}
        if i % 10 == 0:
            idle |= {"fields": with_fields[-1], "margin_c": 45}
        inputs.append(_gpu_input(round(last_t + 0.1 * i, 4), idle))

    det = ThrottleDetector()
    transitions = _feed(det, inputs)
    path = [(tr.from_state, tr.to_state) for tr in transitions]
    assert path == [(OK, THROTTLED), (THROTTLED, RECOVERING), (RECOVERING, OK)]
    enter, leave, ok = transitions
    assert burn_start <= enter.t_s <= burn_start + 3.0
    assert "sw_power_cap" in enter.reasons
    assert enter.clock_ratio is not None and enter.clock_ratio < 0.85
    assert burn_end < leave.t_s <= burn_end + 15.0
    assert ok.t_s >= leave.t_s + det.settings.recover_s
    assert det.state is OK
    assert det.baseline_mhz == 1980
    assert det.per_reason_s["power"] == pytest.approx(power_growth_s, rel=0.01)
    assert det.throttled_s == pytest.approx(leave.t_s - enter.t_s)
    summary = det.summary()
    assert summary["enters"] == 1
    assert summary["state"] == "ok"


def _gpu(t: float, reasons: int, mhz: float = 1980, *, active: bool = True) -> ThrottleInput:
    return ThrottleInput(t_s=t, sm_mhz=mhz, reasons=reasons, active=active)


def test_benign_bits_while_idle_are_ignored() -> None:
    det = ThrottleDetector(max_mhz=1980)
    benign = [0x1, 0x2, 0x100, 0x1 | 0x2 | 0x100]
    inputs = [_gpu(i * 0.1, benign[i % 4], mhz=345, active=False) for i in range(1000)]
    assert _feed(det, inputs) == []
    assert det.state is OK


def test_single_hw_slowdown_sample_is_ignored_but_a_run_is_not() -> None:
    settings = ThrottleSettings(window_s=1.0, min_dwell_s=0.0)
    det = ThrottleDetector(settings, max_mhz=1980)
    inputs = [_gpu(i * 0.1, 0x8 if i % 20 == 5 else 0) for i in range(200)]
    assert _feed(det, inputs) == []

    det = ThrottleDetector(settings, max_mhz=1980)
    run = [_gpu(i * 0.1, 0x8 if 50 <= i < 70 else 0) for i in range(100)]
    transitions = _feed(det, run)
    assert transitions[0].to_state is THROTTLED
    assert transitions[0].reasons == ("hw_slowdown",)


def test_toggling_signal_does_not_flap() -> None:
    det = ThrottleDetector(max_mhz=1980)
    # SwPowerCap on for one second, off for one second, for five minutes, at 10 Hz, clock following.
    inputs = []
    for i in range(3000):
        on = (i // 10) % 2 == 0
        inputs.append(_gpu(i * 0.1, 0x4 if on else 0, mhz=1500 if on else 1980))
    transitions = _feed(det, inputs)
    assert [tr.to_state for tr in transitions] == [THROTTLED]
    # Then quiet: it leaves once, recovers once.
    quiet = [_gpu(300 + i * 0.1, 0) for i in range(1000)]
    after = _feed(det, quiet)
    assert [tr.to_state for tr in after] == [RECOVERING, OK]


def test_min_dwell_holds_each_state() -> None:
    det = ThrottleDetector(max_mhz=1980)
    # A 3-second episode: throttled is held at least min_dwell_s before recovering.
    inputs = [
        _gpu(i * 0.1, 0x4 if 100 <= i < 130 else 0, mhz=1400 if 100 <= i < 130 else 1980) for i in range(900)
    ]
    transitions = _feed(det, inputs)
    assert [tr.to_state for tr in transitions] == [THROTTLED, RECOVERING, OK]
    enter, leave, ok = transitions
    assert leave.t_s - enter.t_s >= det.settings.min_dwell_s
    assert ok.t_s - leave.t_s >= det.settings.recover_s


def test_signals_returning_while_recovering_re_enter() -> None:
    det = ThrottleDetector(max_mhz=1980)
    inputs = []
    for i in range(1000):
        t = i * 0.1
        on = t < 5 or 30 <= t < 40
        inputs.append(_gpu(t, 0x4 if on else 0, mhz=1400 if on else 1980))
    transitions = _feed(det, inputs)
    assert [tr.to_state for tr in transitions][:3] == [THROTTLED, RECOVERING, THROTTLED]


def test_counter_growth_alone_triggers() -> None:
    # No bitmask, full clock: short power-cap episodes between 1 Hz polls show only in the counter.
    det = ThrottleDetector(max_mhz=1980)
    inputs = []
    power = 0
    for i in range(120):
        if 20 <= i < 30:
            power += 50_000_000  # 50 ms of capping per second
        inputs.append(ThrottleInput(t_s=float(i), sm_mhz=1980, reasons=None, throttle_ns={"power": power}))
    transitions = _feed(det, inputs)
    assert [tr.to_state for tr in transitions] == [THROTTLED, RECOVERING, OK]
    assert transitions[0].t_s == 20.0
    assert transitions[0].reasons == ("counter:power",)
    assert det.per_reason_s["power"] == pytest.approx(0.5)


def test_benign_counter_growth_does_not_trigger() -> None:
    det = ThrottleDetector(max_mhz=1980)
    inputs = [
        ThrottleInput(
            t_s=float(i),
            sm_mhz=345,
            reasons=0x1,
            throttle_ns={"low_util": i * 10**9, "total_app_clocks": i * 10**9, "power": 0},
            active=False,
        )
        for i in range(100)
    ]
    assert _feed(det, inputs) == []
    assert det.per_reason_s["low_util"] == pytest.approx(99.0)


def test_counter_reset_is_handled() -> None:
    det = ThrottleDetector(max_mhz=1980)
    values = [0, 2 * 10**9, 5 * 10**9, 10**9, 3 * 10**9]  # reset between 5 s and 1 s
    for i, v in enumerate(values):
        det.update(ThrottleInput(t_s=float(i), sm_mhz=1980, reasons=None, throttle_ns={"power": v}))
    assert det.per_reason_s["power"] == pytest.approx(2 + 3 + 1 + 2)
    assert det.summary()["counter_resets"] == 1


def test_thermal_margin_triggers() -> None:
    det = ThrottleDetector(max_mhz=1980)
    inputs = [
        ThrottleInput(t_s=float(i), sm_mhz=1980, reasons=0, thermal_margin_c=3.0 if 10 <= i < 20 else 30.0)
        for i in range(80)
    ]
    transitions = _feed(det, inputs)
    assert [tr.to_state for tr in transitions] == [THROTTLED, RECOVERING, OK]
    assert "thermal_margin_c=3" in transitions[0].detail


def test_baseline_is_median_of_first_active_samples() -> None:
    det = ThrottleDetector(ThrottleSettings(baseline_samples=5))
    for i, mhz in enumerate([345, 345, 1900, 1980, 1980, 1960, 1980, 1200]):
        det.update(_gpu(float(i), 0, mhz=mhz, active=mhz > 400))
    assert det.baseline_mhz == 1980


def test_host_input_from_sysfs_counts() -> None:
    det = ThrottleDetector()
    counts = {"package": 100, "core": 40}
    transitions: list[Transition] = []
    for i in range(120):
        if 30 <= i < 33:
            counts = {"package": counts["package"] + 2, "core": counts["core"] + 1}
        inp = host_input(float(i), 3000.0, 3000.0, counts, 40.0, active=True)
        assert inp.reasons is None
        transitions += det.update(inp)
    assert [tr.to_state for tr in transitions] == [THROTTLED, RECOVERING, OK]
    assert transitions[0].t_s == 30.0
    assert set(transitions[0].reasons) == {"counter:package", "counter:core"}
    assert det.per_reason_events == {"core": 3, "package": 6}
    assert det.per_reason_s == {}


def test_host_clock_ratio_against_max() -> None:
    det = ThrottleDetector()
    transitions: list[Transition] = []
    for i in range(60):
        mhz = 2000.0 if 10 <= i < 30 else 3500.0
        transitions += det.update(host_input(float(i), mhz, 3500.0, {}, None))
    assert transitions[0].to_state is THROTTLED
    assert transitions[0].clock_ratio == pytest.approx(2000 / 3500)


def test_reason_names_and_settings_validation() -> None:
    assert reason_names(0x4 | 0x1) == ("gpu_idle", "sw_power_cap")
    assert reason_names(0x200) == ("0x200",)
    with pytest.raises(ValueError, match="clock_ratio"):
        ThrottleSettings(clock_ratio_enter=0.95, clock_ratio_leave=0.9)
    det = ThrottleDetector()
    det.update(_gpu(5.0, 0))
    with pytest.raises(ValueError, match="out of order"):
        det.update(_gpu(4.0, 0))


def test_throughput_judge_needs_a_queue_a_held_limit_and_a_real_loss() -> None:
    from soakd.policies.throttle import ThroughputJudge, ThroughputSettings

    judge = ThroughputJudge(ThroughputSettings(loss=0.2, recent=3, min_reference=10, leave_s=5))
    t = 0.0
    for i in range(21):  # the reference: 1,000 tok/s with a queue, no limit, +-10 % noise
        t += 1
        assert judge.update(t, 1000.0 + (100 if i % 2 else -100), binding=True, limited=False) is None
    # All but the last 3 (the intervals being judged are not their own reference): 9 x 900, 9 x 1,100.
    assert judge.reference == 1000.0
    # A limit for one second in three, or without a queue, or with a 15 % loss: no harm.
    for i in range(9):
        t += 1
        assert judge.update(t, 500.0, binding=True, limited=i % 3 == 0) is None
    for _ in range(5):
        t += 1
        assert judge.update(t, 500.0, binding=False, limited=True) is None
    for _ in range(5):
        t += 1
        assert judge.update(t, 850.0, binding=True, limited=True) is None
    # Held at a limit with 40 % fewer tokens, a step down from the seconds before: harm once every recent
    # interval was at the limit (the third).
    for _ in range(10):
        t += 1
        assert judge.update(t, 1000.0, binding=True, limited=False) is None
    changes = []
    for _ in range(3):
        t += 1
        changes.append(judge.update(t, 600.0, binding=True, limited=True))
    assert changes == [None, None, True] and judge.harmful and judge.loss > 0.3
    for _ in range(5):  # the limit gone: over after leave_s
        t += 1
        assert judge.update(t, 1000.0, binding=True, limited=False) is None
    t += 1
    assert judge.update(t, 1000.0, binding=True, limited=False) is False and judge.episodes == 1


def test_throughput_judge_counts_prompt_tokens_so_a_surge_of_prompts_is_no_loss() -> None:
    """A busy engine at the cap that spends its steps on a surge of long prompts serves fewer output
    tokens for it: with prompt tokens left out that reads as a step down (harm with no outside cause);
    counted at the prefill weight it is the same work. A shared load lowers both, harm either way."""
    from soakd.policies.throttle import ThroughputJudge, ThroughputSettings

    def episodes(weight: float, surge: tuple[float, float]) -> int:
        judge = ThroughputJudge(
            ThroughputSettings(loss=0.2, recent=3, min_reference=10, prefill_weight=weight)
        )
        t = 0.0
        for i in range(30):  # 9,000 output tok/s +-5 % and 3,000 prompt tok/s, a queue, at the cap
            t += 1
            judge.update(t, 9000.0 + (450 if i % 2 else -450), binding=True, limited=True, prefill_per_s=3000)
        for _ in range(4):
            t += 1
            judge.update(t, surge[0], binding=True, limited=True, prefill_per_s=surge[1])
        return judge.episodes

    prompts = (6800.0, 12000.0)  # 24 % fewer output tokens while prompt tokens quadruple
    shared = (5400.0, 1800.0)  # both down 40 %
    assert episodes(0.0, prompts) == 1 and episodes(0.25, prompts) == 0
    assert episodes(0.0, shared) == 1 and episodes(0.25, shared) == 1
    # Unknown prompt tokens (an engine that reports no steps): output tokens alone, as before.
    judge = ThroughputJudge(ThroughputSettings(loss=0.2, recent=3, min_reference=10))
    for i in range(30):
        judge.update(float(i), 9000.0, binding=True, limited=True, prefill_per_s=None)
    for i in range(4):
        judge.update(30.0 + i, 6800.0, binding=True, limited=True, prefill_per_s=None)
    assert judge.episodes == 1 and judge.summary()["prefill_weight"] == 0.5
    with pytest.raises(ValueError, match="prefill_weight"):
        ThroughputSettings(prefill_weight=-0.1)


def test_throughput_judge_needs_the_gpu_as_busy_as_before_the_drop() -> None:
    """Tokens lost with the GPU's power down as much (an engine giving its GPU less work: steps slowed
    off the GPU) are no harm; the same tokens lost with the power held or raised (another process on the
    GPU) are. The gate is half the loss's share: 10 % at a loss of 20 %. Power unknown: as before."""
    from soakd.policies.throttle import ThroughputJudge, ThroughputSettings

    def episodes(after_w: float | None) -> int:
        judge = ThroughputJudge(ThroughputSettings(loss=0.2, recent=3, min_reference=10, prefill_weight=0))
        t = 0.0
        for i in range(30):  # 9,000 tok/s, a queue, at the cap, ~520 W
            t += 1
            power = None if after_w is None else 520.0 + (20 if i % 2 else -20)
            judge.update(t, 9000.0 + (300 if i % 2 else -300), binding=True, limited=True, power_w=power)
        for _ in range(4):  # 25 % fewer tokens
            t += 1
            judge.update(t, 6750.0, binding=True, limited=True, power_w=after_w)
        return judge.episodes

    assert episodes(420.0) == 0  # power down 19 %: the engine did less
    assert episodes(480.0) == 1  # down 8 %: within the gate
    assert episodes(700.0) == 1  # a shared load: the GPU busier than before
    assert episodes(None) == 1


def test_a_process_beside_the_engine_lifts_the_power_gate() -> None:
    """Another process newly computing on the GPU is an outside cause whatever the power does (a
    memory-bound neighbour at low power takes SM time too): the same 25 % drop with the power down 19 %
    is harm with a newcomer seen in the recent intervals, none without one, with the list unknown or
    with one there all along. One that shows only after its drop (the process list is read every 2 s)
    is still judged while the step stands."""
    from soakd.policies.throttle import ThroughputJudge, ThroughputSettings

    def run(shared_from: int | None, unknown: bool = False, all_along: bool = False) -> ThroughputJudge:
        judge = ThroughputJudge(ThroughputSettings(loss=0.2, recent=3, min_reference=10, prefill_weight=0))
        t = 0.0
        for i in range(30):
            t += 1
            judge.update(
                t,
                9000.0 + (300 if i % 2 else -300),
                binding=True,
                limited=True,
                power_w=520.0,
                shared=None if unknown else all_along,
            )
        for i in range(6):  # 25 % fewer tokens, the power down 19 %
            t += 1
            co = None if unknown else (all_along or (shared_from is not None and i >= shared_from))
            judge.update(t, 6750.0, binding=True, limited=True, power_w=420.0, shared=co)
        return judge

    assert run(None).episodes == 0 and run(None, unknown=True).episodes == 0
    judge = run(0)
    assert judge.episodes == 1 and judge.cotenant
    assert judge.summary()["cotenant_entries"] == 1 and judge.summary()["cotenant_intervals"] == 6
    assert run(4).episodes == 1  # seen 2 s after the step was first judged
    # There through the whole window (an idle process holding memory): no newcomer, the gate stands.
    assert run(None, all_along=True).episodes == 0


def test_a_second_process_beside_one_there_all_along_is_a_newcomer() -> None:
    """By PID: with one process on the GPU all along (an idle notebook), a second one that comes with the
    drop lifts the power gate; the same drop with the first one alone, or with the second there all
    along too, does not."""
    from soakd.policies.throttle import ThroughputJudge, ThroughputSettings

    old, new = frozenset({"100"}), frozenset({"100", "200"})

    def run(during: frozenset[str], before: frozenset[str] = old, unknown_from: int = 30) -> ThroughputJudge:
        judge = ThroughputJudge(ThroughputSettings(loss=0.2, recent=3, min_reference=10, prefill_weight=0))
        for i in range(30):
            tps = 9000.0 + (300 if i % 2 else -300)
            seen = before if i < unknown_from else None
            judge.update(float(i), tps, binding=True, limited=True, power_w=520.0, shared=seen)
        for i in range(6):  # 25 % fewer tokens, the power down 19 %: the gate alone would hold it back
            judge.update(30.0 + i, 6750.0, binding=True, limited=True, power_w=420.0, shared=during)
        return judge

    judge = run(new)
    assert judge.episodes == 1 and judge.cotenant and judge.summary()["cotenant_entries"] == 1
    assert run(old).episodes == 0 and not run(old).cotenant
    assert run(new, before=new).episodes == 0
    # The list unknown for the 5 s before the drop (an engine between processes): the old process seen
    # again is not new for having been out of sight; the second one, absent where the list was known,
    # still is.
    assert run(old, unknown_from=25).episodes == 0 and run(new, unknown_from=25).episodes == 1


def test_throughput_judge_ignores_drift_at_the_cap_and_ends_when_the_drop_reverses() -> None:
    """An engine alone at the power cap whose tokens/s drift down with its workload is no harm (no step);
    a step down is, and it is over when tokens/s climb back by the loss's share over the episode's level,
    even with the limit still there; the reference then restarts from the recovered figures."""
    from soakd.policies.throttle import ThroughputJudge, ThroughputSettings

    judge = ThroughputJudge(ThroughputSettings(loss=0.2, recent=3, min_reference=10, step=10, leave_s=5))
    t = 0.0
    for _ in range(20):
        t += 1
        judge.update(t, 1000.0, binding=True, limited=False)
    for i in range(60):  # at the cap, 1,000 -> 640 tok/s over a minute: 36 % below where it started
        t += 1
        assert judge.update(t, 1000.0 - 6.0 * i, binding=True, limited=True) is None
    # The reference follows the engine's own level at the cap (the limit no longer keeps those intervals
    # out of it), so the drift is 23 % below it rather than 36 %: still more than the loss, and no harm,
    # because it came as a drift and not as a step.
    assert judge.loss > 0.2 and not judge.harmful
    changes = []
    for _ in range(20):  # a step to 300: harm
        t += 1
        changes.append(judge.update(t, 300.0, binding=True, limited=True))
    assert changes.count(True) == 1 and judge.harmful
    changes = []
    for _ in range(8):  # back to 640 at the cap: 36 % below the old reference, 2.1 x the episode's level
        t += 1
        changes.append((t, judge.update(t, 640.0, binding=True, limited=True)))
    ended = [at for at, c in changes if c is False]
    assert ended and not judge.harmful and judge.episodes == 1
    # The reference is now the recovered figure: the same tokens/s at the cap are no loss.
    t += 1
    judge.update(t, 640.0, binding=True, limited=True)
    assert judge.reference == 640.0 and judge.loss == 0.0


def test_throughput_settings_bound_the_step_window() -> None:
    from soakd.policies.throttle import ThroughputSettings

    with pytest.raises(ValueError, match="step"):
        ThroughputSettings(step=0)
    with pytest.raises(ValueError, match="step"):
        ThroughputSettings(step=10**6)


def test_throughput_judge_reads_a_backlog_in_the_engine_as_capacity() -> None:
    """No one waits for admission yet, but the requests in the engine climb while tokens/s fall: the
    engine no longer serves the offered load, so tokens/s are its capacity and a held limit with the loss
    is harm. The same seconds without the requests in the engine are not judged (tokens/s could be a
    lull of the trace); a lull (requests and tokens down together) is not a backlog."""
    from soakd.policies.throttle import ThroughputJudge, ThroughputSettings

    def run(flight: list[int] | None, tokens: list[float]) -> tuple[ThroughputJudge, list[bool | None]]:
        judge = ThroughputJudge(ThroughputSettings(loss=0.2, recent=3, min_reference=10, step=10))
        t = 0.0
        for i in range(20):  # the offered load, served in full: 1,000 tok/s, 30 requests in the engine
            t += 1
            judge.update(t, 1000.0 + (50 if i % 2 else -50), binding=False, limited=False, in_flight=30)
        changes = []
        for k, tps in enumerate(tokens):
            t += 1
            n = flight[k] if flight is not None else None
            changes.append(judge.update(t, tps, binding=False, limited=True, in_flight=n))
        return judge, changes

    judge, changes = run([36, 45, 55, 63], [300.0, 450.0, 500.0, 500.0])
    assert changes == [None, None, True, None] and judge.harmful and judge.backlogs == 4
    assert judge.summary()["backlog_intervals"] == 4
    judge, changes = run(None, [300.0, 450.0, 500.0, 500.0])
    assert changes == [None] * 4 and judge.backlogs == 0
    judge, changes = run([20, 15, 12, 12], [300.0, 450.0, 500.0, 500.0])  # a lull: fewer requests
    assert changes == [None] * 4 and judge.backlogs == 0
    judge, changes = run([32, 32, 32, 32], [300.0, 450.0, 500.0, 500.0])  # within half the loss's share
    assert changes == [None] * 4 and judge.backlogs == 0
