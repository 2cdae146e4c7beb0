"""The control matrix's fifth round on an H200 (tests/data/h200/matrix5, 2026-12-03): round 4's fixed
control arm repeated on a fresh machine with the backlog-reading throughput judge, a replay as long as
the trace (230 s) and a 120 s matmul load from 20 s in, so the road back after the load is inside the
replay. Only the run's control state, config and load came back (the spool did not): the trials' legs,
verdicts and times are what this file checks, against round 4's arm (tests/data/h200/matrix4)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

DATA = Path(__file__).parents[2] / "data" / "h200"
ARM = DATA / "matrix5" / "longctx-control"


def state(folder: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((folder / "control-state.json").read_text())
    return doc


def since_start(t: float) -> float:
    meta = json.loads((ARM / "meta.json").read_text())
    return t - datetime.fromisoformat(meta["started_utc"]).timestamp()


def test_the_arm_is_round_4s_with_the_whole_trace_and_a_shorter_load() -> None:
    meta = json.loads((ARM / "meta.json").read_text())
    cfg = meta["config"]
    assert cfg["run"]["duration"] == 230.0 and cfg["control"]["dry_run"] is False
    assert cfg["control"]["harm"]["act_on_throughput"] is True
    assert cfg["criteria"]["tpot_p99_ms"] == 26.46
    assert "in 120.1 s" in (ARM / "load.txt").read_text()


def test_the_repeat_keeps_48_on_the_same_evidence_as_round_4() -> None:
    """Round 4: B 1,974 good tok/s at 48 against 399 and 24 at 64 (noise ±347). The repeat: 1,957 against
    538 and 0 (±476): a gain again, B over both A legs by 3.0 and 4.5 times the noise."""
    results = {r["to"]: r for r in state(DATA / "matrix4" / "longctx-control")["batch"]["results"]}
    first = state(ARM)["batch"]["results"][0]
    for r in (results[48], first):
        assert (r["from"], r["to"], r["kind"], r["verdict"], r["kept"]) == (64, 48, "downscale", "gain", True)
        assert r["decided_by"] == "aba_bracket"
        assert r["after"] - max(r["before"], r["again"]) > 2 * r["noise"]
    assert abs(first["after"] / results[48]["after"] - 1) < 0.05


def test_the_ceiling_comes_back_to_64_after_the_load() -> None:
    """The load's end met a second trial (48 -> 36): harm ended during it (inconclusive, the lower level
    kept), then the ceiling went back up the way it came, 36 -> 48 -> 64, each upscale measured (goodput
    up both times), 64 in force 30 s before the replay's end: a kept downscale has its road back."""
    batch = state(ARM)["batch"]
    steps = [(r["kind"], r["from"], r["to"], r["decided_by"]) for r in batch["results"]]
    assert steps == [
        ("downscale", 64, 48, "aba_bracket"),
        ("downscale", 48, 36, "harm_ended"),
        ("upscale", 36, 48, "measured"),
        ("upscale", 48, 64, "measured"),
    ]
    assert batch["limit"] == 64 and batch["blocked"] == {} and batch["reverted"] == 0
    up = batch["results"][2:]
    assert all(r["after"] > r["before"] for r in up)
    harm_over = since_start(batch["results"][1]["t_s"])
    back = since_start(up[1]["action_t_s"])
    end = since_start(state(ARM)["saved_at"])
    # The load ran 20-140 s into a 230 s replay that ended by the state's last save: the harm was over
    # 140-155 s after the replay began at the latest, 64 back about 40 s later.
    assert 0 < back - harm_over < 60 and end - back > 30
