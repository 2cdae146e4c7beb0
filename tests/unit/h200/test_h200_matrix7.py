"""The way back in one step, live on an H200 (tests/data/h200/matrix7, 2026-12-04): round 6's control arm
(tests/data/h200/matrix6: the long-context trace, a 120 s matmul load from 20 s in, goodput on TPOT <=
26.46 ms) with the policy that returns to the level before the harm at once, on a 190 s replay to fit
the GPU machine's time left. Only the run's control state, config and load came back (the results folder
was copied back file by file and cut short): the trials' legs, verdicts and times are what this file
checks, against round 6's two control arms."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import test_h200_matrix2 as m2
import test_h200_matrix6 as m6

DATA = Path(__file__).parents[2] / "data" / "h200"
ARM = DATA / "matrix7" / "longctx-control"
ROUND6 = ("longctx-control", "longctx-control2")


def results() -> list[dict[str, Any]]:
    """This arm's batch verdicts, from its control state (its summary did not come back)."""
    out: list[dict[str, Any]] = json.loads((ARM / "control-state.json").read_text())["batch"]["results"]
    return out


def test_the_arm_is_round_6s_control_arm_on_a_shorter_replay() -> None:
    cfg = json.loads((ARM / "meta.json").read_text())["config"]
    old = json.loads((DATA / "matrix6" / "longctx-control" / "meta.json").read_text())["config"]
    assert cfg["run"]["duration"] == 190.0 and old["run"]["duration"] == 230.0
    for section in ("control", "criteria", "engine"):
        assert cfg[section] == old[section], section
    assert "in 120.0 s" in (ARM / "load.txt").read_text()


def test_the_same_trials_as_round_6_then_64_in_one_step_30_s_sooner() -> None:
    """64 -> 48 kept on the A-B-A a third time (B 1,982 good tok/s against 259 and 0 at 64, noise ±350);
    48 -> 36 cut short by the harm's end (36 kept); then 36 -> 64 in one step 11 s after the harm ended,
    measured (goodput 3,882 -> 4,788), where round 6's arms climbed 36 -> 48 -> 64 and had 64 back
    41-42 s after it: 30 s sooner at the full batch, with a backlog waiting."""
    assert m2.steps(results()) == [
        ("downscale", 64, 48, "aba_bracket", True),
        ("downscale", 48, 36, "harm_ended", True),
        ("upscale", 36, 64, "measured", True),
    ]
    first, ended, up = results()
    assert first["verdict"] == "gain"
    assert first["after"] - max(first["before"], first["again"]) > 4 * first["noise"]
    assert up["after"] > 1.1 * up["before"]
    back = up["action_t_s"] - ended["t_s"]
    for arm in ROUND6:
        old = m6.results(arm)
        assert [(r["from"], r["to"]) for r in old[2:]] == [(36, 48), (48, 64)]
        old_back = old[3]["action_t_s"] - old[1]["t_s"]
        assert back < 15.0 and old_back - back > 25.0, (arm, back, old_back)


def test_64_holds_after_the_way_back_and_nothing_is_blocked() -> None:
    """The state saved as the run stopped: 64 in force, the path empty, no level blocked, no harm back
    within the 31 s after the upscale (its measurement ran to the end)."""
    state = json.loads((ARM / "control-state.json").read_text())
    meta = json.loads((ARM / "meta.json").read_text())
    batch = state["batch"]
    assert batch["limit"] == 64 and batch["path"] == [] and batch["blocked"] == {}
    assert batch["reverted"] == 0 and batch["kept"] == 2
    up = results()[-1]
    started = datetime.fromisoformat(meta["started_utc"]).timestamp()
    assert state["saved_at"] - started > up["t_s"] - started > up["action_t_s"] - started + 30.0
