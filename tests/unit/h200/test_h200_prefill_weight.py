"""The throughput judge's prefill weight replayed through every recorded matrix arm (tests/data/h200/matrix*
and tests/data/h100/matrix9-10): each second's output tokens, queue, limit bit and the prompt tokens the
engine computed (its `engine` series) through ThroughputJudge, once with prompt tokens left out (the
judge before the weight) and once at the default weight. The one episode the judge recorded with no
outside load (the H100's owncap-control: a 3 s surge of long prompts on an engine at its power cap) is
gone; every shared load is still seen in the same second, and no load-free arm has an episode. The GPU's
power (its `gpu` series) goes in too: round 10's live episode without an outside load (the engine's steps
slowed with the GPU less busy) is gone with it."""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path

import pytest
from test_h200_control_ab import throughput_inputs

from soakd.policies.throttle import ThroughputJudge, ThroughputSettings

DATA = Path(__file__).parents[2] / "data"
ARMS = sorted(
    p.parent
    for p in DATA.glob("h*/matrix*/*/spool.lp.gz")
    # The judge runs in the controller: arms with control off (the scheduler class's A/A) have none.
    if (p.parent / "arm.json").exists()
    and json.loads((p.parent / "meta.json").read_text())["config"]["control"]["enabled"]
)
Tick = tuple[float, float, bool, bool, float | None, float | None, bool]
COTENANT_BYTES = 256 << 20
"""GPU memory beyond the engine's own processes' that marks another process on the GPU (the matmul load
holds ~1 GiB from its start, ~18 s before it computes; the driver's own share is ~9 MiB)."""


@cache
def ticks(arm: Path) -> tuple[Tick, ...]:
    """Per second: test_h200_control_ab's throughput inputs (output tokens/s, requests waiting before the
    replay stopped dispatching, the power cap in most GPU samples), the prompt tokens the engine
    computed per second (None in a second without an engine point), the GPU's mean power (W; None in
    a second without a GPU point) and whether another process held memory on the GPU at the last slow
    read (its used memory over the engine's processes' by COTENANT_BYTES: what NVML's process list,
    not recorded in these spools, would have shown)."""
    prefill: dict[int, float] = {}
    power: dict[int, float] = {}
    shared: dict[int, bool] = {}
    with gzip.open(arm / "spool.lp.gz", "rt") as f:
        for line in f:
            if not line.startswith(("engine,", "gpu,")):
                continue
            rest, ts = line.rstrip("\n").rsplit(" ", 1)
            fields = dict(kv.split("=", 1) for kv in rest.split(" ", 1)[1].split(",") if "=" in kv)
            if line.startswith("gpu,"):
                if "power_w_mean" in fields:
                    power[int(ts) // 10**9] = float(fields["power_w_mean"])
                own = int(fields.get("proc_mem_bytes", "0i").rstrip("i"))
                if own and "mem_used_bytes" in fields:
                    used = int(fields["mem_used_bytes"].rstrip("i"))
                    shared[int(ts) // 10**9] = used - own > COTENANT_BYTES
                continue

            def num(key: str, fields: dict[str, str] = fields) -> float:
                return float(fields.get(key, "0").rstrip("i"))

            if num("interval_s") > 0:
                prefill[int(ts) // 10**9] = (num("prompt_tokens") - num("prompt_tokens_cached")) / num(
                    "interval_s"
                )
    recorded, _ = throughput_inputs(arm.name, arm.parent)
    out = []
    last = False
    for t, tps, binding, limited in recorded:
        last = shared.get(int(t), last)
        out.append((t, tps, binding, limited, prefill.get(int(t)), power.get(int(t)), last))
    return tuple(out)


def entries(
    arm: Path,
    weight: float | None = ThroughputSettings().prefill_weight,
    power: bool = True,
    cotenant: bool = False,
) -> list[float]:
    """The seconds (from the replay's first) at which throughput harm began, prompt tokens counted at
    `weight` (None: left out, the judge before the weight), the GPU's power given (`power`) or not (the
    judge before it was), and another process on the GPU given (`cotenant`) or not."""
    judge = ThroughputJudge(ThroughputSettings(prefill_weight=weight or 0.0))
    out = []
    recorded = ticks(arm)
    for t, tps, binding, limited, prefill, watts, shared in recorded:
        per_s = None if weight is None else prefill
        w = watts if power else None
        co = shared if cotenant else None
        if judge.update(t, tps, binding=binding, limited=limited, prefill_per_s=per_s, power_w=w, shared=co):
            out.append(t - recorded[0][0])
    return out


def loaded(arm: Path) -> bool:
    return bool(json.loads((arm / "arm.json").read_text())["load"])


def test_the_recorded_arms_carry_the_engines_prompt_tokens_and_the_gpus_power() -> None:
    assert len(ARMS) >= 30
    for arm in ARMS:
        assert sum(1 for tick in ticks(arm) if tick[4]) > 30, arm
        assert sum(1 for tick in ticks(arm) if tick[5]) > 30, arm


def test_a_surge_of_prompts_on_an_engine_at_its_cap_is_no_longer_harm() -> None:
    arm = DATA / "h100" / "matrix9" / "owncap-control"
    assert not loaded(arm)
    assert entries(arm, None, power=False) and entries(arm, power=False) == []


def test_fewer_tokens_with_the_gpu_less_busy_are_no_longer_harm() -> None:
    """The H100's owncap-control of round 10 (the prefill weight live, no outside load): the judge recorded
    harm 84 s in, replayed at 83 s; the engine's steps had slowed with the GPU's power down ~17 % and
    its clock up. Given the GPU's power, no episode; without it, the same one."""
    arm = DATA / "h100" / "matrix10" / "owncap-control"
    assert not loaded(arm)
    assert [round(t) for t in entries(arm, power=False)] == [83]
    assert entries(arm) == []


@pytest.mark.parametrize("arm", [a for a in ARMS if loaded(a)], ids=lambda a: f"{a.parent.name}/{a.name}")
def test_every_shared_load_is_seen_in_the_same_second(arm: Path) -> None:
    """The load (20 s into the replay) is harm 2-4 s after it began, in the same second with the weight
    and the GPU's power as without them."""
    before, after = entries(arm, None, power=False), entries(arm)
    assert before and after[:1] == before[:1] and 21 <= after[0] <= 25


@pytest.mark.parametrize("arm", [a for a in ARMS if not loaded(a)], ids=lambda a: f"{a.parent.name}/{a.name}")
def test_no_episode_without_an_outside_load(arm: Path) -> None:
    assert entries(arm) == []


def test_the_load_process_shows_on_the_gpu_from_its_start_to_its_end() -> None:
    """In every loaded arm the outside load's process holds GPU memory beside the engine's from ~18 s
    before its work begins to its end (it starts with the arm, then waits), so the process list would
    have named it; in no load-free arm is there one."""
    for arm in ARMS:
        seen = [tick[0] for tick in ticks(arm) if tick[6]]
        if not loaded(arm):
            assert not seen, arm
            continue
        times = json.loads((arm / "times.json").read_text())
        assert seen and min(seen) < times["load_start"] and max(seen) >= times["load_end"] - 3, arm


@pytest.mark.parametrize("arm", [a for a in ARMS if loaded(a)], ids=lambda a: f"{a.parent.name}/{a.name}")
def test_a_cotenant_known_changes_no_entry(arm: Path) -> None:
    """With the load's process known on the GPU from ~2 s into the replay, 18 s before the load
    computes, it is no newcomer when the load begins (the gate stands; every load raised the power):
    the judge enters in the same second as without it, and no earlier."""
    assert entries(arm, cotenant=True) == entries(arm)


@pytest.mark.parametrize("arm", [a for a in ARMS if not loaded(a)], ids=lambda a: f"{a.parent.name}/{a.name}")
def test_an_idle_cotenant_all_along_brings_back_no_false_entry(arm: Path) -> None:
    """A process on the GPU for the whole run that never computes (an idle notebook holding tensors):
    the gate stands, so round 10's false episode stays gone; lifted for any co-tenant, it came back."""
    recorded = ticks(arm)
    judge = ThroughputJudge(ThroughputSettings())
    for t, tps, binding, limited, prefill, watts, _ in recorded:
        judge.update(
            t, tps, binding=binding, limited=limited, prefill_per_s=prefill, power_w=watts, shared=True
        )
    assert judge.episodes == 0
