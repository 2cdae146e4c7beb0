"""The harm judges over constructed streams that reproduce what an H200 showed: a workload at its power
cap most of the time, a second process's load at the same cap, and the engine alone again afterwards.
Clock harm must end when its cause ends (or on its bound), and throughput harm must see the load although
the workload was at a limit before it."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.config import load
from soakd.policies.throttle import (
    HarmChange,
    HarmJudge,
    HarmSettings,
    ThroughputJudge,
    ThroughputSettings,
)

CAP = 0x4
SW_THERMAL = 0x20
MAX_MHZ = 1980.0
DT = 0.1  # the fast tier: 10 samples a second


def phase(
    rng: random.Random, t0: float, seconds: float, mhz: float, bits: int, *, share: float = 1.0
) -> Iterator[tuple[float, float, int]]:
    """Samples (t, SM MHz, reasons) for `seconds` from `t0`: `bits` set in `share` of them at `mhz` (+-1 %),
    the others unthrottled at the max clock."""
    for k in range(round(seconds / DT)):
        if rng.random() < share:
            yield t0 + k * DT, mhz * rng.uniform(0.99, 1.01), bits
        else:
            yield t0 + k * DT, MAX_MHZ, 0


def feed(judge: HarmJudge, samples: Iterator[tuple[float, float, int]]) -> list[HarmChange]:
    return [c for t, mhz, bits in samples if (c := judge.update(t, mhz, bits, active=True)) is not None]


def test_harm_from_a_shared_load_ends_at_the_engines_own_at_cap_clock() -> None:
    """The H200 case: vLLM alone at the power cap in 80 % of samples at ~1,860 MHz (6 % below the
    unthrottled 1,980) is no harm; a second process at the cap pulls the clock to ~1,600: harm; once it
    stops, vLLM is back at its own ~1,860 at the cap. Still 6 % down, between half the threshold and the
    threshold, where the harm used to stay open for minutes; now it ends within leave_s + window."""
    rng = random.Random(1)
    s = HarmSettings()
    judge = HarmJudge(s, max_mhz=MAX_MHZ)
    assert feed(judge, phase(rng, 0.0, 60.0, 1860.0, CAP, share=0.8)) == []
    assert not judge.harmful and 0.05 < judge.loss < 0.10
    assert judge.own_cap_mhz == pytest.approx(1860.0, rel=0.01)
    began = feed(judge, phase(rng, 60.0, 150.0, 1600.0, CAP))
    assert [c.harmful for c in began] == [True] and began[0].kind == "power"
    assert began[0].t_s - 60.0 <= s.enter_s + s.window_s
    assert began[0].own_cap_mhz == pytest.approx(1860.0, rel=0.01)
    after = feed(judge, phase(rng, 210.0, 120.0, 1860.0, CAP, share=0.8))
    (ended,) = after
    assert not ended.harmful and ended.ended_by == "own_level"
    assert ended.t_s - 210.0 <= s.leave_s + s.window_s + 1.0
    # Against the unthrottled clock alone it was still in the band: the old test would have held it open.
    assert s.power_loss / 2 <= ended.loss < s.power_loss
    # The load's samples never became the engine's own level, and the engine alone opens no new episode.
    assert judge.own_cap_mhz == pytest.approx(1860.0, rel=0.01)
    assert judge.episodes == 1 and judge.harm_s == pytest.approx(150.0, abs=s.leave_s + 3.0)
    summary = judge.summary()
    assert summary["ended_by"] == {"own_level": 1} and summary["own_cap_mhz"] == pytest.approx(1860, rel=0.01)


def test_an_episode_stuck_in_the_band_ends_on_the_bound_and_needs_a_new_drop() -> None:
    """No at-cap samples before the load, so no own level to end on: the episode sits in the band (6 %
    loss) after the load and ends stale_s after its loss last reached the threshold, by the bound. Its
    clock is the engine's own level from then on: a few percent lower is no new episode, a new drop is."""
    rng = random.Random(2)
    s = HarmSettings()
    judge = HarmJudge(s, max_mhz=MAX_MHZ)
    assert feed(judge, phase(rng, 0.0, 30.0, MAX_MHZ, 0)) == []
    assert judge.own_cap_mhz is None
    assert [c.harmful for c in feed(judge, phase(rng, 30.0, 30.0, 1600.0, CAP))] == [True]
    (ended,) = feed(judge, phase(rng, 60.0, 140.0, 1860.0, CAP))
    assert ended.ended_by == "bound" and not judge.harmful
    assert s.stale_s <= ended.t_s - 60.0 <= s.stale_s + s.window_s + 0.5
    assert ended.own_cap_mhz == pytest.approx(1860.0, rel=0.01)
    # 10.4 % below the unthrottled clock, but within half the threshold of the rebased own level.
    assert feed(judge, phase(rng, 200.0, 30.0, 1775.0, CAP)) == []
    assert [c.harmful for c in feed(judge, phase(rng, 230.0, 10.0, 1600.0, CAP))] == [True]
    assert judge.episodes == 2 and judge.ended_by == {"bound": 1}


def test_the_own_at_cap_clock_never_ends_thermal_harm() -> None:
    """The device protecting itself keeps the strict test: back at the engine's own at-cap clock with the
    thermal reason gone, a thermal episode stays open (neither the own level nor the bound ends it) until
    its loss is below half the threshold."""
    rng = random.Random(3)
    s = HarmSettings()
    judge = HarmJudge(s, max_mhz=MAX_MHZ)
    feed(judge, phase(rng, 0.0, 60.0, 1860.0, CAP, share=0.8))
    assert judge.own_cap_mhz is not None
    (began,) = feed(judge, phase(rng, 60.0, 20.0, 1800.0, SW_THERMAL | CAP))
    assert began.kind == "thermal"
    # Samples with a thermal reason never feed the own at-cap level.
    assert judge.own_cap_mhz == pytest.approx(1860.0, rel=0.01)
    assert feed(judge, phase(rng, 80.0, 2 * s.stale_s, 1860.0, CAP, share=0.8)) == []
    assert judge.harmful and judge.kind == "thermal"
    (ended,) = feed(judge, phase(rng, 80.0 + 2 * s.stale_s, 20.0, MAX_MHZ, 0))
    assert ended.ended_by == "loss" and ended.kind == "thermal"


def test_harm_settings_bound_the_stale_time(tmp_path: Path) -> None:
    assert HarmSettings().stale_s == 60.0 and load(None, env={}).control.harm.stale == 60.0
    for bad in (0.0, -1.0, float("inf"), 3601.0):
        with pytest.raises(ValueError, match="stale_s"):
            HarmSettings(stale_s=bad)
    path = tmp_path / "c.toml"
    path.write_text('[control.harm]\nstale = "90s"\n')
    assert load(path, env={}).control.harm.stale == 90.0


def test_harm_leave_events_say_how_the_harm_ended() -> None:
    """The collector's events: harm_leave carries ended_by and the own at-cap clock, and its message says
    whether the bound ended it."""
    events: list[tuple[str, str, dict[str, Any]]] = []
    watch = GpuThrottleWatch({0: MAX_MHZ}, on_event=lambda kind, msg, **f: events.append((kind, msg, f)))
    slow = {"util_gpu": 90.0, "margin_c": 30.0}
    rng = random.Random(4)
    streams = [
        phase(rng, 0.0, 60.0, 1860.0, CAP, share=0.8),
        phase(rng, 60.0, 30.0, 1600.0, CAP),
        phase(rng, 90.0, 30.0, 1860.0, CAP, share=0.8),
    ]
    for stream in streams:
        for t, mhz, bits in stream:
            watch.observe(0, t, {"sm_mhz": mhz, "reasons": bits, "power_mw": 690_000}, slow)
    harm = [e for e in events if e[0].startswith("harm_")]
    assert [e[0] for e in harm] == ["harm_enter", "harm_leave"]
    _, message, fields = harm[1]
    assert fields["ended_by"] == "own_level" and fields["own_cap_mhz"] == pytest.approx(1860, rel=0.01)
    assert "own at-cap clock" in message and "harm is over" in message
    assert watch.summary()["0"]["harm"]["ended_by"] == {"own_level": 1}  # type: ignore[index]

    events.clear()
    watch = GpuThrottleWatch({0: MAX_MHZ}, on_event=lambda kind, msg, **f: events.append((kind, msg, f)))
    streams = [
        phase(rng, 0.0, 30.0, MAX_MHZ, 0),
        phase(rng, 30.0, 30.0, 1600.0, CAP),
        phase(rng, 60.0, 90.0, 1860.0, CAP),
    ]
    for stream in streams:
        for t, mhz, bits in stream:
            watch.observe(0, t, {"sm_mhz": mhz, "reasons": bits}, slow)
    harm = [e for e in events if e[0].startswith("harm_")]
    assert [e[0] for e in harm] == ["harm_enter", "harm_leave"]
    _, message, fields = harm[1]
    assert fields["ended_by"] == "bound" and "ended by the bound" in message and "60 s" in message


def throughput_stream(
    rng: random.Random, n: int, tps: float, *, noise: float, limited_share: float, binding: bool = True
) -> list[tuple[float, bool, bool]]:
    return [
        (tps * rng.uniform(1 - noise, 1 + noise), binding, rng.random() < limited_share) for _ in range(n)
    ]


@pytest.mark.parametrize("limited_share", [0.8, 0.9, 1.0])
def test_throughput_harm_is_seen_in_a_workload_at_the_cap_most_of_the_time(limited_share: float) -> None:
    """The H200 case: with requests waiting the workload is at its power cap in 80-100 % of intervals, so a
    reference of unlimited intervals never formed and a 40 % fall under a shared load read as no loss. The
    engine's own level is the reference now: the fall is harm within 5 intervals, its intervals never
    lower the reference, and the harm is over once the load has gone."""
    rng = random.Random(5)
    judge = ThroughputJudge(ThroughputSettings(loss=0.2))
    t = 0.0
    before = throughput_stream(rng, 120, 10_000.0, noise=0.1, limited_share=limited_share)
    for tps, b, lim in before:
        t += 1
        assert judge.update(t, tps, binding=b, limited=lim) is None
    assert judge.reference == pytest.approx(10_000.0, rel=0.05)
    drop = t
    changes = []
    for tps, b, lim in throughput_stream(rng, 60, 6_000.0, noise=0.1, limited_share=1.0):
        t += 1
        changes.append((t, judge.update(t, tps, binding=b, limited=lim)))
    began = [at for at, c in changes if c is True]
    assert began and began[0] - drop <= 5 and judge.harmful and judge.loss > 0.3
    # The reference is the last 60 intervals before the drop: none of the load's made it in.
    assert judge.reference == statistics.median(tps for tps, _, _ in before[-60:])
    ended = []
    for tps, b, lim in throughput_stream(rng, 60, 10_000.0, noise=0.1, limited_share=limited_share):
        t += 1
        if judge.update(t, tps, binding=b, limited=lim) is False:
            ended.append(t)
    summary = judge.summary()
    assert len(ended) == 1 and judge.episodes == 1 and summary["harmful"] is False
    assert summary["reference_tps"] == pytest.approx(10_000.0, rel=0.05) and "reference_note" not in summary


@pytest.mark.parametrize("limited_share", [0.8, 1.0])
def test_an_engine_alone_at_the_cap_with_noisy_tokens_is_no_throughput_harm(limited_share: float) -> None:
    rng = random.Random(6)
    judge = ThroughputJudge()
    stream = throughput_stream(rng, 1200, 10_000.0, noise=0.15, limited_share=limited_share)
    for t, (tps, b, lim) in enumerate(stream):
        judge.update(float(t), tps, binding=b, limited=lim)
    assert judge.episodes == 0 and judge.reference == pytest.approx(10_000.0, rel=0.05)


def test_without_intervals_with_a_queue_the_summary_says_there_is_no_reference() -> None:
    """A loss of 0 with no reference is not "no loss": the summary says why it judged nothing."""
    judge = ThroughputJudge()
    for k in range(100):  # idle: nothing served, nothing waiting
        judge.update(float(k), 0.0, binding=False, limited=True)
    summary = judge.summary()
    assert summary["loss"] == 0.0 and summary["reference_tps"] is None and summary["reference_kind"] == ""
    assert summary["reference_note"] == (
        "no reference: never 10 intervals with requests waiting (0 seen) nor 10 busy ones without"
    )
    # Twelve with a queue: the last three are being judged, nine of the ten it needs are in.
    t = 0.0
    for _ in range(12):
        t += 1
        judge.update(t, 8_000.0, binding=True, limited=True)
    note = judge.summary()["reference_note"]
    assert isinstance(note, str) and note.startswith("no reference: 9 of the 10 intervals with requests")
    t += 1
    judge.update(t, 8_000.0, binding=True, limited=True)
    assert judge.summary()["reference_tps"] == 8_000.0 and "reference_note" not in judge.summary()


def test_a_shared_load_that_makes_the_first_queue_is_judged_against_the_load_served_before() -> None:
    """The H200 matrix case: no request waited before the shared load (the engine served the whole offered
    load), so the only intervals with a queue were the loaded ones and the 27-45 % fall made its own
    reference. What the engine served lately with no queue is a lower bound of its capacity: the fall is
    harm within 5 intervals of the load. The trace's ramp-up at the run's start (a low offered load) does
    not drag that reference down; once intervals with a queue are enough, they are the reference."""
    rng = random.Random(11)
    judge = ThroughputJudge(ThroughputSettings(loss=0.2))
    t = 0.0
    for k in range(20):  # the ramp: 500 -> 9,000 tok/s offered, all served, nothing waits
        t += 1
        judge.update(t, 500.0 + k * 450.0, binding=False, limited=False)
    for _ in range(15):
        t += 1
        judge.update(t, 9_000.0 * rng.uniform(0.9, 1.1), binding=False, limited=rng.random() < 0.2)
    assert judge.reference_kind == "served" and judge.reference == pytest.approx(9_000.0, rel=0.1)
    drop = t
    began = None
    for _ in range(30):  # the shared load: a queue forms, tokens/s fall 40 %, at the cap throughout
        t += 1
        if judge.update(t, 5_400.0 * rng.uniform(0.9, 1.1), binding=True, limited=True) and began is None:
            began = t
    assert began is not None and began - drop <= 5 and judge.harmful
    ended = None
    for _ in range(40):  # the load gone, the backlog served at full speed
        t += 1
        if judge.update(t, 9_500.0 * rng.uniform(0.9, 1.1), binding=True, limited=False) is False:
            ended = t
    assert ended is not None and judge.episodes == 1
    assert judge.reference_kind == "capacity" and judge.reference == pytest.approx(9_500.0, rel=0.1)


def test_the_judge_says_when_an_episode_is_in_its_tail() -> None:
    """`at_threshold` holds while the loss is at the level that starts harm and goes false in the band
    (between half the threshold and the threshold) while the episode is still open: the watch's
    `harm_fading` is what stops a new control trial from starting on a harm whose cause may be over."""
    rng = random.Random(4)
    judge = HarmJudge(HarmSettings(), max_mhz=MAX_MHZ)
    feed(judge, phase(rng, 0.0, 30.0, MAX_MHZ, 0))
    assert not judge.at_threshold
    feed(judge, phase(rng, 30.0, 30.0, 1600.0, CAP))
    assert judge.harmful and judge.at_threshold
    feed(judge, phase(rng, 60.0, 8.0, 1850.0, CAP))  # 6.6 % down: in the band, the episode still open
    assert judge.harmful and not judge.at_threshold and judge.in_tail
    watch = GpuThrottleWatch({0: MAX_MHZ}, lambda *_a, **_f: None)
    for t, mhz, bits in phase(rng, 0.0, 30.0, 1600.0, CAP):
        watch.observe(0, t, {"sm_mhz": mhz, "reasons": bits}, {"util_gpu": 100})
    assert watch.harm() == "power" and not watch.harm_fading()
    for t, mhz, bits in phase(rng, 30.0, 8.0, 1850.0, CAP):
        watch.observe(0, t, {"sm_mhz": mhz, "reasons": bits}, {"util_gpu": 100})
    assert watch.harm() == "power" and watch.harm_fading()


def test_a_thermal_episode_in_the_band_is_a_tail_only_for_stale_s() -> None:
    """A thermal episode never ends on the bound: its loss settled in the band is the device's level,
    and after `stale_s` no longer a tail (a trial may start on it again)."""
    rng = random.Random(5)
    s = HarmSettings()
    judge = HarmJudge(s, max_mhz=MAX_MHZ)
    feed(judge, phase(rng, 0.0, 30.0, MAX_MHZ, 0))
    feed(judge, phase(rng, 30.0, 30.0, 1600.0, SW_THERMAL))
    assert judge.harmful and judge.kind == "thermal" and not judge.in_tail
    feed(judge, phase(rng, 60.0, 8.0, 1935.0, SW_THERMAL))  # 2.3 % down: in the thermal band (3 %)
    assert judge.harmful and judge.in_tail
    feed(judge, phase(rng, 68.0, s.stale_s + 5.0, 1935.0, SW_THERMAL))
    assert judge.harmful and not judge.at_threshold and not judge.in_tail


def test_another_process_on_the_gpu_is_an_event_pair_and_the_watchs_shared_state() -> None:
    """`cotenant_enter` when a process other than the engine's takes a compute context on a judged GPU
    (its PIDs and memory), `cotenant_leave` when the last one goes; an unknown list (None) ends no
    episode but reads as unknown (an engine between processes); the summary counts the episodes."""
    events: list[tuple[str, str, dict[str, Any]]] = []
    watch = GpuThrottleWatch({0: MAX_MHZ}, on_event=lambda kind, msg, **f: events.append((kind, msg, f)))
    fast = {"sm_mhz": MAX_MHZ, "reasons": 0}
    lists: list[dict[str, int] | None] = [
        None,
        {},
        {},
        {"4242": 3 << 30},
        {"4242": 3 << 30, "77": 0},
        None,
        {},
    ]
    seen = []
    for n, foreign in enumerate(lists):
        watch.observe(0, float(n), fast, {"util_gpu": 90, "foreign_procs": foreign})
        seen.append(watch.shared())
    pid, both = frozenset({"4242"}), frozenset({"4242", "77"})
    assert seen == [None, frozenset(), frozenset(), pid, both, None, frozenset()]  # unknown at the sixth
    kinds = [(k, f) for k, _, f in events if k.startswith("cotenant_")]
    assert [k for k, _ in kinds] == ["cotenant_enter", "cotenant_leave"]
    assert kinds[0][1]["pids"] == "4242" and kinds[0][1]["foreign_mem_bytes"] == 3 << 30
    assert "PID 4242, 3.0 GiB" in next(m for k, m, _ in events if k == "cotenant_enter")
    assert watch.summary()["0"]["cotenant_episodes"] == 1  # type: ignore[index]
    # Two GPUs: the PIDs of both; one GPU's list unknown makes the whole unknown (out of sight, not gone).
    two = GpuThrottleWatch({0: MAX_MHZ, 1: MAX_MHZ}, lambda *_a, **_f: None)
    assert two.shared() is None
    two.observe(0, 0.0, fast, {"util_gpu": 90, "foreign_procs": {"11": 1 << 30}})
    assert two.shared() is None  # GPU 1 not read yet: its processes are out of sight, not absent
    two.observe(1, 0.0, fast, {"util_gpu": 90, "foreign_procs": {"22": 1 << 30}})
    assert two.shared() == frozenset({"11", "22"})
    two.observe(1, 1.0, fast, {"util_gpu": 90, "foreign_procs": None})
    assert two.shared() is None
    assert GpuThrottleWatch({0: MAX_MHZ}, lambda *_a, **_f: None).summary()["0"]["cotenant_episodes"] is None  # type: ignore[index]


def test_the_energy_total_says_how_long_its_samples_covered() -> None:
    """The energy is integrated between fast samples, never across a gap over 5 s; `energy_s` is the
    time so covered, per GPU, so a power is the energy's growth over it: a stalled tier's gap neither
    adds energy nor dilutes the power."""
    watch = GpuThrottleWatch({0: MAX_MHZ, 1: MAX_MHZ}, lambda *_a, **_f: None)
    assert watch.energy_s() == 0.0
    for t in (0.0, 0.1, 0.2, 0.3, 9.0, 9.1):  # a 8.7 s stall between 0.3 and 9.0
        for gpu in (0, 1):
            watch.observe(gpu, t, {"sm_mhz": MAX_MHZ, "reasons": 0, "power_mw": 500_000}, {})
    assert abs(watch.energy_s() - 0.4) < 1e-9 and abs(watch.energy_j() - 400.0) < 1e-6
    assert abs(watch.energy_j() / watch.energy_s() - 1000.0) < 1e-6  # two GPUs at 500 W
