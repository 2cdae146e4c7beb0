"""dashboards/soak.json and its provisioning files: the structure Grafana 11/12 loads, and every
measurement, field and tag a query reads is one soakd writes.

No Grafana can be installed here, so the dashboard is checked structurally. The schema is not a hand
list: a short soak runs through soakd's own wiring (`Soak` with a stub engine that reports speculative
decoding at every draft position and per request, CUDA-graph steps, allocator readings and a server's
/metrics; the real host, engine, allocator, /metrics and GPU collectors (the GPU's a recorded H200 through
`telemetry.gpu_recording`), the throttle detectors, the control loop, the sink and spool health series,
the collector runner and its scheduler, the sample writer and the spool), and the points it spools are the
schema. Where InfluxDB 1.x is installed, an integration test also runs every query on it against those
points; tests/integration/test_dashboards_influx.py runs them, and the alert rules, against a real soak.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from soakd.app import Soak
from soakd.clock import FakeClock
from soakd.collectors.engine import EngineCollector
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.collectors.nvml_events import GpuEventListener
from soakd.collectors.spec import OUTPUT_EDGES, TURN_EDGES
from soakd.config import Config, load, parse_duration
from soakd.control import Controller
from soakd.engine.base import EngineInfo, GenerationRequest
from soakd.engine.stats import StepStats
from soakd.engine.worker_ext import cuda_fields
from soakd.engine.worker_ext import memory_stats as worker_memory_stats
from soakd.sinks.spool import iter_lines, iter_samples

yaml = pytest.importorskip("yaml")  # PyYAML comes with vLLM

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "dashboards" / "soak.json"
VLLM_METRICS = ROOT / "tests" / "data" / "vllm_metrics"
DATASOURCE_YAML = ROOT / "dashboards" / "provisioning" / "datasources" / "soakd.yaml"
PROVIDER_YAML = ROOT / "dashboards" / "provisioning" / "dashboards" / "soakd.yaml"
ALERTING_YAML = ROOT / "dashboards" / "provisioning" / "alerting" / "soakd.yaml"
# A recorded H200 (a 700 W power cap at 15-35 s and 50-71 s): the GPU collector's input in the schema soak.
NVML_PHASES = ROOT / "tests" / "data" / "h200" / "phases" / "nvml_phases.jsonl.gz"

DS_REF = {"type": "influxdb", "uid": "${datasource}"}
DRAFT_POSITIONS = 4  # the dashboard plots acceptance at positions 0-3
STEP_S = 0.05  # virtual seconds per streamed delta of the stub engine
# Host fields psutil provides only where the kernel reports them (no sensors in VMs and containers,
# no cpufreq on some hypervisors): the dashboard may read them even when this machine writes none.
HOST_OPTIONAL = {("host", "cpu_freq_mhz"), ("host", "temp_max_c")}
# What only a live GPU writes: NVML's error events (a recording has no event stream) are counted in
# `gpu_events`; the GPU panels read them and the integration test checks them on a live H200 run.
GPU_OPTIONAL = {("gpu_events", "errors")}
GPU_OPTIONAL_TAGS = {("gpu_events", tag) for tag in ("run_id", "host", "gpu")}
# The control point's fields that need a live lever or a settled level: `engine_limit` once soakd's
# scheduler class holds the engine's limit (control.batch.lever = "scheduler" on a vLLM engine; the
# stub engine has none), `sustained_limit` once the batch policy has settled on a level.
CONTROL_OPTIONAL = {("control", "engine_limit"), ("control", "sustained_limit")}
# Acceptance by output position and by turn: the stub's outputs are a few tokens long and the synthetic
# trace has no sessions, so only the first bucket of each is written; the others follow the same names
# (soakd's own bucket edges), and the dashboard may read them.
PROFILE_OPTIONAL = {
    ("spec_profile", f"{kind}_{prefix}{lo}")
    for prefix, edges in (("out", OUTPUT_EDGES), ("turn", TURN_EDGES))
    for lo in edges[1:]
    for kind in ("accepted", "drafted", "rate")
}
# The user's view of latency, from each request's due time in the trace: TTFT and E2E as offered (the
# admission wait, pacing lateness and connection included), beside the server's view from the send
# (ttft_s, e2e_s). The dashboard leads with them: the schema soak must carry them (checked below).
OFFERED = {("requests", "ttft_offered_s"), ("requests", "e2e_offered_s")}


def _spread_schema() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """What the straggler series holds, from soakd's own throttle watch over two GPUs of one engine (the
    schema soak's recorded H200 is one GPU; tests/unit/run/test_app.py runs a two-GPU soak through it)."""
    watch = GpuThrottleWatch({0: 1980.0, 1: 1980.0}, lambda *_a, **_f: None, groups={"0": (0, 1)})
    for gpu, mhz in ((0, 1980), (1, 1500)):
        watch.observe(gpu, 1.0, {"sm_mhz": mhz, "reasons": 0, "power_mw": 500_000}, {"temp_c": 50})
    (point,) = [p for p in watch.collect(1) if p.measurement == "gpu_spread"]
    tags = {(point.measurement, t) for t in (*point.tags, "run_id", "host")}
    return {(point.measurement, f) for f in point.fields}, tags


# A parallel engine's spread across its GPUs (`gpu_spread`): written only with two or more GPUs to an engine.
SPREAD_OPTIONAL, SPREAD_OPTIONAL_TAGS = _spread_schema()
OPTIONAL = HOST_OPTIONAL | PROFILE_OPTIONAL | GPU_OPTIONAL | CONTROL_OPTIONAL | SPREAD_OPTIONAL
OPTIONAL_MEASUREMENTS = {m for m, _ in GPU_OPTIONAL | SPREAD_OPTIONAL}
# Targets the schema soak leaves empty: control actions and throttle transitions need a throttle episode
# longer than the detector's dwell (the real soak in tests/integration/test_dashboards_influx.py has one).
NEEDS_AN_EPISODE = {"Control actions A"}
# Real seconds each stub step blocks the event loop: soakd's scheduler (collection, the slow tier) runs
# on real time while the replay runs on the fake clock, so without it the whole soak would pass in a
# fraction of one telemetry interval and only the final collection would write anything.
STEP_REAL_S = 0.003


# ---------------------------------------------------------------------------------------------------
# the schema, from a soak through soakd's own code


class _StubEngine:
    """Streams tokens on the virtual clock and reports a step per delta with every stat soakd reads:
    scheduler, prefix cache, speculative decoding at DRAFT_POSITIONS positions and per request (each
    request's verify steps, for acceptance by output position and turn), CUDA graphs (graph and NONE
    steps). Its workers' allocator readings are one CUDA worker's (soakd's own `cuda_fields` of a
    torch-like `memory_stats()`) and one CPU worker's (soakd's `memory_stats` of this process), so both
    kinds of reading are in the run; its /metrics alternates between two real captures of a vLLM server
    (the second after more requests; back to the first reads as a server restart). Every fifth request
    fails, so `error` records are in the run too."""

    def __init__(self, collector: EngineCollector, clock: FakeClock) -> None:
        self.collector = collector
        self.clock = clock
        self.steps = 0
        self.scrapes = 0
        self.captures = [(VLLM_METRICS / f).read_text(encoding="utf-8") for f in ("before.txt", "after.txt")]

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            "stub",
            "1",
            "m",
            "cfg1",
            vocab_size=300,
            reserved_ids=(0,),
            max_model_len=4096,
            speculative_tokens=DRAFT_POSITIONS,
            cudagraphs=True,
            signals=("per_step", "spec_per_pos", "cudagraphs", "allocator", "spec_per_request", "metrics"),
        )

    async def start(self) -> None:
        return None

    def alive(self) -> bool:
        return True

    async def memory_stats(self) -> list[Any]:
        gib = 1 << 30
        reserved = 6 * gib + self.steps * (1 << 20)
        torch_stats = {
            "allocated_bytes.all.current": 5 * gib,
            "reserved_bytes.all.current": reserved,
            "active_bytes.all.current": 5 * gib + (64 << 20),
            "inactive_split_bytes.all.current": 96 << 20,
            "allocated_bytes.all.peak": 5 * gib + (512 << 20),
            "reserved_bytes.all.peak": reserved,
            "num_alloc_retries": self.steps // 50,
            "num_ooms": 0,
            "num_device_alloc": 40,
            "num_device_free": 2,
        }
        cuda: dict[str, int | float | str] = {"pid": os.getpid(), "rank": 0, "local_rank": 0}
        cuda.update(cuda_fields(torch_stats, free_bytes=70 * gib, total_bytes=140 * gib))
        cuda["source"] = "cuda_allocator"
        cpu = worker_memory_stats(SimpleNamespace(device=SimpleNamespace(type="cpu"), rank=1, local_rank=1))
        return [cuda, cpu]

    async def metrics_text(self) -> str:
        self.scrapes += 1
        return self.captures[self.scrapes % 2]

    def telemetry_summary(self) -> dict[str, object]:
        return {}

    async def prepare_replay(self, concurrency: int) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        if int(request.request_id.rsplit("-", 1)[1]) % 5 == 4:
            raise RuntimeError("stub engine failure")
        left = request.max_tokens
        first = True
        while left:
            await self.clock.sleep_until(self.clock.monotonic() + STEP_S)
            # Blocks the loop on purpose: real time passes for the scheduler's jobs (see STEP_REAL_S).
            time.sleep(STEP_REAL_S)  # noqa: ASYNC251
            n = min(DRAFT_POSITIONS, left)
            left -= n
            self.steps += 1
            if request.spec is not None and not first:
                # A verify step: DRAFT_POSITIONS drafted, n - 1 accepted plus the target model's token.
                request.spec.accepted.append(n - 1)
                request.spec.drafted.append(DRAFT_POSITIONS)
            first = False
            self.collector.push(
                StepStats(
                    time_ns=self.clock.wall_ns(),
                    running=1,
                    waiting=1,
                    kv_cache_usage=0.25,
                    has_prefix=True,
                    prefix_queries=32,
                    prefix_hits=16,
                    has_cached_count=True,
                    prompt_tokens=32,
                    prompt_tokens_cached=16,
                    generation_tokens=n,
                    preempted=int(self.steps % 7 == 0),
                    finished=int(left == 0),
                    has_iteration=True,
                    spec_drafts=1,
                    spec_draft_tokens=DRAFT_POSITIONS,
                    spec_accepted=n - 1,
                    spec_accepted_per_pos=tuple(int(i < n - 1) for i in range(DRAFT_POSITIONS)),
                    spec_draft_tokens_per_pos=(1,) * DRAFT_POSITIONS,
                    has_spec=True,
                    cg_mode="NONE" if self.steps % 3 == 0 else "FULL",
                    cg_unpadded_tokens=n,
                    cg_padded_tokens=8,
                    cg_paddings=8 - n,
                )
            )
            yield n

    def process_ids(self) -> list[int]:
        return [os.getpid()]

    async def stop(self) -> None:
        return None


@dataclass(frozen=True)
class SoakSchema:
    """What one soak spooled: (measurement, field) and (measurement, tag) pairs, tag values, the lines."""

    fields: frozenset[tuple[str, str]]
    tags: frozenset[tuple[str, str]]
    statuses: frozenset[str]
    run_id: str
    lines: tuple[str, ...]
    first_ns: int
    last_ns: int


def _soak_config(tmp: Path) -> Config:
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    (tmp / "model" / "w.safetensors").write_text("")
    return load(
        None,
        {
            "run.duration": "3s",
            "run.output_dir": str(tmp / "runs"),
            "trace.format": "synthetic",
            "trace.arrivals.rate_rps": 20.0,
            "trace.synthetic.duration": "2s",
            "trace.synthetic.output_tokens_mean": 8,
            "trace.synthetic.output_tokens_max": 16,
            "engine.model": str(tmp / "model"),
            # One request at a time at ~5 per second against 20 arriving: some are shed.
            "replay.max_concurrency": 1,
            "replay.max_pending": 2,
            # No drain: those waiting or in flight at the end are left unfinished (`incomplete`).
            "replay.drain_timeout": "0s",
            "telemetry.collectors": ["host", "engine", "allocator", "metrics", "gpu"],
            "telemetry.gpu_recording": str(NVML_PHASES),
            "telemetry.gpu_fast_interval": "20ms",
            "telemetry.gpu_slow_interval": "40ms",
            # The sink series: a forwarder that finds no InfluxDB (a closed port), retried and counted.
            "sinks.influx.enabled": True,
            "sinks.influx.url": "http://127.0.0.1:9",
            "sinks.influx.timeout": "100ms",
            "sinks.influx.interval": "100ms",
            "sinks.influx.final_drain_timeout": "0s",
            # Real seconds (the scheduler's), short enough for several collections and slow-tier
            # refreshes while the stub's steps pass (STEP_REAL_S each); the drift baseline is the first
            # such stretch with any drafts, so the later intervals carry drift fields.
            "telemetry.interval": "20ms",
            "telemetry.slow_interval": "40ms",
            "telemetry.spec_drift.baseline": "20ms",
            "telemetry.spec_drift.window": "1s",
            "telemetry.spec_drift.min_draft_tokens": 1,
        },
    )


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> SoakSchema:
    tmp = tmp_path_factory.mktemp("soak")
    clock = FakeClock(wall_start_ns=time.time_ns())

    def factory(cfg: Config, model: str, collector: EngineCollector) -> _StubEngine:
        return _StubEngine(collector, clock)

    result = asyncio.run(Soak(_soak_config(tmp), clock=clock, engine_factory=factory).run())
    spool = result.run_dir / "spool"
    fields: set[tuple[str, str]] = set()
    tags: set[tuple[str, str]] = set()
    statuses: set[str] = set()
    times: list[int] = []
    for sample in iter_samples(spool):
        fields.update((sample.measurement, name) for name in sample.fields)
        tags.update((sample.measurement, name) for name in sample.tags)
        if sample.measurement == "requests":
            statuses.add(sample.tags["status"])
        times.append(sample.time_ns)
    return SoakSchema(
        frozenset(fields),
        frozenset(tags),
        frozenset(statuses),
        result.run_id,
        tuple(iter_lines(spool)),
        min(times),
        max(times),
    )


def test_the_schema_soak_covers_what_the_dashboard_shows(schema: SoakSchema) -> None:
    # Guards the fixture itself: without these the checks below would pass vacuously.
    assert schema.statuses == {"ok", "error", "shed", "incomplete"}
    measurements = {m for m, _ in schema.fields}
    assert {
        "requests",
        "engine",
        "spec_decode",
        "spec_profile",
        "allocator",
        "vllm_metrics",
        "host",
        "collector",
        "events",
        "run",
        "gpu",
        "throttle",
        "control",
        "sink",
        "spool",
        "replay",
    } <= measurements
    assert ("engine", "cg_hit_rate") in schema.fields
    assert {("gpu", "throttle_power_s"), ("gpu", "reason_sw_power_cap_share"), ("gpu", "hbm_temp_c_max")} <= (
        schema.fields
    )
    assert ("gpu", "gpu") in schema.tags and ("throttle", "gpu") in schema.tags
    health = {("control", "policy_limit"), ("sink", "backlog_age_s"), ("spool", "dropped_total")}
    assert health <= schema.fields
    assert ("engine", "interval_s") in schema.fields  # more than one collection ran
    assert ("spec_decode", f"accepted_pos{DRAFT_POSITIONS - 1}") in schema.fields
    assert ("spec_decode", "acceptance_drift") in schema.fields  # a baseline was set and then compared
    assert {("allocator", "fragmentation"), ("allocator", "rss_bytes")} <= schema.fields
    assert ("allocator", "worker") in schema.tags
    assert {("vllm_metrics", "ttft_count"), ("vllm_metrics", "counter_resets")} <= schema.fields
    assert ("requests", "queue_s") in schema.fields
    assert schema.fields >= OFFERED
    # The profile buckets the soak does not reach are named like the ones it does.
    for prefix, edges in (("out", OUTPUT_EDGES), ("turn", TURN_EDGES)):
        for kind in ("accepted", "drafted", "rate"):
            assert ("spec_profile", f"{kind}_{prefix}{edges[0]}") in schema.fields
    for measurement in measurements:
        assert {(measurement, "run_id"), (measurement, "host")} <= schema.tags


def test_optional_names_are_ones_soakd_writes() -> None:
    # Written on paths the schema soak cannot reach (a live GPU, a live lever), but still soakd's names:
    # an optional entry cannot hide a typo in a query.
    collect = inspect.getsource(Controller.collect)
    for _, name in CONTROL_OPTIONAL:
        assert f'fields["{name}"]' in collect, name
    events = inspect.getsource(GpuEventListener.collect)
    assert 'Sample("gpu_events", {"errors": n}' in events and 'tags={"gpu": str(gpu)}' in events


# ---------------------------------------------------------------------------------------------------
# the dashboard


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return doc


def all_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def content_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dash) if p["type"] != "row"]


def panel_queries(dash: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in content_panels(dash):
        for target in panel["targets"]:
            yield panel, target


def annotation_queries(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in dash["annotations"]["list"] if a.get("datasource", {}).get("type") == "influxdb"]


def variable(dash: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [v for v in dash["templating"]["list"] if v["name"] == name]
    assert len(found) == 1, name
    return found[0]


def test_dashboard_identity_and_schema_version(dashboard: dict[str, Any]) -> None:
    assert 39 <= dashboard["schemaVersion"] <= 42
    assert dashboard["uid"] == "soakd-soak"
    assert dashboard["title"] == "soakd: soak run"
    assert dashboard["id"] is None  # provisioned: Grafana assigns the id


def test_panel_ids_are_unique_and_the_grid_does_not_overlap(dashboard: dict[str, Any]) -> None:
    panels = list(all_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    # What is drawn at once: the top level (collapsed rows one line each), and each collapsed row's
    # panels as they are laid out when it is expanded (right under it).
    layers = [dashboard["panels"]]
    for row in dashboard["panels"]:
        if row["type"] == "row" and row.get("collapsed"):
            assert all(p["gridPos"]["y"] > row["gridPos"]["y"] for p in row["panels"]), row["title"]
            layers.append(row["panels"])
    for layer in layers:
        boxes = []
        for p in layer:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1, p["title"]
            assert g["x"] + g["w"] <= 24, p["title"]
            boxes.append((p["title"], g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"]))
        for i, (a, ax0, ay0, ax1, ay1) in enumerate(boxes):
            for b, bx0, by0, bx1, by1 in boxes[i + 1 :]:
                assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, f"{a!r} overlaps {b!r}"


def rows(dash: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Row title -> the panels placed below it (up to the next row), in the order they are drawn."""
    out: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] = []
    for panel in sorted(dash["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel["type"] == "row":
            current = out.setdefault(panel["title"], list(panel.get("panels", [])))
        else:
            current.append(panel)
    return out


def test_rows_and_panels_are_the_brief(dashboard: dict[str, Any]) -> None:
    assert dashboard["panels"][0]["type"] == "row"
    by_row = rows(dashboard)
    assert list(by_row) == [
        "Overview",
        "GPU",
        "Control",
        "Latency",
        "Throughput",
        "Engine",
        "Speculative decoding",
        "Allocator",
        "Server /metrics cross-check",
        "Host",
        "Sink health",
        "soakd health",
    ]
    assert all(by_row.values())
    # The page opens on the overview, the runs table first; every detail row is collapsed (its panels
    # inside it), so 60-odd panels do not all query at once.
    assert by_row["Overview"][0]["title"] == "Runs" and by_row["Overview"][0]["type"] == "table"
    assert {p["type"] for p in by_row["Overview"][1:]} == {"stat"}
    row_panels = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r["collapsed"] for r in row_panels] == [False] + [True] * (len(row_panels) - 1)
    assert all(r["panels"] for r in row_panels[1:]) and not row_panels[0]["panels"]
    assert [p["type"] for p in by_row["soakd health"]][-1] == "table"
    assert "Concurrency ceiling" in {p["title"] for p in by_row["Overview"]}
    assert {p["title"] for p in by_row["Allocator"]} >= {"Allocator fragmentation"}
    assert {p["type"] for p in content_panels(dashboard)} == {"stat", "timeseries", "table", "bargauge"}


def test_every_panel_says_what_it_shows_and_has_a_unit(dashboard: dict[str, Any]) -> None:
    for panel in content_panels(dashboard):
        desc = panel.get("description", "")
        assert desc.strip() and "\n" not in desc, panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"] == DS_REF, panel["title"]
        assert panel["targets"], panel["title"]


def test_every_target_is_influxql_for_one_run(dashboard: dict[str, Any]) -> None:
    for panel, target in panel_queries(dashboard):
        where = f"{panel['title']} {target['refId']}"
        assert target["rawQuery"] is True, where
        assert isinstance(target["query"], str), where
        assert target["datasource"] == DS_REF, where
        query = target["query"]
        if 'FROM "run"' in query:
            # The run point is written once, at the end: read whatever the time range, so a finished run
            # shows its verdict; the runs table lists every run, each linking to its own time range.
            assert "$timeFilter" not in query and "time > now() - 400d" in query, where
            if panel["title"] == "Runs":
                assert '"run_id" =~' not in query and 'GROUP BY "run_id", "host"' in query, where
                continue
        else:
            assert "$timeFilter" in query, where
        assert '"run_id" =~ /^$run_id$/' in query, where
        assert '"host" =~ /^$host$/' in query, where
        # Every GPU series is filtered on the gpu variable, and nothing else is.
        gpu_series = re.search(r'FROM "(gpu|gpu_events|throttle)"', query) is not None
        assert ('"gpu" =~ /^$gpu$/' in query) == gpu_series, where
        if panel["type"] == "timeseries":
            assert "GROUP BY time($__interval)" in query and query.endswith("fill(null)"), where
        else:
            # Stats, bar gauges and the events table read the whole range: a p99 per bucket is not the
            # run's p99.
            assert "GROUP BY time" not in query, where
        if "percentile(" in query and panel["type"] == "timeseries":
            # A percentile per bucket needs tens of requests in it: never under a minute per point.
            assert parse_duration(panel.get("interval", "0s")) >= 60, where
    for panel in content_panels(dashboard):
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_per_second_rates_never_use_buckets_shorter_than_the_telemetry_interval(
    dashboard: dict[str, Any],
) -> None:
    # engine/spec_decode points hold counts per telemetry interval: a sum over a bucket shorter than that
    # interval, divided by the bucket, would multiply the rate (and empty buckets would alternate).
    interval = load(None).telemetry.interval
    rate_panels = [p for p, t in panel_queries(dashboard) if "$__interval_ms" in t["query"]]
    assert rate_panels
    for panel in rate_panels:
        assert parse_duration(panel.get("interval", "0s")) >= interval, panel["title"]


_RATIO = re.compile(r'sum\("([^"]+)"\)\s*/\s*sum\("([^"]+)"\)')


def test_ratios_skip_intervals_with_nothing_to_divide(dashboard: dict[str, Any]) -> None:
    # InfluxQL 1.x answers x / 0 with 0: an interval without drafts would read as 0% acceptance.
    ratios = 0
    for panel, target in panel_queries(dashboard):
        for _, denominator in _RATIO.findall(target["query"]):
            ratios += 1
            assert f'"{denominator}" > 0' in target["query"], f"{panel['title']}: {denominator}"
    assert ratios >= 6


def test_the_runs_table_links_each_run_to_its_own_time_range(dashboard: dict[str, Any]) -> None:
    runs = next(p for p in content_panels(dashboard) if p["title"] == "Runs")
    query = runs["targets"][0]["query"]
    assert (
        'last("start_ms")' in query
        and 'last("end_ms")' in query
        and runs["targets"][0]["resultFormat"] == "table"
    )
    (override,) = [o for o in runs["fieldConfig"]["overrides"] if o["matcher"]["options"] == "run_id"]
    (link,) = next(p["value"] for p in override["properties"] if p["id"] == "links")
    url = link["url"]
    assert url.startswith("/d/${__dashboard.uid}?")
    for part in (
        "var-run_id=${__data.fields.run_id}",
        "var-host=${__data.fields.host}",
        "from=${__data.fields.start_ms}",
        "to=${__data.fields.end_ms}",
    ):
        assert part in url, part
    hidden = runs["transformations"][0]["options"]["excludeByName"]
    assert hidden == {"Time": True, "start_ms": True, "end_ms": True}


# The server's view of a latency (from the send) and the user's view of the same (from the due time).
FROM_THE_SEND = {"ttft_s": "ttft_offered_s", "e2e_s": "e2e_offered_s"}
# Like with like: the server's own /metrics means beside soakd's from the send (the server never sees the
# wait in soakd); the as-offered figures are in the Latency row.
CROSS_CHECK = "TTFT and E2E: server vs soakd (mean)"


def test_latency_panels_lead_with_the_user_s_view(dashboard: dict[str, Any]) -> None:
    # Every TTFT and E2E panel shows the figure as offered (from the request's due time in the trace:
    # soakd's admission wait, its lateness and the connection included) first, and the server's view
    # (from the send) beside it, named as such.
    seen = 0
    for panel in content_panels(dashboard):
        queries = [t["query"] for t in panel["targets"] if 'FROM "requests"' in t["query"]]
        sent = {f for f in FROM_THE_SEND if any(f'"{f}"' in q for q in queries)}
        if not sent:
            continue
        if panel["title"] == CROSS_CHECK:
            assert "from the send" in panel["description"] and "as-offered" in panel["description"]
            continue
        seen += 1
        first = panel["targets"][0]["query"]
        for name in sent:
            assert f'"{FROM_THE_SEND[name]}"' in first and f'"{name}"' not in first, panel["title"]
        assert "as offered (from due time)" in panel["title"], panel["title"]
        assert "from the send" in panel["description"] and "server's view" in panel["description"]
    assert seen == 4  # the TTFT and E2E stats of the overview, the TTFT and E2E series of the Latency row
    # The stat of what the criterion judges reads TTFT as offered; the server's view is its second value.
    (criterion,) = [p for p in content_panels(dashboard) if "ttft_p99_ms criterion" in p["description"]]
    assert criterion in rows(dashboard)["Overview"]
    offered, send = criterion["targets"]
    assert offered["query"].startswith('SELECT percentile("ttft_offered_s", 99) FROM "requests"')
    assert send["query"].startswith('SELECT percentile("ttft_s", 99) FROM "requests"')
    assert (offered["alias"], send["alias"]) == ("as offered", "from the send")
    assert all("\"status\" = 'ok'" in t["query"] for t in criterion["targets"])  # as the verdict: ok only


def test_the_admission_ceiling_stats_sit_with_the_latency_stats(dashboard: dict[str, Any]) -> None:
    overview = rows(dashboard)["Overview"]
    (share,) = [p for p in overview if any('"queue_s" > 0.001' in t["query"] for t in p["targets"])]
    (wait,) = [p for p in overview if any('percentile("queue_s", 99)' in t["query"] for t in p["targets"])]
    queries = {t["refId"]: t["query"] for t in share["targets"]}
    # A request waited when its admission wait is over 1 ms (a free slot is taken in microseconds), of the
    # ok requests, as the verdict's note counts them; the share is A / B.
    assert '"queue_s" > 0.001' in queries["A"] and '"queue_s" >' not in queries["B"]
    assert all("\"status\" = 'ok'" in q for q in [*queries.values(), wait["targets"][0]["query"]])
    # Table results name their columns by the queries' aliases, which the calculation divides; both are
    # counts, which InfluxDB answers at the range's start, so Grafana joins them into one row (a selector
    # such as percentile answers at its point's time, hence the p99 wait in a stat of its own).
    assert {t["resultFormat"] for t in share["targets"]} == {"table"}
    (calc,) = [t["options"] for t in share["transformations"] if t["id"] == "calculateField"]
    binary = calc["binary"]
    assert calc["mode"] == "binary" and binary["operator"] == "/"
    assert queries["A"].startswith(f'SELECT count("queue_s") AS "{binary["left"]}" ')
    assert queries["B"].startswith(f'SELECT count("queue_s") AS "{binary["right"]}" ')
    (organize,) = [t["options"] for t in share["transformations"] if t["id"] == "organize"]
    hidden = {name for name, off in organize["excludeByName"].items() if off}
    assert hidden == {"Time", binary["left"], binary["right"]}
    assert share["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert wait["fieldConfig"]["defaults"]["unit"] == "s"
    for panel in (share, wait):
        assert "as offered" in panel["description"] and "server's view" in panel["description"]
    # Right under the TTFT stat they explain, side by side.
    ttft = next(p for p in overview if p["title"].startswith("TTFT p99 as offered"))
    g, w, t = share["gridPos"], wait["gridPos"], ttft["gridPos"]
    assert g["y"] == w["y"] == t["y"] + t["h"] and g["x"] <= t["x"] < g["x"] + g["w"] == w["x"]


def test_the_run_point_carries_the_run_s_span(schema: SoakSchema) -> None:
    assert {("run", "start_ms"), ("run", "end_ms")} <= schema.fields


def test_dashboard_file_is_the_dashboard() -> None:
    provider = yaml.safe_load(PROVIDER_YAML.read_text())["providers"][0]
    assert provider["allowUiUpdates"] is False  # edits go to the file, not to a UI copy that is lost


def test_overview_verdict_maps_passed_to_pass_and_fail(dashboard: dict[str, Any]) -> None:
    verdict = next(p for p in content_panels(dashboard) if p["title"] == "Verdict")
    assert 'FROM "run"' in verdict["targets"][0]["query"] and '"passed"' in verdict["targets"][0]["query"]
    options = verdict["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert options["1"]["text"] == "PASS" and options["1"]["color"] == "green"
    assert options["0"]["text"] == "FAIL" and options["0"]["color"] == "red"


def test_acceptance_covers_the_default_number_of_draft_tokens(dashboard: dict[str, Any]) -> None:
    k = load(None).engine.speculative.num_speculative_tokens
    text = json.dumps(dashboard)
    for i in range(max(k, DRAFT_POSITIONS)):
        assert f'sum(\\"accepted_pos{i}\\") / sum(\\"draft_tokens_pos{i}\\")' in text


def test_acceptance_profile_covers_every_bucket_soakd_writes(dashboard: dict[str, Any]) -> None:
    text = json.dumps(dashboard)
    for prefix, edges in (("out", OUTPUT_EDGES), ("turn", TURN_EDGES)):
        for lo in edges:
            assert f'sum(\\"accepted_{prefix}{lo}\\") / sum(\\"drafted_{prefix}{lo}\\")' in text, (prefix, lo)


def test_variables_and_annotations(dashboard: dict[str, Any]) -> None:
    ds = variable(dashboard, "datasource")
    assert ds["type"] == "datasource" and ds["query"] == "influxdb"
    run = variable(dashboard, "run_id")
    assert run["type"] == "query" and run["datasource"] == DS_REF
    assert run["query"].startswith("SHOW TAG VALUES FROM ") and 'WITH KEY = "run_id"' in run["query"]
    assert run["sort"] == 2  # alphabetical descending: run ids start with their UTC time, newest first
    assert not run["multi"] and not run["includeAll"]  # one run at a time
    host = variable(dashboard, "host")
    assert 'WITH KEY = "host"' in host["query"] and "$run_id" in host["query"]
    gpu = variable(dashboard, "gpu")
    assert gpu["query"].startswith('SHOW TAG VALUES FROM "gpu" WITH KEY = "gpu"')
    assert "$run_id" in gpu["query"] and "$host" in gpu["query"]
    assert gpu["includeAll"] and gpu["allValue"] == ".*" and gpu["multi"]
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names.index("gpu") == names.index("host") + 1
    (anno,) = annotation_queries(dashboard)
    assert anno["datasource"] == DS_REF and anno["enable"] is True
    for holder in (anno, anno["target"]):  # legacy keys and Grafana 10+'s migrated target agree
        assert holder["query"] == anno["query"]
        assert holder["textColumn"] == "message" and holder["tagsColumn"] == "kind"
    assert 'FROM "events"' in anno["query"]
    # The kinds chosen in the `kind` variable (All by default: every event is drawn, engine_rebuild,
    # engine_restart, engine_failed, spec_drift and spec_drift_cleared included).
    assert '"kind" =~ /^$kind$/' in anno["query"]
    kind = variable(dashboard, "kind")
    assert 'WITH KEY = "kind"' in kind["query"] and "$run_id" in kind["query"]
    assert kind["multi"] and kind["includeAll"] and kind["allValue"] == ".*"
    assert kind["current"]["value"] == ["$__all"]
    assert '"run_id" =~ /^$run_id$/' in anno["query"] and "$timeFilter" in anno["query"]


# ---------------------------------------------------------------------------------------------------
# every measurement, field and tag a query reads is in the schema

_AS = re.compile(r'\s+AS\s+"[^"]*"', re.IGNORECASE)
_REGEX_LITERAL = re.compile(r"/\^[^/]*\$/")
_STRING = re.compile(r"'[^']*'")
_FROM = re.compile(r'\bFROM\s+"([^"]+)"', re.IGNORECASE)
_GROUP_BY = re.compile(r"\bGROUP BY\s+(.*?)(?:\s+fill\(|\s+ORDER BY|\s+LIMIT|$)", re.IGNORECASE)
_FUNC_ARG = re.compile(r'\b[a-z_]+\(\s*"([^"]+)"', re.IGNORECASE)
_IDENT = re.compile(r'"([^"]+)"')
_SHOW_TAG_KEY = re.compile(r'WITH KEY\s*=\s*"([^"]+)"', re.IGNORECASE)


@dataclass
class Refs:
    measurement: str
    fields: set[str]
    """Identifiers inside functions: must be fields."""
    tags: set[str]
    """GROUP BY and SHOW TAG VALUES keys: must be tags."""
    either: set[str]
    """Raw SELECT columns and WHERE identifiers: a field or a tag."""


def references(query: str) -> Refs:
    """What an InfluxQL query reads. Aliases, regex literals and string literals are not references."""
    text = _STRING.sub("''", _REGEX_LITERAL.sub("//", _AS.sub("", query)))
    measurements = _FROM.findall(text)
    assert len(measurements) == 1, f"one FROM per query (no subqueries): {query}"
    text = _FROM.sub("", text)
    tags: set[str] = set()
    key = _SHOW_TAG_KEY.search(text)
    if key:
        tags.add(key.group(1))
        text = _SHOW_TAG_KEY.sub("", text)
    group = _GROUP_BY.search(text)
    if group:
        tags.update(name for name in _IDENT.findall(group.group(1)))
        text = text[: group.start()] + text[group.end() :]
    fields = set(_FUNC_ARG.findall(text))
    either = set(_IDENT.findall(text)) - fields
    return Refs(measurements[0], fields, tags, either)


def test_the_reference_parser() -> None:
    q = (
        'SELECT sum("a") / sum("b") AS "rate", "kind" FROM "m" WHERE "run_id" =~ /^$run_id$/ AND "b" > 0 '
        'AND "status" = \'ok\' AND $timeFilter GROUP BY time($__interval), "t" fill(null)'
    )
    r = references(q)
    assert (r.measurement, r.fields, r.tags, r.either) == (
        "m",
        {"a", "b"},
        {"t"},
        {"kind", "run_id", "status"},
    )
    r = references('SHOW TAG VALUES FROM "events" WITH KEY = "host" WHERE "run_id" =~ /^$run_id$/')
    assert (r.measurement, r.fields, r.tags, r.either) == ("events", set(), {"host"}, {"run_id"})


def all_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    out = [(f"{p['title']} {t['refId']}", t["query"]) for p, t in panel_queries(dash)]
    out += [(f"annotation {a['name']}", a["query"]) for a in annotation_queries(dash)]
    out += [(f"annotation {a['name']} target", a["target"]["query"]) for a in annotation_queries(dash)]
    out += [(f"variable {v['name']}", v["query"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def test_every_measurement_field_and_tag_a_query_reads_is_written_by_soakd(
    dashboard: dict[str, Any], schema: SoakSchema
) -> None:
    fields = schema.fields | OPTIONAL
    tags = schema.tags | GPU_OPTIONAL_TAGS | SPREAD_OPTIONAL_TAGS
    measurements = {m for m, _ in schema.fields}
    problems: list[str] = []
    read: set[tuple[str, str]] = set()
    for where, query in all_queries(dashboard):
        refs = references(query)
        m = refs.measurement
        if m not in measurements and m not in OPTIONAL_MEASUREMENTS:
            problems.append(f"{where}: no measurement {m!r}")
            continue
        for name in refs.fields:
            read.add((m, name))
            if (m, name) not in fields:
                problems.append(f"{where}: {m!r} has no field {name!r}")
        for name in refs.tags:
            if (m, name) not in tags:
                problems.append(f"{where}: {m!r} has no tag {name!r}")
        for name in refs.either:
            read.add((m, name))
            if (m, name) not in fields and (m, name) not in tags:
                problems.append(f"{where}: {m!r} has no field or tag {name!r}")
    assert not problems, "\n".join(problems)
    # and the dashboard reads the headline of every measurement
    for pair in [
        ("requests", "ttft_offered_s"),
        ("requests", "e2e_offered_s"),
        ("requests", "ttft_s"),
        ("requests", "e2e_s"),
        ("requests", "queue_s"),
        ("requests", "tpot_s"),
        ("engine", "generation_tokens"),
        ("engine", "kv_cache_usage_max"),
        ("spec_decode", "accepted"),
        ("spec_decode", "acceptance_drift"),
        ("spec_decode", "acceptance_length_drift"),
        ("spec_decode", "window_acceptance_rate"),
        ("spec_profile", "drafted_out0"),
        ("spec_profile", "drafted_turn0"),
        ("engine", "cg_steps_none"),
        ("engine", "cg_graph_tokens"),
        ("engine", "tokens_per_step_p99"),
        ("allocator", "fragmentation"),
        ("allocator", "reserved_bytes"),
        ("allocator", "num_ooms"),
        ("allocator", "rss_bytes"),
        ("vllm_metrics", "ttft_sum_s"),
        ("vllm_metrics", "counter_resets"),
        ("host", "engine_rss_bytes"),
        ("collector", "duration_s"),
        ("events", "message"),
        ("run", "passed"),
        ("gpu", "sm_clock_ratio"),
        ("gpu", "power_limit_w"),
        ("gpu", "thermal_margin_c"),
        ("gpu", "reason_sw_power_cap_share"),
        ("gpu", "throttle_power_s"),
        ("gpu", "throttle_hw_thermal_s"),
        ("gpu", "mem_used_bytes"),
        ("gpu_events", "errors"),
        ("throttle", "state"),
        ("control", "policy_limit"),
        ("events", "kind"),
        ("sink", "backlog_lines"),
        ("sink", "backlog_bytes"),
        ("sink", "backlog_age_s"),
        ("sink", "failures"),
        ("sink", "lines_rejected"),
        ("spool", "state"),
        ("spool", "dropped_total"),
    ]:
        assert pair in read, pair


# ---------------------------------------------------------------------------------------------------
# provisioning


def test_datasource_provisioning_matches_the_dashboard_and_soakd(dashboard: dict[str, Any]) -> None:
    doc = yaml.safe_load(DATASOURCE_YAML.read_text(encoding="utf-8"))
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["type"] == "influxdb"
    assert ds["name"] == ds["uid"] == "soakd-influxdb"
    assert variable(dashboard, "datasource")["current"]["value"] == ds["uid"]
    defaults = load(None).sinks.influx
    assert ds["url"] == defaults.url == "http://127.0.0.1:8086"
    assert ds["jsonData"]["dbName"] == defaults.database
    assert ds["jsonData"]["httpMode"] == "POST"
    assert ds["jsonData"].get("version", "InfluxQL") == "InfluxQL"


def test_dashboard_provider_provisioning() -> None:
    doc = yaml.safe_load(PROVIDER_YAML.read_text(encoding="utf-8"))
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/soakd"
    assert provider["options"]["foldersFromFilesStructure"] is False


@pytest.fixture(scope="module")
def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTING_YAML.read_text(encoding="utf-8"))
    assert doc["apiVersion"] == 1
    (group,) = doc["groups"]
    assert group["orgId"] == 1 and group["name"] == "soakd" and group["folder"] == "soakd"
    assert parse_duration(group["interval"]) == 60
    rules: list[dict[str, Any]] = group["rules"]
    return rules


def alert_query(rule: dict[str, Any]) -> str:
    query: str = rule["data"][0]["model"]["query"]
    return query


def test_alert_rules_are_grafana_unified_alerting_provisioning(
    alert_rules: list[dict[str, Any]], dashboard: dict[str, Any]
) -> None:
    datasource = yaml.safe_load(DATASOURCE_YAML.read_text(encoding="utf-8"))["datasources"][0]["uid"]
    panels = {p["id"] for p in content_panels(dashboard)}
    uids = [r["uid"] for r in alert_rules]
    assert len(uids) == len(set(uids)) and all(u.startswith("soakd-") and len(u) <= 40 for u in uids)
    for rule in alert_rules:
        uid = rule["uid"]
        assert rule["title"] and rule["condition"] == "C", uid
        a, b, c = rule["data"]
        assert [a["refId"], b["refId"], c["refId"]] == ["A", "B", "C"], uid
        # A: InfluxQL on the provisioned datasource over a relative range ending now.
        assert a["datasourceUid"] == datasource == a["model"]["datasource"]["uid"], uid
        assert a["model"]["refId"] == "A" and a["model"]["rawQuery"] is True, uid
        assert a["relativeTimeRange"]["from"] >= 300 and a["relativeTimeRange"]["to"] == 0, uid
        # B: one number per series; C: the threshold on it.
        assert b["datasourceUid"] == c["datasourceUid"] == "__expr__", uid
        assert b["model"]["type"] == "reduce" and b["model"]["expression"] == "A", uid
        assert b["model"]["reducer"] in {"last", "mean", "max", "min", "sum", "count"}, uid
        mode = b["model"]["settings"]["mode"]
        assert mode in {"dropNN", "replaceNN"}, uid
        assert (mode == "replaceNN") == ("replaceWithValue" in b["model"]["settings"]), uid
        assert c["model"]["type"] == "threshold" and c["model"]["expression"] == "B", uid
        (condition,) = c["model"]["conditions"]
        evaluator = condition["evaluator"]
        assert evaluator["type"] in {"gt", "lt"} and len(evaluator["params"]) == 1, uid
        # Chosen on purpose (see the file's header), not left to Grafana's defaults.
        assert rule["noDataState"] == "OK" and rule["execErrState"] == "Error", uid
        assert parse_duration(rule["for"]) >= 60, uid
        assert rule["labels"]["severity"] in {"warning", "critical"} and rule["labels"]["service"] == "soakd"
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], uid
        assert "$labels.host" in rule["annotations"]["summary"], uid
        assert rule["dashboardUid"] == dashboard["uid"] and rule["panelId"] in panels, uid


def test_alert_queries_group_by_host_and_gpu_over_the_rules_range(alert_rules: list[dict[str, Any]]) -> None:
    for rule in alert_rules:
        query = alert_query(rule)
        uid = rule["uid"]
        # No dashboard variables in alerting: only the time range macro, which Grafana fills in.
        assert "$timeFilter" in query and "$__" not in query, uid
        assert not re.search(r"\$(run_id|host|gpu|datasource)\b", query), uid
        assert "GROUP BY time" not in query, uid  # one value per series over the whole range
        refs = references(query)
        want = {"host", "gpu"} if refs.measurement in ("gpu", "throttle") else {"host"}
        assert refs.tags == want, uid
        for _, denominator in _RATIO.findall(query):
            assert f'"{denominator}" > 0' in query, f"{uid}: {denominator}"


def test_latency_alerts_judge_the_user_s_view(alert_rules: list[dict[str, Any]]) -> None:
    # No rule judges a latency from the send (the server's view hides soakd's admission wait).
    for rule in alert_rules:
        refs = references(alert_query(rule))
        if refs.measurement == "requests":
            assert not set(FROM_THE_SEND) & (refs.fields | refs.either), rule["uid"]
    # The admission-wait rule: a p99 wait over the default ttft_p99_ms alone breaks TTFT as offered,
    # whatever the engine does (set both together).
    (rule,) = [r for r in alert_rules if r["uid"] == "soakd-admission-wait"]
    assert alert_query(rule).startswith(
        'SELECT percentile("queue_s", 99) FROM "requests" WHERE "status" = \'ok\''
    )
    (condition,) = rule["data"][2]["model"]["conditions"]
    assert condition["evaluator"] == {"type": "gt", "params": [load(None).criteria.ttft_p99_ms / 1000]}


def test_alert_rules_cover_the_brief(alert_rules: list[dict[str, Any]], schema: SoakSchema) -> None:
    read = {uid: references(alert_query(r)) for uid, r in ((r["uid"], r) for r in alert_rules)}
    fields = schema.fields | OPTIONAL
    for uid, refs in read.items():
        for name in refs.fields | refs.either:
            pair = (refs.measurement, name)
            assert pair in fields or pair in schema.tags, f"{uid}: {pair}"
    wanted = {
        ("throttle", "harm_s"),
        ("gpu", "throttle_thermal_s"),
        ("gpu", "reason_hw_slowdown_share"),
        ("engine", "cg_graph_steps"),
        ("spec_decode", "acceptance_drift"),
        ("requests", "error"),
        ("sink", "backlog_age_s"),
        ("requests", "queue_s"),
    }
    have = {(refs.measurement, f) for refs in read.values() for f in refs.fields}
    assert wanted <= have, wanted - have


# ---------------------------------------------------------------------------------------------------
# every query on a real InfluxDB 1.x, against the schema soak's points


def _grafana_interpolate(query: str, run_id: str, start_ns: int, end_ns: int) -> str:
    """What Grafana sends for this dashboard: one run, host and gpu All (allValue .*), a 1 s interval."""
    return (
        query.replace("$run_id", re.escape(run_id))
        .replace("$host", ".*")
        .replace("$gpu", ".*")
        .replace("$kind", ".*")
        .replace("$timeFilter", f"time >= {start_ns // 1_000_000}ms and time <= {end_ns // 1_000_000}ms")
        .replace("$__interval_ms", "1000")
        .replace("$__interval", "1s")
    )


def _non_null_values(result: dict[str, Any]) -> int:
    count = 0
    for series in result.get("series", []):
        for row in series["values"]:
            count += sum(v is not None for v in row[1:])
    return count


@pytest.mark.integration
def test_every_query_runs_on_influxdb_1x(
    dashboard: dict[str, Any], schema: SoakSchema, tmp_path: Path
) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    try:
        import servers
    finally:
        sys.path.pop(0)
    if not servers.binary_available(servers.INFLUXD):
        if os.environ.get("SOAKD_REQUIRE_SERVERS") == "1":
            pytest.fail(f"SOAKD_REQUIRE_SERVERS=1 but {servers.INFLUXD} not found", pytrace=False)
        pytest.skip(f"{servers.INFLUXD} not found (apt-get install influxdb)")
    server = servers.start_influxdb(tmp_path / "influxdb")
    try:
        with httpx.Client(base_url=server.url, timeout=10.0) as client:
            client.post("/query", params={"q": "CREATE DATABASE soakd"}).raise_for_status()
            body = "\n".join(schema.lines).encode()
            client.post("/write", params={"db": "soakd", "precision": "ns"}, content=body).raise_for_status()
            problems: list[str] = []
            for where, query in all_queries(dashboard):
                q = _grafana_interpolate(
                    query, schema.run_id, schema.first_ns - 10**9, schema.last_ns + 10**9
                )
                reply = client.get("/query", params={"db": "soakd", "q": q}).json()
                # A statement InfluxDB cannot parse fails the whole request; one it cannot run, its result.
                result = reply["results"][0] if "results" in reply else reply
                if "error" in result:
                    problems.append(f"{where}: {result['error']}\n  {q}")
                    continue
                refs = references(query)
                optional = {(refs.measurement, f) for f in refs.fields | refs.either} & OPTIONAL
                if where in NEEDS_AN_EPISODE:
                    continue
                if _non_null_values(result) == 0 and not (optional - schema.fields):
                    problems.append(f"{where}: no data\n  {q}")
            assert not problems, "\n".join(problems)
    finally:
        server.stop()
