"""A real soak on the H200 (vLLM in-process, tiny model, GPU collectors on) with a 25 s bf16 matmul
load launched 30 s into the replay: what the daemon wrote, checked against the load's own times."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from soakd.metric import Sample, parse_line

DATA = Path(__file__).parents[2] / "data" / "h200" / "live_soak"


@pytest.fixture(scope="module")
def run() -> dict[str, list[Sample]]:
    by: dict[str, list[Sample]] = {}
    with gzip.open(DATA / "spool.lp.gz", "rt", encoding="utf-8") as f:
        for line in f:
            s = parse_line(line.rstrip("\n"))
            by.setdefault(s.measurement, []).append(s)
    return by


def _events(run: dict[str, list[Sample]], kind: str) -> list[Sample]:
    return [e for e in run["events"] if e.tags["kind"] == kind]


def test_throttle_episode_follows_the_load(run: dict[str, list[Sample]]) -> None:
    load = json.loads((DATA / "load.json").read_text())
    (enter,) = _events(run, "throttle_enter")
    (recovering,) = _events(run, "throttle_recovering")
    (leave,) = _events(run, "throttle_leave")
    t_enter = enter.time_ns / 1e9 - load["burn_start_wall_s"]
    # torch starts and allocates for a few seconds before the first matmul: entered within 6 s of launch
    assert 0 < t_enter < 6 and "counter:power" in str(enter.fields["reasons"])
    # the window (5 s) clears within ~6 s of the load's exit, then 30 s quiet to "ok"
    t_rec = recovering.time_ns / 1e9 - load["burn_end_wall_s"]
    assert 0 < t_rec < 7
    assert (leave.time_ns - recovering.time_ns) / 1e9 == pytest.approx(30.0, abs=0.2)


def test_power_cap_counter_matches_the_sampled_cap_time(run: dict[str, list[Sample]]) -> None:
    gpu = run["gpu"]
    counter_s = sum(float(s.fields.get("throttle_power_s", 0.0)) for s in gpu)
    # The 10 Hz bitmask's view of the same time: the share of each interval's samples under SwPowerCap.
    sampled_s = sum(
        float(s.fields.get("reason_sw_power_cap_share", 0.0)) * float(s.fields.get("interval_s", 1.0))
        for s in gpu
    )
    assert 20 < counter_s < 30
    assert counter_s == pytest.approx(sampled_s, abs=1.0)


def test_sampling_kept_its_rate_and_events_were_listened_for(run: dict[str, list[Sample]]) -> None:
    summary = json.loads((DATA / "summary.json").read_text())
    counts = [int(s.fields["samples"]) for s in run["gpu"]]
    steady = counts[2:-1]  # the first points fall in the engine's start, the last is cut by the stop
    assert (
        steady
        and all(9 <= c <= 11 for c in steady)
        and sum(steady) / len(steady) == pytest.approx(10, abs=0.05)
    )
    assert summary["gpu_events"]["listening"] is True and "xid" in summary["gpu_events"]["registered"]["0"]
    assert all(int(s.fields["errors"]) == 0 for s in run["gpu_events"])
    assert summary["gpu_throttle"]["0"]["enters"] == 1


def test_engine_points_carry_decode_share_of_the_theoretical_ceiling(run: dict[str, list[Sample]]) -> None:
    summary = json.loads((DATA / "summary.json").read_text())
    ceiling = summary["decode_ceiling"]
    assert ceiling["bandwidth_source"] == "theoretical" and ceiling["bandwidth_gbs"] == pytest.approx(
        4814.3, abs=0.1
    )
    busy = [s for s in run["engine"] if "decode_ceiling_pct" in s.fields]
    assert len(busy) > 90
    for s in busy:
        want = 100 * float(s.fields["decode_tps"]) / float(s.fields["decode_ceiling_tps"])
        assert float(s.fields["decode_ceiling_pct"]) == pytest.approx(want)
