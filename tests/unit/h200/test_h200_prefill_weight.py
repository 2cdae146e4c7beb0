"""The throughput judge's prefill weight replayed through every recorded matrix arm (tests/data/h200/matrix*
and tests/data/h100/matrix9): each second's output tokens, queue, limit bit and the prompt tokens the
engine computed (its `engine` series) through ThroughputJudge, once with prompt tokens left out (the
judge before the weight) and once at the default weight. The one episode the judge recorded with no
outside load (the H100's owncap-control: a 3 s surge of long prompts on an engine at its power cap) is
gone; every shared load is still seen in the same second, and no load-free arm has an episode."""

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
Tick = tuple[float, float, bool, bool, float | None]


@cache
def ticks(arm: Path) -> tuple[Tick, ...]:
    """Per second: test_h200_control_ab's throughput inputs (output tokens/s, requests waiting before the
    replay stopped dispatching, the power cap in most GPU samples) and the prompt tokens the engine
    computed per second (None in a second without an engine point)."""
    prefill: dict[int, float] = {}
    with gzip.open(arm / "spool.lp.gz", "rt") as f:
        for line in f:
            if not line.startswith("engine,"):
                continue
            rest, ts = line.rstrip("\n").rsplit(" ", 1)
            fields = dict(kv.split("=", 1) for kv in rest.split(" ", 1)[1].split(",") if "=" in kv)

            def num(key: str, fields: dict[str, str] = fields) -> float:
                return float(fields.get(key, "0").rstrip("i"))

            if num("interval_s") > 0:
                prefill[int(ts) // 10**9] = (num("prompt_tokens") - num("prompt_tokens_cached")) / num(
                    "interval_s"
                )
    recorded, _ = throughput_inputs(arm.name, arm.parent)
    return tuple((t, tps, binding, limited, prefill.get(int(t))) for t, tps, binding, limited in recorded)


def entries(arm: Path, weight: float | None = ThroughputSettings().prefill_weight) -> list[float]:
    """The seconds (from the replay's first) at which throughput harm began, prompt tokens counted at
    `weight` (None: left out, the judge before the weight)."""
    judge = ThroughputJudge(ThroughputSettings(prefill_weight=weight or 0.0))
    out = []
    recorded = ticks(arm)
    for t, tps, binding, limited, prefill in recorded:
        per_s = None if weight is None else prefill
        if judge.update(t, tps, binding=binding, limited=limited, prefill_per_s=per_s):
            out.append(t - recorded[0][0])
    return out


def loaded(arm: Path) -> bool:
    return bool(json.loads((arm / "arm.json").read_text())["load"])


def test_the_recorded_arms_carry_the_engines_prompt_tokens() -> None:
    assert len(ARMS) >= 30
    for arm in ARMS:
        assert sum(1 for *_, p in ticks(arm) if p) > 30, arm


def test_a_surge_of_prompts_on_an_engine_at_its_cap_is_no_longer_harm() -> None:
    arm = DATA / "h100" / "matrix9" / "owncap-control"
    assert not loaded(arm)
    assert entries(arm, None) and entries(arm) == []


@pytest.mark.parametrize("arm", [a for a in ARMS if loaded(a)], ids=lambda a: f"{a.parent.name}/{a.name}")
def test_every_shared_load_is_seen_in_the_same_second(arm: Path) -> None:
    """The load (20 s into the replay) is harm 2-4 s after it began, in the same second with the weight
    as without it."""
    before, after = entries(arm, None), entries(arm)
    assert before and after[:1] == before[:1] and 21 <= after[0] <= 25


@pytest.mark.parametrize("arm", [a for a in ARMS if not loaded(a)], ids=lambda a: f"{a.parent.name}/{a.name}")
def test_no_episode_without_an_outside_load(arm: Path) -> None:
    assert entries(arm) == []
