"""The control loop with plain-function inputs and a stub engine: actions reach the gate, the limit file
and the engine, each one is an event, dry runs only advise, and the state survives a restart."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import pytest

from soakd.config import ControlConfig, EngineChange, load
from soakd.control import ControlInputs, Controller, Slo, input_harm, input_throttled
from soakd.engine.base import EngineInfo
from soakd.engine.supervisor import EngineSupervisor
from soakd.errors import EngineError
from soakd.policies.actuator import Actuator
from soakd.policies.lever import Lever
from soakd.replay.admission import AdmissionGate
from soakd.rundir import CONTROL_STATE_FILE, LIMIT_FILE


@dataclass
class RebuildStub:
    """What the actuator uses of the supervisor: info and rebuild."""

    info: EngineInfo
    rebuilds: list[EngineChange] = field(default_factory=list)
    ok: bool = True

    async def rebuild(self, change: EngineChange) -> bool:
        self.rebuilds.append(change)
        if self.ok and change.cudagraph_capture_sizes is not None:
            self.info = replace(self.info, capture_sizes=tuple(change.cudagraph_capture_sizes))
        return self.ok


def info(**over: Any) -> EngineInfo:
    base: dict[str, Any] = {
        "kind": "vllm-local",
        "version": "x",
        "model": "m",
        "config_id": "cfg1",
        "vocab_size": 100,
        "cudagraphs": True,
        "capture_sizes": (1, 2),
        "live_active_seqs": True,
        "speculative_tokens": 3,
    }
    base.update(over)
    return EngineInfo(**base)


@dataclass
class World:
    """The inputs the controller reads, as plain values the test moves."""

    throttled: bool = False
    tokens: int = 0
    in_flight: int = 5
    hist: Counter[int] = field(default_factory=Counter)
    drifting: bool = False
    rate: int = 100
    """Output tokens per second while requests run."""
    harm: str = ""
    waiting: int = 3
    """Requests waiting for admission (> 0: the ceiling binds)."""
    pays: bool = False
    """Under harm, a ceiling below the start serves 1.5x the rate (an edge GPU's clock comes back)."""
    draining: bool = False
    """The trace is over and the backlog drains."""


def control_cfg(tmp_path: Path, text: str) -> ControlConfig:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load(path).control


def make(
    tmp_path: Path, text: str = "", *, engine: RebuildStub | None = None, start: int = 16
) -> tuple[Controller, World, list[tuple[str, str, dict[str, Any]]], RebuildStub, list[float]]:
    world = World()
    events: list[tuple[str, str, dict[str, Any]]] = []
    eng = engine or RebuildStub(info())
    clock = [1000.0]
    cfg = control_cfg(tmp_path, text)
    kind = cfg.batch.lever
    actuator = Actuator(
        cast(EngineSupervisor, eng),
        lambda kind, msg, **f: events.append((kind, msg, f)),
        lever=Lever(kind, limit_file=tmp_path / LIMIT_FILE if kind == "scheduler" else None),
        dry_run=cfg.dry_run,
    )
    actuator.gate = AdmissionGate(start)
    inputs = ControlInputs(
        throttled=lambda: world.throttled,
        output_tokens=lambda: world.tokens,
        in_flight=lambda: world.in_flight,
        tokens_per_step=lambda: world.hist,
        engine=lambda: eng.info,
        drifting=lambda: world.drifting,
        harm=lambda: world.harm,
        waiting=lambda: world.waiting,
        draining=lambda: world.draining,
    )
    return (
        Controller(cfg, start, inputs, actuator, tmp_path, wall=lambda: clock[0]),
        world,
        events,
        eng,
        clock,
    )


def run_for(ctrl: Controller, world: World, clock: list[float], seconds: int, **change: Any) -> None:
    for k, v in change.items():
        setattr(world, k, v)
    for _ in range(seconds):
        clock[0] += 1
        gate = ctrl.actuator.gate
        lowered = gate is not None and gate.limit < ctrl.batch.settings.start
        rate = world.rate * (1.5 if world.pays and world.harm and lowered else 1.0)
        world.tokens += int(rate) if world.in_flight else 0
        asyncio.run(ctrl.tick())


BATCH = """
[control.batch]
objective = "tokens"
dwell = "5s"
settle = "5s"
eval = "5s"
cooldown = "20s"
lever = "scheduler"
[control.recapture]
enabled = false
"""


def test_harm_lowers_gate_and_engine_limit_and_a_trial_that_does_not_pay_is_reverted(tmp_path: Path) -> None:
    ctrl, world, events, _, clock = make(tmp_path, BATCH)
    run_for(ctrl, world, clock, 3)
    # A throttle episode without clock loss (the power cap touched) is recorded, never acted on.
    run_for(ctrl, world, clock, 30, throttled=True)
    assert events == []
    run_for(ctrl, world, clock, 6, harm="power")
    gate = ctrl.actuator.gate
    assert gate is not None and gate.limit == 12
    assert (tmp_path / LIMIT_FILE).read_text() == "12"  # vLLM's scheduler reads this file
    (kind, msg, fields) = events[0]
    assert kind == "downscale" and "harm (power) for 5 s" in msg and "kept only if tokens gains" in msg
    assert fields["from_limit"] == 16 and fields["to_limit"] == 12 and fields["engine_live"] is True
    assert fields["ev_objective_before"] == pytest.approx(100.0) and fields["dry_run"] is False
    (point,) = ctrl.collect(1)
    assert point.fields["ceiling"] == 12 and point.fields["engine_limit"] == 12
    assert point.fields["harm"] == 1 and point.fields["trial"] == 1 and point.fields["throttled"] == 1
    assert point.tags == {"config": "cfg1"}
    # Settle 5 s and evaluate 5 s at 12 (B), then always back to 16 for the A' leg (not a verdict).
    run_for(ctrl, world, clock, 10)
    assert [e[0] for e in events] == ["downscale", "revert"]
    assert events[1][2]["ev_trial_leg"] == "A'" and "not a verdict" in events[1][1]
    assert gate.limit == 16 and (tmp_path / LIMIT_FILE).read_text() == "16"
    # Settle 5 s and evaluate 5 s at 16 again (A'): the same 100 tok/s at 12 as at 16 before and after
    # is no gain, beyond a noise of 0; 16 stays, 12 blocked for retry.
    run_for(ctrl, world, clock, 10)
    assert [e[0] for e in events] == ["downscale", "revert", "action_result"]
    result = events[2][2]
    assert result["kept"] is False and result["objective_before"] == pytest.approx(100.0)
    assert result["objective_after"] == pytest.approx(100.0) and result["objective_again"] == pytest.approx(
        100.0
    )
    assert result["decided_by"] == "aba_bracket" and result["verdict"] == "no_gain"
    assert result["noise_margin"] == 0.0 and result["blocked_s"] == 3600.0
    assert "judged A-B-A" in events[2][1] and "12 blocked for 3600 s" in events[2][1]
    assert gate.limit == 16 and (tmp_path / LIMIT_FILE).read_text() == "16"
    run_for(ctrl, world, clock, 60)  # still harmful, 12 is blocked: no second trial
    assert len(events) == 3 and ctrl.batch.reverted == 1
    summary = ctrl.summary()
    assert summary["reverted"] == 1 and summary["kept"] == 0 and set(summary["levels"]) == {"16", "12"}
    assert '"blocked": {"12"' in (tmp_path / CONTROL_STATE_FILE).read_text()


def test_a_trial_that_pays_is_kept_and_the_ceiling_returns_once_the_harm_is_gone(tmp_path: Path) -> None:
    ctrl, world, events, _, clock = make(tmp_path, BATCH)
    world.pays = True
    # The trial (A 100 tok/s at 16), B at 12, the A' leg back at 16, then the verdict: 150 tok/s at 12
    # against 100 before and after at 16 is a gain: 12 again.
    run_for(ctrl, world, clock, 26, harm="thermal")
    assert [e[0] for e in events] == ["downscale", "revert", "action_result", "downscale"]
    result = events[2][2]
    assert result["kept"] is True and result["objective_after"] == pytest.approx(150.0)
    assert result["objective_again"] == pytest.approx(100.0) and result["verdict"] == "gain"
    assert "kept after A-B-A" in events[3][1] and events[3][2]["to_limit"] == 12
    gate = ctrl.actuator.gate
    assert gate is not None and gate.limit == 12
    run_for(ctrl, world, clock, 25, harm="")
    assert gate.limit == 16 and events[-1][0] == "upscale"
    assert "no harm for 20 s" in events[-1][1]


def test_a_trial_the_harms_end_cut_short_says_so_and_the_ceiling_is_back_in_the_same_tick(
    tmp_path: Path,
) -> None:
    ctrl, world, events, _, clock = make(tmp_path, BATCH)
    run_for(ctrl, world, clock, 6, harm="power")
    assert [e[0] for e in events] == ["downscale"] and ctrl.actuator.gate is not None
    assert ctrl.actuator.gate.limit == 12
    run_for(ctrl, world, clock, 3, harm="")  # the harm over 3 s into the B leg
    kinds = [e[0] for e in events]
    assert kinds == ["downscale", "action_result", "upscale"]
    (result,) = [e for e in events if e[0] == "action_result"]
    assert result[2]["decided_by"] == "harm_ended" and result[2]["kept"] is False
    assert ": not judged (harm ended during the trial" in result[1] and "16 in force" not in result[1]
    assert "the way back needs no cool-down" in result[1]
    up = events[2]
    assert up[2]["to_limit"] == 16 and "the harm ended during the trial of 12" in up[1]
    assert ctrl.actuator.gate.limit == 16 and (tmp_path / LIMIT_FILE).read_text() == "16"
    assert ctrl.summary()["kept"] == 0


def test_dry_run_advises_and_changes_nothing(tmp_path: Path) -> None:
    ctrl, world, events, _, clock = make(tmp_path, "[control]\ndry_run = true\n" + BATCH)
    run_for(ctrl, world, clock, 60, harm="power")
    assert ctrl.actuator.gate is not None and ctrl.actuator.gate.limit == 16
    assert not (tmp_path / LIMIT_FILE).exists()
    # One advice for the harm episode, nothing verified, the summary's figures only for 16.
    assert [e[0] for e in events] == ["downscale"] and events[0][1].startswith("advice only")
    assert events[0][2]["dry_run"] is True and "would try 16 -> 12" in events[0][1]
    summary = ctrl.summary()
    assert summary["batch_actions"] == 0 and summary["advice"] == 1 and summary["ceiling"] == 16
    assert list(summary["levels"]) == ["16"]


def test_rebuild_lever_rebuilds_with_the_smaller_batch(tmp_path: Path) -> None:
    ctrl, world, events, eng, clock = make(tmp_path, BATCH.replace('"scheduler"', '"rebuild"'))
    run_for(ctrl, world, clock, 6, harm="power")
    assert [c.max_num_seqs for c in eng.rebuilds] == [12]
    assert eng.rebuilds[0].mode == "drain" and "harm (power)" in eng.rebuilds[0].reason
    assert events[0][2]["rebuilt"] is True


def test_state_survives_a_restart_and_the_ceiling_is_restored(tmp_path: Path) -> None:
    ctrl, world, _, _, clock = make(tmp_path, BATCH)
    run_for(ctrl, world, clock, 6, harm="power")
    assert ctrl.batch.limit == 12
    again, _, _, _, _ = make(tmp_path, BATCH)  # a new daemon on the same run directory
    assert again.restored and again.batch.limit == 12 and again.batch.actions == 1
    gate = AdmissionGate(16)  # the replay's, as the new daemon makes it
    (tmp_path / LIMIT_FILE).unlink()
    asyncio.run(again.start(gate))
    # The restored ceiling takes effect through the actuator: in the gate and the engine's limit file.
    assert again.actuator.gate is gate and gate.limit == 12
    assert (tmp_path / LIMIT_FILE).read_text() == "12"
    (point,) = again.collect(1)
    assert point.fields["ceiling"] == 12 and point.fields["engine_limit"] == 12


def test_torn_state_file_starts_afresh(tmp_path: Path) -> None:
    (tmp_path / CONTROL_STATE_FILE).write_text('{"batch": ')
    ctrl, *_ = make(tmp_path, BATCH)
    assert not ctrl.restored and ctrl.batch.limit == 16


RECAPTURE = """
[control.batch]
enabled = false
[control.recapture]
idle = "5s"
min_steps = 100
cooldown = "1h"
max_sizes = 4
"""


def test_recapture_when_idle_after_traffic_the_sizes_miss(tmp_path: Path) -> None:
    ctrl, world, events, eng, clock = make(tmp_path, RECAPTURE)
    world.hist.update({6: 300, 7: 200, 12: 100})  # captured [1, 2]: every step ran eager
    run_for(ctrl, world, clock, 10)  # busy: nothing
    assert not eng.rebuilds
    run_for(ctrl, world, clock, 6, in_flight=0)
    (change,) = eng.rebuilds
    assert change.cudagraph_capture_sizes is not None and max(change.cudagraph_capture_sizes) == 12
    kinds = [e[0] for e in events]
    assert kinds == ["recapture"] and events[0][2]["ok"] is True and "hit rate" in events[0][2]["reason"]
    assert ctrl.recaptures == 1 and ctrl.summary()["capture_sizes"] == sorted(change.cudagraph_capture_sizes)
    run_for(ctrl, world, clock, 10)  # cooldown: no second one
    assert len(eng.rebuilds) == 1


def test_no_recapture_without_graphs_unless_asked(tmp_path: Path) -> None:
    eng = RebuildStub(info(cudagraphs=False, capture_sizes=()))
    ctrl, world, _, _, clock = make(tmp_path, RECAPTURE, engine=eng)
    world.hist.update({6: 300})
    run_for(ctrl, world, clock, 10, in_flight=0)
    assert not eng.rebuilds and "without CUDA graphs" in str(ctrl.summary()["recapture"])
    (tmp_path / "b").mkdir()
    ctrl2, world2, _, eng2, clock2 = make(
        tmp_path / "b",
        RECAPTURE + "without_graphs = true\n",
        engine=RebuildStub(info(cudagraphs=False, capture_sizes=())),
    )
    world2.hist.update({6: 300})
    run_for(ctrl2, world2, clock2, 10, in_flight=0)
    assert len(eng2.rebuilds) == 1


MTP = """
[control.batch]
enabled = false
[control.recapture]
enabled = false
[control.mtp]
hold = "10s"
spec_off = true
retry = "1h"
workload_change = 0.3
"""


def test_mtp_drift_advises_turns_speculation_off_and_back_on_when_the_workload_changes(
    tmp_path: Path,
) -> None:
    ctrl, world, events, eng, clock = make(tmp_path, MTP)
    run_for(ctrl, world, clock, 5, drifting=True)
    assert not events
    for _ in range(60):
        ctrl.observe_request(1000, 100)
    run_for(ctrl, world, clock, 6)
    assert [e[0] for e in events] == ["mtp_advisory", "mtp_off"]
    assert eng.rebuilds[0].speculative_enabled is False
    for _ in range(60):  # the same workload: speculation stays off
        ctrl.observe_request(1000, 100)
    run_for(ctrl, world, clock, 3, drifting=False)
    assert len(eng.rebuilds) == 1 and ctrl.spec_off_since is not None
    for _ in range(60):  # prompts twice as long: a workload the drift was not measured on
        ctrl.observe_request(2000, 100)
    run_for(ctrl, world, clock, 2)
    assert [e[0] for e in events][-1] == "mtp_on" and eng.rebuilds[-1].speculative_enabled is True
    assert "workload changed by 100%" in events[-1][2]["reason"]


def test_input_throttled_by_scope() -> None:
    gpu, host = (lambda: True), (lambda: False)
    assert input_throttled("any", gpu, host)() is True
    assert input_throttled("host", gpu, host)() is False
    assert input_throttled("gpu", None, host)() is False


def test_input_harm_by_scope_thermal_first() -> None:
    gpu, host = (lambda: "power"), (lambda: "thermal")
    assert input_harm("any", gpu, host)() == "thermal"
    assert input_harm("gpu", gpu, host)() == "power"
    assert input_harm("host", None, lambda: "")() == ""


def test_goodput_counts_only_requests_within_the_slo(tmp_path: Path) -> None:
    ctrl, world, _, _, clock = make(tmp_path, BATCH.replace('"tokens"', '"goodput"'))
    ctrl.slo = Slo(ttft_s=1.0, tpot_s=0.05)
    ctrl.observe_request(10, 100, ttft_offered_s=0.7, tpot_s=0.01)  # met
    ctrl.observe_request(10, 50, ttft_offered_s=1.1, tpot_s=0.01)  # waited too long in the queue
    ctrl.observe_request(10, 30, ttft_offered_s=0.2, tpot_s=0.2)  # too slow per token
    ctrl.observe_request(10, 40, ok=False, ttft_offered_s=0.1, tpot_s=0.01)  # failed
    run_for(ctrl, world, clock, 1)
    assert ctrl.batch._history[-1].good_tokens == 100.0


def test_light_traffic_between_ticks_is_not_idle(tmp_path: Path) -> None:
    # Requests that finish between two ticks leave the queue empty at every tick; tokens still flow.
    ctrl, world, _, eng, clock = make(tmp_path, RECAPTURE)
    world.hist.update({6: 300})
    world.in_flight = 0
    for _ in range(20):
        clock[0] += 1
        world.tokens += 50
        asyncio.run(ctrl.tick())
    assert not eng.rebuilds
    run_for(ctrl, world, clock, 6)  # now truly idle: no tokens either
    assert len(eng.rebuilds) == 1


def test_batch_policy_keeps_acting_while_a_recapture_rebuild_runs(tmp_path: Path) -> None:
    release = asyncio.Event()

    class SlowEngine(RebuildStub):
        async def rebuild(self, change: EngineChange) -> bool:
            await release.wait()  # a GPU rebuild takes a minute
            return await super().rebuild(change)

    eng = SlowEngine(info())
    text = RECAPTURE.replace(
        "[control.batch]\nenabled = false", BATCH.split("[control.recapture]", maxsplit=1)[0]
    )
    ctrl, world, events, _, clock = make(tmp_path, text, engine=eng)
    world.hist.update({6: 300})

    async def scenario() -> None:
        async def ticks(n: int) -> None:
            for _ in range(n):
                clock[0] += 1
                world.tokens += world.rate if world.in_flight else 0
                await ctrl.tick()

        world.in_flight = 0
        await ticks(6)  # idle: the re-capture starts and waits inside the engine
        assert ctrl.rebuilding and not eng.rebuilds
        world.harm = "power"
        world.in_flight = 5  # the engine serves (tokens flow) while the rebuild waits to start
        await ticks(6)  # the batch policy does not wait for it
        assert ctrl.actuator.gate is not None and ctrl.actuator.gate.limit == 12
        release.set()
        await ctrl.finish()

    asyncio.run(scenario())
    assert [e[0] for e in events] == ["downscale", "recapture"] and len(eng.rebuilds) == 1
    assert not ctrl.rebuilding and ctrl.recaptures == 1


def test_a_downscale_while_the_engine_is_between_lives_goes_to_the_next_engine(tmp_path: Path) -> None:
    """Seen on an H200: the batch policy acted while a re-capture rebuild had no engine up; the
    supervisor's `info` raised and the control job failed with a traceback. The limit now goes to the
    file the next engine's scheduler reads as it starts."""

    class Rebuilding(RebuildStub):
        @property  # type: ignore[override]
        def info(self) -> EngineInfo:
            raise EngineError("engine not started")

        @info.setter
        def info(self, _value: EngineInfo) -> None:
            pass

    eng = Rebuilding(info())
    ctrl, world, events, _, clock = make(tmp_path, BATCH, engine=eng)
    ctrl.inputs.engine = lambda: None  # as the app's view says between engines
    run_for(ctrl, world, clock, 3)
    run_for(ctrl, world, clock, 6, harm="power")
    assert ctrl.actuator.gate is not None and ctrl.actuator.gate.limit == 12
    assert (tmp_path / LIMIT_FILE).read_text() == "12"
    (kind, _msg, fields) = events[0]
    assert kind == "downscale" and fields["engine_live"] is False


def test_throughput_harm_is_recorded_and_acted_on_only_when_asked(tmp_path: Path) -> None:
    for acts in (False, True):
        d = tmp_path / str(acts)
        d.mkdir()
        text = BATCH + f"[control.harm]\nact_on_throughput = {str(acts).lower()}\n"
        ctrl, world, events, _, clock = make(d, text)
        limited = [False]
        ctrl.inputs.limited = lambda limited=limited: limited[0]
        run_for(ctrl, world, clock, 15)  # the reference: 100 tok/s with a queue
        limited[0] = True
        world.rate = 50  # a limit shared with another process: half the tokens
        run_for(ctrl, world, clock, 12)
        kinds = [e[0] for e in events]
        assert kinds[0] == "harm_enter" and events[0][2]["harm_kind"] == "throughput"
        assert events[0][2]["acted_on"] is acts
        assert ("downscale" in kinds) is acts


def test_the_throughput_judge_reads_the_prompt_tokens_the_engine_computed(tmp_path: Path) -> None:
    """Control ticks 2 s apart. A surge: output tokens halve while the engine computes 2 prompt tokens for
    each output token it no longer serves (prefill_weight 0.5: the same work), no throughput harm; without
    the engine's prompt counts (None: a release that reports none) the same seconds are harm. A shared
    load: output down 40 %, prompt tokens up a little, 25 % less work: harm, and the event says the
    figures count prompt tokens (read per second: per tick they would hide the loss)."""
    outcomes = {}
    cases = {"surge": (50, 140), "surge-unknown": (50, 140), "shared": (60, 60)}
    for name, (rate, prompt_rate) in cases.items():
        d = tmp_path / name
        d.mkdir()
        ctrl, world, events, _, clock = make(d, BATCH)
        prompt = [0]
        known = not name.endswith("unknown")
        ctrl.inputs.prompt_tokens_computed = lambda prompt=prompt, known=known: prompt[0] if known else None
        ctrl.inputs.limited = lambda: True
        for ticks, out_rate, in_rate in ((15, 100, 40), (12, rate, prompt_rate)):
            for _ in range(ticks):
                clock[0] += 2
                world.tokens += 2 * out_rate
                prompt[0] += 2 * in_rate
                asyncio.run(ctrl.tick())
        outcomes[name] = [(e[0], e[2].get("harm_kind"), "prompt tokens at 0.5" in e[1]) for e in events]
        assert ctrl.summary()["throughput"]["prefill_weight"] == 0.5  # type: ignore[index]
    assert outcomes == {
        "surge": [],
        "surge-unknown": [("harm_enter", "throughput", False)],
        "shared": [("harm_enter", "throughput", True)],
    }


def test_the_throughput_judge_reads_the_gpus_power_from_its_energy(tmp_path: Path) -> None:
    """Control ticks 2 s apart, the GPU's energy a running total. Tokens/s halve: with the energy's rate
    falling as much (the engine gave its GPU less work) no throughput harm; with it held (the GPU as
    busy, another process on it), harm; with no energy reading, harm as before."""
    outcomes = {}
    runs = {
        "less-work": 250.0,
        "shared": 500.0,
        "unknown": None,
        "less-work-cotenant": 250.0,
        "less-work-idle-cotenant": 250.0,
    }
    for name, after_w in runs.items():
        d = tmp_path / name
        d.mkdir()
        ctrl, world, events, _, clock = make(d, BATCH)
        energy = [0.0]
        ctrl.inputs.energy_j = lambda energy=energy, known=after_w is not None: energy[0] if known else None
        ctrl.inputs.limited = lambda: True
        # A process beside the engine on the GPU (GpuThrottleWatch.shared): the power gate does not apply
        # to one that came with the drop; one there all along (an idle notebook) is no newcomer.
        cotenant = [name == "less-work-idle-cotenant"]
        ctrl.inputs.shared = lambda cotenant=cotenant: frozenset({"4242"} if cotenant[0] else ())
        for ticks, out_rate, watts in ((15, 100, 500.0), (12, 50, after_w or 0.0)):
            cotenant[0] = cotenant[0] or (name == "less-work-cotenant" and out_rate == 50)
            for _ in range(ticks):
                clock[0] += 2
                world.tokens += 2 * out_rate
                energy[0] += 2 * watts
                asyncio.run(ctrl.tick())
        outcomes[name] = [(e[0], e[2].get("harm_kind"), e[2].get("cotenant")) for e in events]
        if name == "less-work-cotenant":
            assert "another process computes on the GPU" in events[0][1]
            assert ctrl.throughput.summary()["cotenant_entries"] == 1
    assert outcomes == {
        "less-work": [],
        "shared": [("harm_enter", "throughput", False)],
        "unknown": [("harm_enter", "throughput", False)],
        "less-work-cotenant": [("harm_enter", "throughput", True)],
        "less-work-idle-cotenant": [],
    }


def test_the_gpus_power_is_its_energy_over_the_span_its_samples_covered(tmp_path: Path) -> None:
    """The energy total grows at each fast sample, so a 2 s tick holds a sample more or less now and
    then. The GPU at a steady 500 W while tokens/s halve (another process took its SM time) is harm by
    the drop's third tick, when the recent three are judged. Read over the ticks' own 2 s, the ticks
    that held fewer samples read 15 % less power, as if the engine had given its GPU less work: the
    drop passed the gate only once that lower power filled the window before it, 7 ticks late. A
    stalled tier (no new sample) gives no power rather than 0 W."""
    entered = {}
    for name, with_t in (("sample-span", True), ("tick-span", False)):
        d = tmp_path / name
        d.mkdir()
        ctrl, world, events, _, clock = make(d, BATCH)
        energy, sampled = [0.0], [0.0]
        ctrl.inputs.energy_j = lambda energy=energy: energy[0]
        ctrl.inputs.energy_s = lambda sampled=sampled, with_t=with_t: sampled[0] if with_t else None
        ctrl.inputs.limited = lambda: True
        for n in range(30):
            out_rate, span = (100, 2.0) if n < 15 else (50, 1.7)
            clock[0] += 2
            world.tokens += 2 * out_rate
            sampled[0] += span  # the samples integrated since the previous tick covered this much
            energy[0] += 500.0 * span
            asyncio.run(ctrl.tick())
            if ctrl.throughput.harmful and name not in entered:
                entered[name] = n - 15
        assert [e[0] for e in events] == ["harm_enter"]
    assert entered["sample-span"] <= 2 and entered["tick-span"] > 4
    # No sample since the last tick: unknown, so the gate stands aside rather than reading 0 W.
    d = tmp_path / "stalled"
    d.mkdir()
    ctrl, world, events, _, clock = make(d, BATCH)
    ctrl.inputs.energy_j = lambda: 1000.0
    ctrl.inputs.energy_s = lambda: 5.0
    seen: list[float | None] = []
    real = ctrl.throughput.update

    def spy(*a: Any, **k: Any) -> bool | None:
        seen.append(k.get("power_w"))
        return real(*a, **k)

    ctrl.throughput.update = spy  # type: ignore[method-assign]
    for _ in range(3):
        clock[0] += 2
        asyncio.run(ctrl.tick())
    assert len(seen) >= 2 and all(p is None for p in seen)  # 0 W before


def test_a_clock_harm_in_its_tail_is_harm_now_while_the_throughput_judge_reads_it(tmp_path: Path) -> None:
    """On an H200 a shared load held the clock loss at 7-13 % against the 10 % threshold for 150 s (a
    tail every few seconds) while tokens/s stayed half down: no trial ever started. The clock harm in its
    tail is a tail only when the throughput judge (acted on) does not read harm now; without it acted
    on, or with tokens/s back, the tail stands and no trial starts."""
    outcomes = {}
    for acts, drop in ((True, True), (False, True), (True, False)):
        d = tmp_path / f"{acts}-{drop}"
        d.mkdir()
        ctrl, world, events, _, clock = make(
            d, BATCH + f"[control.harm]\nact_on_throughput = {str(acts).lower()}\n"
        )
        limited = [False]
        ctrl.inputs.limited = lambda limited=limited: limited[0]
        ctrl.inputs.harm_fading = lambda: True  # the clock loss under its threshold, over its end level
        run_for(ctrl, world, clock, 15)  # the reference: 100 tok/s with a queue
        limited[0] = True
        run_for(ctrl, world, clock, 20, harm="power", rate=50 if drop else 100)
        outcomes[(acts, drop)] = [e[0] for e in events if e[0] in ("downscale", "revert")]
    assert outcomes[(True, True)][:1] == ["downscale"]
    assert outcomes[(False, True)] == [] and outcomes[(True, False)] == []


def test_the_summary_says_when_the_throughput_judge_had_no_reference(tmp_path: Path) -> None:
    """An idle engine (nothing in flight, no queue) gives no reference: the throughput loss of 0 judges
    nothing, and the summary and the control point say so rather than showing a plain 0. Served load
    with no queue is a lower bound of the capacity (`served`); with a queue, the capacity itself."""
    ctrl, world, _, _, clock = make(tmp_path, BATCH)
    run_for(ctrl, world, clock, 20, waiting=0, in_flight=0)
    (point,) = ctrl.collect(1)
    assert point.fields["throughput_loss"] == 0.0 and "throughput_reference" not in point.fields
    throughput = ctrl.summary()["throughput"]
    assert isinstance(throughput, dict) and throughput["reference_tps"] is None
    assert throughput["reference_note"] == (
        "no reference: never 10 intervals with requests waiting (0 seen) nor 10 busy ones without"
    )
    run_for(ctrl, world, clock, 15, in_flight=5)  # busy, no queue: the load served, 100 tok/s
    throughput = ctrl.summary()["throughput"]
    assert isinstance(throughput, dict) and throughput["reference_kind"] == "served"
    run_for(ctrl, world, clock, 15, waiting=3)  # a queue: the engine's own 100 tok/s is the reference
    (point,) = ctrl.collect(2)
    assert point.fields["throughput_reference"] == 100.0
    throughput = ctrl.summary()["throughput"]
    assert isinstance(throughput, dict) and throughput["reference_tps"] == 100.0
    assert throughput["reference_kind"] == "capacity" and "reference_note" not in throughput


def test_the_drain_after_the_trace_is_no_traffic_to_tune_for(tmp_path: Path) -> None:
    """Harm with requests waiting, but the replay has stopped dispatching: the backlog that drains is not
    the trace's load, so no trial starts; the same harm before the end starts one."""
    ctrl, world, events, _, clock = make(tmp_path, BATCH)
    run_for(ctrl, world, clock, 3)
    run_for(ctrl, world, clock, 30, harm="power", draining=True)
    assert events == [] and ctrl.actuator.gate is not None and ctrl.actuator.gate.limit == 16
    run_for(ctrl, world, clock, 12, draining=False)
    assert [e[0] for e in events] == ["downscale"]


def test_the_downscale_names_the_gpu_the_harm_is_on(tmp_path: Path) -> None:
    """A parallel engine: the controller asks where harm of the kind it acts on is, and the action's
    event says it; harm of another kind (the host's CPUs) names no GPU."""
    ctrl, world, events, _, clock = make(tmp_path, BATCH)
    ctrl.inputs.harm_source = lambda kind: "GPU 1" if kind == "power" else ""
    run_for(ctrl, world, clock, 3)
    run_for(ctrl, world, clock, 6, harm="power")
    (kind, msg, fields) = events[0]
    assert (
        kind == "downscale" and "harm (power on GPU 1) for 5 s" in msg and fields["ev_harm_source"] == "GPU 1"
    )
    (tmp_path / "host").mkdir()
    ctrl, world, events, _, clock = make(tmp_path / "host", BATCH)
    ctrl.inputs.harm_source = lambda kind: "GPU 1" if kind == "power" else ""
    run_for(ctrl, world, clock, 3)
    run_for(ctrl, world, clock, 6, harm="thermal")
    (kind, msg, fields) = events[0]
    assert "harm (thermal) for 5 s" in msg and "ev_harm_source" not in fields


def test_the_throughput_judge_sees_a_backlog_in_the_engine_before_anyone_waits(tmp_path: Path) -> None:
    """A shared load with no queue for admission yet: tokens/s fall and the requests in the engine climb.
    The controller hands the judge the requests in flight, so harm is recorded within the judge's three
    intervals; while the replay drains (no arrivals) it hands none, and the same seconds are not judged."""
    outcomes = {}
    for draining in (False, True):
        d = tmp_path / str(draining)
        d.mkdir()
        ctrl, world, events, _, clock = make(d, BATCH)
        limited = [False]
        ctrl.inputs.limited = lambda limited=limited: limited[0]
        run_for(ctrl, world, clock, 15, waiting=0, in_flight=10, draining=draining)  # served: 100 tok/s
        limited[0] = True
        for n in (13, 16, 19, 22):  # a third of the tokens, the engine filling up, no one waiting
            run_for(ctrl, world, clock, 1, rate=30, in_flight=n)
        outcomes[draining] = [(e[0], e[2].get("harm_kind")) for e in events]
        if not draining:
            assert ctrl.throughput.backlogs >= 3
    assert outcomes[False] == [("harm_enter", "throughput")]
    assert outcomes[True] == []
