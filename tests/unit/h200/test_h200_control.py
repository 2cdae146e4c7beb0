"""The control loop on the H200 (vLLM in-process, tiny model, capture sizes [1, 2, 4] to start): a 40 s
bf16 matmul load 10 s into the replay and an idle gap in the trace. What the daemon did and wrote,
checked against the load's own times and the engine's own numbers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from soakd.metric import Sample, parse_line
from soakd.policies.recapture import padding_stats

DATA = Path(__file__).parents[2] / "data" / "h200" / "control"


@pytest.fixture(scope="module")
def run() -> dict[str, list[Sample]]:
    by: dict[str, list[Sample]] = {}
    with gzip.open(DATA / "spool.lp.gz", "rt", encoding="utf-8") as f:
        for line in f:
            s = parse_line(line.rstrip("\n"))
            by.setdefault(s.measurement, []).append(s)
    return by


def _one(run: dict[str, list[Sample]], kind: str) -> Sample:
    (event,) = [e for e in run["events"] if e.tags["kind"] == kind]
    return event


def test_downscale_after_the_dwell_and_upscale_after_the_cool_down(run: dict[str, list[Sample]]) -> None:
    enter, down, up = _one(run, "throttle_enter"), _one(run, "downscale"), _one(run, "upscale")
    assert 10.0 <= (down.time_ns - enter.time_ns) / 1e9 <= 12.0  # dwell 10 s, decided once a second
    assert (down.fields["from_limit"], down.fields["to_limit"]) == (32, 24) and down.fields[
        "engine_live"
    ] is True
    assert float(down.fields["ev_tokens_per_s_before"]) > 0
    load = json.loads((DATA / "load.json").read_text())
    assert up.time_ns / 1e9 > load["burn_end_wall_s"] + 25  # quiet for the 25 s cool-down after the load
    assert (up.fields["from_limit"], up.fields["to_limit"]) == (24, 30)


def test_the_engine_ran_at_most_the_lowered_ceiling_until_the_upscale(run: dict[str, list[Sample]]) -> None:
    down, up = _one(run, "downscale").time_ns, _one(run, "upscale").time_ns
    between = [s for s in run["engine"] if down + 2e9 <= s.time_ns <= up and "running_max" in s.fields]
    assert between and max(int(s.fields["running_max"]) for s in between) == 24  # held at, not below, 24
    ceilings = {
        int(s.fields["engine_limit"])
        for s in run["control"]
        if down < s.time_ns < up and "engine_limit" in s.fields
    }
    assert ceilings == {24}


def test_recapture_sizes_cover_the_traffic_seen_before_it(run: dict[str, list[Sample]]) -> None:
    event = _one(run, "recapture")
    sizes = [int(x) for x in str(event.fields["sizes"]).split(",")]
    assert event.fields["previous"] == "1,2,4" and len(sizes) <= 8 and sizes == sorted(sizes)
    assert float(event.fields["ev_hit_rate"]) < 0.9 <= float(event.fields["ev_new_hit_rate"])
    rebuild = _one(run, "engine_rebuild")
    assert rebuild.fields["ok"] == 1 and rebuild.fields["drained"] == 0 and rebuild.fields["aborted"] == 0
    configs = {s.tags["config"] for s in run["engine"]}
    assert configs == {rebuild.fields["config_from"], rebuild.fields["config_to"]}
    summary = json.loads((DATA / "summary.json").read_text())
    assert summary["control"]["capture_sizes"] == sizes and summary["replay"]["failed"] == 0
    # The coverage the summary reports is padding_stats over the steps since the capture.
    cov = summary["control"]["graph_coverage_since_capture"]
    assert 0.9 < cov["hit_rate"] <= 1.0
    # The traffic after the idle gap came as a burst of queued requests (other step sizes than before):
    # the waste says so, which is why the policy judges again over the traffic since each capture.
    assert cov["padding_waste"] > padding_stats({s: 1 for s in sizes}, sizes).padding_waste
