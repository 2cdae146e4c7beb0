"""Engine telemetry recorded on an H200 (CUDA graphs, allocator, a rebuild): the schema holds on real data."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from soakd.metric import Sample, parse_line

DATA = Path(__file__).parents[2] / "data" / "h200" / "rebuild"
SERVER = DATA.parent / "server"


def samples(folder: Path = DATA) -> dict[str, list[Sample]]:
    by: dict[str, list[Sample]] = {}
    with gzip.open(folder / "spool.lp.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            s = parse_line(line.rstrip("\n"))
            by.setdefault(s.measurement, []).append(s)
    return by


def test_graph_fields_are_consistent_rates_on_real_steps() -> None:
    by = samples()
    engine = [s for s in by["engine"] if "cg_steps" in s.fields]
    assert engine
    for s in engine:
        f = s.fields
        modes = int(f["cg_steps_full"]) + int(f["cg_steps_piecewise"]) + int(f["cg_steps_none"])
        assert modes == f["cg_steps"]
        assert int(f["cg_graph_steps"]) == int(f["cg_steps"]) - int(f["cg_steps_none"])
        if "cg_hit_rate" in f:
            assert 0.0 <= float(f["cg_hit_rate"]) <= 1.0
        if "cg_padding_waste" in f:
            assert 0.0 <= float(f["cg_padding_waste"]) < 1.0
        assert int(f["cg_graph_tokens"]) <= int(f["cg_unpadded_tokens"])
    summary = json.loads((DATA / "summary.json").read_text())
    cg = summary["engine_telemetry"]["cudagraphs"]
    total = sum(int(s.fields["cg_steps"]) for s in engine)
    assert total == cg["steps"] == sum(cg["steps_by_mode"].values())


def test_the_rebuild_splits_engine_series_by_config_id() -> None:
    by = samples()
    (event,) = [e for e in by["events"] if e.tags["kind"] == "engine_rebuild"]
    before, after = str(event.fields["config_from"]), str(event.fields["config_to"])
    configs = [s.tags["config"] for s in by["engine"]]
    assert set(configs) == {before, after}
    switch = configs.index(after)
    assert all(c == before for c in configs[:switch]) and all(c == after for c in configs[switch:])
    assert {s.tags["config"] for s in by["allocator"]} <= {before, after}


def test_allocator_points_from_the_cuda_caching_allocator() -> None:
    by = samples()
    for s in by["allocator"]:
        f = s.fields
        assert f["source"] == "cuda_allocator"
        assert int(f["allocated_bytes"]) <= int(f["reserved_bytes"]) <= int(f["device_total_bytes"])
        assert 0.0 <= float(f["fragmentation"]) < 1.0
        assert (
            abs(float(f["fragmentation"]) - (1 - int(f["allocated_bytes"]) / int(f["reserved_bytes"]))) < 1e-9
        )
        assert int(f["num_ooms"]) == 0


def test_requests_all_counted_once_across_the_rebuild() -> None:
    by = samples()
    summary = json.loads((DATA / "summary.json").read_text())
    replay = summary["replay"]
    keys = [(s.fields["loop"], s.fields["index"], s.fields.get("session", "")) for s in by["requests"]]
    assert len(keys) == len(set(keys)) == replay["scheduled"] == replay["completed"] + replay["failed"]


def test_server_mode_plugin_steps_all_arrived_and_match_the_servers_own_counters() -> None:
    by = samples(SERVER)
    summary = json.loads((SERVER / "summary.json").read_text())
    tele = summary["engine_telemetry"]
    (engine,) = tele["engines"]
    logger = engine["stat_logger"]
    assert logger["lost"] == 0 and logger["malformed"] == 0
    # Every step the plugin sent is in the engine series (warm-up steps were dropped before it).
    assert sum(int(s.fields["steps"]) for s in by["engine"]) == summary["engine_steps"] <= logger["steps"]
    # The server's own /metrics agrees with the per-step stats: the scrapes cover all but the run's
    # last few seconds, so their generated tokens are a large part of the steps' total, never more.
    per_step = sum(int(s.fields["generation_tokens"]) for s in by["engine"])
    scraped = sum(int(s.fields["generation_tokens"]) for s in by["vllm_metrics"])
    assert 0.7 * per_step < scraped <= per_step
    accepted = sum(int(s.fields["spec_decode_num_accepted_tokens"]) for s in by["vllm_metrics"])
    assert 0 < accepted <= summary["spec_decode"]["accepted"]
    assert "spec_per_request" not in tele["signals"]
    assert any("output position" in m for m in tele["missing"])
