"""The soak's wiring, with an in-process fake engine: start order, samples, verdict, summary, signals."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from soakd.app import Soak
from soakd.checkpoint import read_checkpoint
from soakd.collectors.engine import EngineCollector
from soakd.config import Config, load
from soakd.engine.base import GenerationRequest
from soakd.errors import ConfigError
from soakd.metric import Sample
from soakd.sinks.spool import Spool, iter_samples
from soakd.sinks.writer import SampleWriter
from soakd.testing import StubEngine
from soakd.testing import stub_config as config


async def test_a_soak_with_a_fake_engine(tmp_path: Path) -> None:
    engines: list[StubEngine] = []

    def factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
        engines.append(StubEngine(collector))
        return engines[-1]

    soak = Soak(config(tmp_path), engine_factory=factory)
    result = await soak.run()
    engine = engines[0]
    assert engine.started and engine.stopped
    warm = [r for r in engine.seen if "--1-" in r]
    assert len(warm) == 3  # warm-up requests are sent, with their own salt (loop -1)
    assert engine.prepared == [16]  # once, before the replay, for the admission limit's requests
    assert result.summary["outside_trace"] == {"warmup_requests": 3, "vocab_probe_requests": 0}
    run_dir = result.run_dir
    for name in ("meta.json", "verdict.json", "summary.json"):
        assert (run_dir / name).is_file()
    samples = list(iter_samples(run_dir / "spool"))
    by: dict[str, list[Sample]] = {}
    for s in samples:
        by.setdefault(s.measurement, []).append(s)
        assert s.tags["run_id"] == result.run_id and s.tags["host"]
    requests = by["requests"]
    assert len(requests) == result.summary["replay"]["scheduled"] > 0  # warm-up is not recorded
    kinds = [s.tags["kind"] for s in by["events"]]
    assert kinds[:3] == ["run_start", "engine_start", "warmup"] and kinds[-1] == "run_end"
    # Engine telemetry carries the config tag and excludes the steps from before warm-up ended.
    gen = sum(int(s.fields["generation_tokens"]) for s in by["engine"])
    assert gen == result.summary["replay"]["output_tokens"]
    assert all(s.tags["config"] == "cfg1" for s in by["engine"])
    assert sum(int(s.fields["drafts"]) for s in by["spec_decode"]) > 0
    assert "host" in by and "collector" in by and len(by["run"]) == 1
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["verdict"] == result.verdict.word == "PASS"
    assert result.summary["points"] == {m: len(v) for m, v in by.items()}


async def test_sigterm_stops_the_replay_and_still_judges(tmp_path: Path) -> None:
    def factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
        return StubEngine(collector)

    soak = Soak(config(tmp_path, **{"run.duration": "60s"}), engine_factory=factory)
    loop = asyncio.get_running_loop()

    async def stop_once_replaying() -> None:
        # Once the soak's own requests complete, not at a fixed time: a slow host's start (a full
        # collection over the test process's heap) must not end the run before its replay began.
        while (rep := soak.live.soak_replayer()) is None or rep.stats.completed < 3:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # (polled: the replayer has no event to wait on)
        os.kill(os.getpid(), signal.SIGTERM)

    stopper = asyncio.create_task(stop_once_replaying())
    result = await asyncio.wait_for(soak.run(), 30)
    await stopper
    assert soak.interrupted
    # A stop is not a failure: judged on the work done, the duration line informational; exit 4.
    assert result.verdict.word == "PASS" and result.verdict.exit_code == 4
    (duration,) = [c for c in result.verdict.criteria if c.informational]
    assert duration.name == "duration_completed_s" and "by SIGTERM" in duration.detail
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["stopped_by"] == "SIGTERM"
    assert summary["replay_began"] is True and summary["exit_code"] == 4
    verdict = json.loads((result.run_dir / "verdict.json").read_text())
    assert verdict["exit_code"] == 4 and verdict["stopped_by"] == "SIGTERM" and verdict["interruptions"] == []
    loop.remove_signal_handler(signal.SIGTERM)


def test_sample_writer_keeps_times_unique_per_series(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20, 1.0)
    w = SampleWriter(spool, {"run_id": "r"}, wall_ns=lambda: 5)
    w([Sample("m", {"a": 1}, 10), Sample("m", {"a": 2}, 10), Sample("m", {"a": 3}, 9)])
    w([Sample("m", {"a": 4}, 10, tags={"x": "1"})])  # another series may share the time
    w.event("k", "hello", n=1)
    spool.close()
    got = [(s.measurement, s.time_ns) for s in iter_samples(tmp_path)]
    assert got == [("m", 10), ("m", 11), ("m", 12), ("m", 10), ("events", 5)]
    assert w.counts == {"m": 4, "events": 1}


def test_bad_trace_fails_before_anything_is_written(tmp_path: Path) -> None:
    from soakd.errors import TraceError

    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 0, "output_length": 1}\n')
    with pytest.raises(TraceError):
        Soak(config(tmp_path, **{"trace.format": "auto", "trace.path": str(bad)}))
    assert not (tmp_path / "runs").exists()


class FailingStart(StubEngine):
    async def start(self) -> None:
        from soakd.errors import EngineError

        raise EngineError("no GPU memory left")


class DyingEngine(StubEngine):
    """Serves a few requests, then its engine core 'dies': every request raises EngineError."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        from soakd.errors import EngineError

        if len(self.seen) >= 10:
            raise EngineError("vLLM engine core died: test")
        async for n in super().generate(request):
            yield n


async def test_engine_that_cannot_start_still_leaves_a_verdict(tmp_path: Path) -> None:
    soak = Soak(config(tmp_path), engine_factory=lambda c, m, col: FailingStart(col))
    result = await soak.run()
    assert result.error.startswith("engine did not start: no GPU memory left")
    assert result.verdict.word == "FAIL"
    for name in ("verdict.json", "summary.json"):
        assert (result.run_dir / name).is_file()
    kinds = [s.tags["kind"] for s in iter_samples(result.run_dir / "spool", "events")]
    assert "engine_error" in kinds and kinds[-1] == "run_end"


async def test_engine_death_ends_the_replay_early_with_every_request_recorded(tmp_path: Path) -> None:
    soak = Soak(
        config(tmp_path, **{"run.duration": "30s", "engine.restart.enabled": False}),
        engine_factory=lambda c, m, col: DyingEngine(col),
    )
    result = await asyncio.wait_for(soak.run(), 20)
    assert result.error.startswith("engine: vLLM engine core died")
    assert result.summary["ran_s"] < 10
    requests = list(iter_samples(result.run_dir / "spool", "requests"))
    replay = result.summary["replay"]
    assert len(requests) == replay["scheduled"] == replay["completed"] + replay["failed"] + replay["shed"]
    assert result.verdict.word == "FAIL"


async def test_an_abort_criterion_ends_the_run_early_and_fails_it(tmp_path: Path) -> None:
    over = {
        "run.duration": "60s",
        "trace.synthetic.duration": "60s",
        "criteria.abort_on": ["p99(tpot_ms) < 0.0001"],
        "criteria.abort_grace": "1s",
    }
    soak = Soak(config(tmp_path, **over), engine_factory=lambda c, m, col: StubEngine(col))
    result = await asyncio.wait_for(soak.run(), 30)
    assert result.error.startswith("criterion failed: p99(tpot_ms) < 0.0001 (measured ")
    assert 1 <= result.summary["ran_s"] < 15
    assert result.verdict.word == "FAIL"
    (abort,) = [c for c in result.verdict.criteria if c.expr]
    assert not abort.passed and abort.value is not None and abort.value > 0.0001
    events = [
        s for s in iter_samples(result.run_dir / "spool", "events") if s.tags["kind"] == "criteria_abort"
    ]
    assert len(events) == 1 and float(events[0].fields["replayed_s"]) >= 1


async def test_stop_during_warm_up_skips_the_replay(tmp_path: Path) -> None:
    warming = asyncio.Event()

    class SlowWarm(StubEngine):
        async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
            warming.set()
            await asyncio.Event().wait()  # a warm-up request that would never end
            async for n in super().generate(request):
                yield n

    soak = Soak(config(tmp_path, **{"run.duration": "30s"}), engine_factory=lambda c, m, col: SlowWarm(col))
    task = asyncio.create_task(soak.run())
    await asyncio.wait_for(warming.wait(), 60)  # a hang guard only
    soak._on_signal("SIGTERM")  # once the warm-up is under way, not at a fixed time
    result = await asyncio.wait_for(task, 60)
    assert soak.interrupted and result.summary["replay"]["scheduled"] == 0
    assert result.verdict.word == "FAIL"


async def test_a_stop_during_engine_start_cuts_it_short(tmp_path: Path) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    class SlowStart(StubEngine):
        async def start(self) -> None:
            started.set()
            try:
                await asyncio.Event().wait()  # an engine that would take for ever to load
            except asyncio.CancelledError:
                cancelled.set()
                raise

    soak = Soak(config(tmp_path, **{"run.duration": "30s"}), engine_factory=lambda c, m, col: SlowStart(col))
    task = asyncio.create_task(soak.run())
    await asyncio.wait_for(started.wait(), 20)
    soak._on_signal("SIGINT")
    early = json.loads((soak.run_dir / "verdict.json").read_text())
    assert early["verdict"] == "FAIL" and early["replay_began"] is False  # left at once, as well
    result = await asyncio.wait_for(task, 20)  # not waiting for the start: it is cancelled
    assert cancelled.is_set()
    assert result.summary["replay"]["scheduled"] == 0 and result.verdict.word == "FAIL"
    verdict = json.loads((result.run_dir / "verdict.json").read_text())
    assert (
        verdict["replay_began"] is False and verdict["stopped_by"] == "SIGINT" and verdict["exit_code"] == 4
    )
    assert "before the replay began" in result.verdict.lines()[1]


async def test_a_stop_before_the_engine_start_starts_no_engine(tmp_path: Path) -> None:
    engines: list[StubEngine] = []

    def factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
        engines.append(StubEngine(collector))
        return engines[-1]

    soak = Soak(config(tmp_path), engine_factory=factory)
    soak._on_signal("SIGHUP")  # the terminal closed while the run was being set up
    result = await asyncio.wait_for(soak.run(), 20)
    assert not any(e.started for e in engines)
    assert result.stopped_by == "SIGHUP" and result.verdict.exit_code == 4
    assert result.verdict.ending.replay_began is False and result.verdict.word == "FAIL"


async def test_a_verdict_the_disk_refuses_is_claimed_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from soakd.judge import verdict

    def refuse(path: Path, doc: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(verdict, "write_json_atomic", refuse)  # verdict.json's one writer writes with it
    soak = Soak(config(tmp_path), engine_factory=lambda c, m, col: StubEngine(col))
    result = await asyncio.wait_for(soak.run(), 30)
    assert result.verdict.word == "PASS"  # what it would have been
    assert "No space left on device" in result.verdict_error
    assert not (result.run_dir / "verdict.json").exists()
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["verdict"] == "NOT WRITTEN" and summary["exit_code"] == 3
    (point,) = iter_samples(result.run_dir / "spool", "run")
    assert point.fields["passed"] == 0


def test_the_openai_kind_needs_a_url_and_no_local_model(tmp_path: Path) -> None:
    from soakd.engine.openai_http import OpenAIEngine
    from soakd.errors import ConfigError
    from soakd.wiring import make_engine, resolve_model

    cfg = load(None, {"engine.kind": "openai", "engine.model": "no/such/dir"})
    with pytest.raises(ConfigError) as info:
        resolve_model(cfg)
    assert str(info.value) == '<defaults>: engine.url: engine.kind = "openai" needs the server\'s base URL'
    cfg = load(
        None, {"engine.kind": "openai", "engine.url": "http://127.0.0.1:9", "engine.served_model": "m"}
    )
    assert resolve_model(cfg) == "m"
    assert isinstance(make_engine(cfg, "m", EngineCollector(active=False)), OpenAIEngine)


async def test_an_engine_that_dies_is_restarted_counted_and_the_run_completes(tmp_path: Path) -> None:
    engines: list[StubEngine] = []

    def factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
        # The first engine dies after ten requests; its replacement lives.
        engines.append(DyingEngine(collector) if not engines else StubEngine(collector))
        return engines[-1]

    soak = Soak(config(tmp_path, **{"run.duration": "4s"}), engine_factory=factory)
    result = await asyncio.wait_for(soak.run(), 30)
    assert not result.error
    assert len(engines) == 2 and engines[0].stopped and engines[1].stopped
    events = list(iter_samples(result.run_dir / "spool", "events"))
    restarts = [e for e in events if e.tags["kind"] == "engine_restart"]
    assert len(restarts) == 1 and float(restarts[0].fields["downtime_s"]) >= 0
    replay = result.summary["replay"]
    requests = list(iter_samples(result.run_dir / "spool", "requests"))
    ids = [(r.fields["loop"], r.fields["index"]) for r in requests]
    assert len(requests) == replay["scheduled"] == replay["completed"] + replay["failed"] + replay["shed"]
    assert len(ids) == len(set(ids))  # nobody counted twice
    lost = [r for r in requests if str(r.fields.get("error", "")).startswith("engine died")]
    lifecycle = result.summary["engine_telemetry"]["lifecycle"]
    assert lifecycle["restarts"] == 1 and lifecycle["lost"] == len(lost) == replay["failed"]
    assert replay["completed"] > 10  # the replay went on after the restart


async def test_a_scheduled_rebuild_swaps_the_engine_with_exact_accounting(tmp_path: Path) -> None:
    configs: list[Config] = []

    def factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
        configs.append(cfg)
        return StubEngine(collector)

    over = {
        "run.duration": "4s",
        "engine.changes": [
            {
                "at": "1.5s",
                "mode": "abort",
                "reason": "smaller batch",
                "max_num_seqs": 4,
                "cudagraph_capture_sizes": [4, 1, 2],
            }
        ],
    }
    soak = Soak(config(tmp_path, **over), engine_factory=factory)
    result = await asyncio.wait_for(soak.run(), 30)
    assert not result.error
    assert [c.engine.max_num_seqs for c in configs] == [16, 4]
    assert configs[1].engine.extra_args["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4]}
    events = list(iter_samples(result.run_dir / "spool", "events"))
    rebuild = [e for e in events if e.tags["kind"] == "engine_rebuild"]
    assert len(rebuild) == 1 and rebuild[0].fields["ok"] == 1
    requests = list(iter_samples(result.run_dir / "spool", "requests"))
    replay = result.summary["replay"]
    assert len(requests) == replay["scheduled"] == replay["completed"] + replay["failed"] + replay["shed"]
    aborted = [r for r in requests if str(r.fields.get("error", "")).startswith("aborted: engine rebuild")]
    assert len(aborted) == rebuild[0].fields["aborted"] == replay["failed"]
    lifecycle = result.summary["engine_telemetry"]["lifecycle"]
    assert lifecycle["rebuilds"] == 1 and len(lifecycle["configs"]) == 2


BURN = Path(__file__).parents[2] / "data" / "h200" / "nvml_soak_then_matmul_burn.jsonl.gz"


def recorded_gpu(recording: Path) -> dict[str, object]:
    """A 6 s soak over an H200 recording (idle, a soak, 25 s of matmul at the 700 W cap) played 40x."""
    return {
        "run.duration": "6s",
        "telemetry.collectors": ["host", "engine", "gpu"],
        "telemetry.gpu_recording": str(recording),
        "telemetry.gpu_recording_speed": 40.0,
        "telemetry.gpu_fast_interval": "25ms",
        "telemetry.gpu_slow_interval": "250ms",
        # The cap lasts 0.63 s at 40x (recorded 173.1-198.4 s), from 4.33 s into the replay; points
        # every 0.25 s put at least one wholly inside it whatever their phase to the replay's start
        # (at 0.5 s a third of the phases left none at 80 %).
        "telemetry.interval": "0.25s",
    }


async def test_a_soak_over_recorded_h200_telemetry_detects_the_power_cap(tmp_path: Path) -> None:
    """The GPU is a real H200 recording (idle, a soak, 25 s of matmul at the 700 W cap) played 40x
    faster: gpu points, the throttle state per interval and its transitions as events."""
    over = {
        **recorded_gpu(BURN),
        "criteria.checks": ["throttle_time_pct < 5", "throttle_episodes == 0", "errors == 0"],
    }
    soak = Soak(config(tmp_path, **over), engine_factory=lambda c, m, col: StubEngine(col))
    result = await asyncio.wait_for(soak.run(), 60)
    by: dict[str, list[Sample]] = {}
    for s in iter_samples(result.run_dir / "spool"):
        by.setdefault(s.measurement, []).append(s)
    gpu = by["gpu"]
    assert gpu and all(s.tags["gpu"] == "0" for s in gpu)
    capped = [s for s in gpu if float(s.fields.get("reason_sw_power_cap_share", 0)) == 1.0]
    assert capped and all(float(s.fields["sm_clock_ratio"]) < 0.8 for s in capped)  # 1530 of 1980 MHz
    # The GPU's transitions (a CI host's own CPUs may have theirs, with scope=host).
    kinds = [e.tags["kind"] for e in by["events"] if "gpu" in e.fields]
    assert kinds.count("throttle_enter") == 1
    enter = next(e for e in by["events"] if e.tags["kind"] == "throttle_enter")
    assert "sw_power_cap" in str(enter.fields["reasons"])
    states = [int(s.fields["state"]) for s in by["throttle"] if "gpu" in s.tags]
    assert 1 in states and states[0] == 0
    power_s = sum(float(s.fields.get("throttle_power_s", 0)) for s in gpu)
    assert 20 < power_s <= 25.35  # the recorded field-74 growth, as far as the run got through it
    assert result.summary["gpu_throttle"]["0"]["enters"] == 1
    # The verdict's checks see the episode through the fold fed as points were written.
    checks = {c.expr: c for c in result.verdict.criteria if c.expr}
    assert not checks["throttle_time_pct < 5"].passed and checks["throttle_time_pct < 5"].value is not None
    assert checks["throttle_time_pct < 5"].value > 5
    assert checks["throttle_episodes == 0"].value == 1 and checks["errors == 0"].passed
    written = json.loads((result.run_dir / "verdict.json").read_text())
    assert written["metrics"]["throttle_time_pct"] == checks["throttle_time_pct < 5"].value
    # meta.json names the GPU; the sign-off report of the run shades the episode and says what ran.
    meta = json.loads((result.run_dir / "meta.json").read_text())
    assert meta["gpu"]["driver"] == "580.159.04" and meta["gpu"]["source"] == "recording"
    assert meta["gpu"]["devices"][0]["name"] == "NVIDIA H200"
    from soakd.cli import main

    assert main(["report", str(result.run_dir), "--no-html"]) in (0, 1)
    report = json.loads((result.run_dir / "report.json").read_text())
    (episode,) = report["data"]["episodes"]
    assert episode["scope"] == "GPU 0" and "sw_power_cap" in episode["reasons"]
    gpu_env = dict(next(g["items"] for g in report["environment"] if g["group"] == "GPU"))
    assert gpu_env["GPU 0"] == "NVIDIA H200, 140.4 GiB, SM clock up to 1980 MHz, power limit 700 W"
    assert report["data"]["panels"]["sm_clock"]["series"]


async def test_decode_throughput_as_a_share_of_the_ceiling(tmp_path: Path) -> None:
    """A model folder with real safetensors headers and a configured bandwidth: every busy engine point
    has the decode-bandwidth fields, and the summary's time-weighted share is the points' own arithmetic."""
    model = tmp_path / "m"
    model.mkdir()
    header = json.dumps(
        {"w": {"dtype": "BF16", "shape": [1000, 500], "data_offsets": [0, 1_000_000]}}
    ).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (model / "config.json").write_text(
        json.dumps(
            {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "torch_dtype": "bfloat16"}
        )
    )
    cfg = config(tmp_path, **{"engine.model": str(model), "telemetry.ceiling_bandwidth_gbs": 0.001})
    result = await Soak(cfg, engine_factory=lambda c, m, col: StubEngine(col)).run()
    ceiling = result.summary["decode_ceiling"]
    assert ceiling["available"] and ceiling["bandwidth_source"] == "configured"
    assert ceiling["weight_bytes"] == 1_000_000 and ceiling["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 2
    busy = [
        s
        for s in iter_samples(result.run_dir / "spool")
        if s.measurement == "engine" and "decode_tps" in s.fields
    ]
    assert busy
    busy_s = sum(float(s.fields["interval_s"]) for s in busy)
    pct_s = sum(float(s.fields["decode_bw_pct"]) * float(s.fields["interval_s"]) for s in busy)
    assert ceiling["bw_pct"] == pytest.approx(pct_s / busy_s)
    steps = sum(int(s.fields["decode_steps"]) for s in busy)
    assert ceiling["decode_steps"] == steps and 0 < steps <= sum(int(s.fields["steps"]) for s in busy)
    assert ceiling["context_tokens"] > 0  # requests finished, so the ceiling counts their KV reads


async def test_no_ceiling_without_a_bandwidth_says_why(tmp_path: Path) -> None:
    result = await Soak(config(tmp_path), engine_factory=lambda c, m, col: StubEngine(col)).run()
    reason = result.summary["decode_ceiling"]["reason"]
    assert result.summary["decode_ceiling"]["available"] is False and "unreadable" in reason


async def test_snapshot_mid_run(tmp_path: Path) -> None:
    soak = Soak(
        config(tmp_path, **{"run.snapshot_interval": "1s"}), engine_factory=lambda c, m, col: StubEngine(col)
    )
    result = await soak.run()
    snap = json.loads((result.run_dir / "snapshot.json").read_text())
    # Taken during the run: no later than the replay time the run reached at its end (its checkpoint).
    final = read_checkpoint(result.run_dir)
    assert final is not None and snap["run_id"] == result.run_id and 0 < snap["elapsed_s"] <= final.elapsed_s
    assert 0 < snap["replay"]["scheduled"] <= result.summary["replay"]["scheduled"]
    assert snap["control"]["ceiling"] == 16 and snap["points"]["requests"] > 0


def test_event_numbers_are_floats_whatever_their_python_type(tmp_path: Path) -> None:
    # InfluxDB refuses a batch whose field type differs from the shard's: one kind's `ok` was a bool,
    # another's an integer.
    spool = Spool(tmp_path, 1 << 20, 1.0)
    w = SampleWriter(spool, {"run_id": "r"}, wall_ns=lambda: 5)
    w.event("recapture", "m", ok=True, sizes="1,2")
    w.event("engine_rebuild", "m", ok=1, down_s=0)
    spool.close()
    lines = [line for seg in sorted(tmp_path.glob("seg-*.lp")) for line in seg.read_text().splitlines()]
    assert all("ok=1i" not in line and "ok=true" not in line for line in lines)
    assert [s.fields["ok"] for s in iter_samples(tmp_path)] == [1.0, 1.0]
    assert "down_s=0i" not in lines[1] and 'sizes="1,2"' in lines[0]


def _two_gpus_one_capped(src: Path, dst: Path) -> Path:
    """The H200 recording as a tensor-parallel pair: GPU 1 as recorded (the matmul at the power cap),
    GPU 0 never capped (the cap bit cleared, its clock held at the last busy uncapped sample's, no
    throttle time counted)."""
    with gzip.open(src, "rt") as f:
        header = json.loads(f.readline())
        rows = [json.loads(line) for line in f]
    g0 = header["header"]["gpus"][0]
    header["header"]["gpus"] = [{**g0, "uuid": "GPU-0000-calm"}, {**g0, "uuid": "GPU-1111-capped"}]
    calm = 1980
    with gzip.open(dst, "wt") as f:
        f.write(json.dumps(header) + "\n")
        for row in rows:
            g = row["gpus"][0]
            other = dict(g)
            if isinstance(g.get("reasons"), int) and g["reasons"] & 0x4:
                other["reasons"], other["sm_mhz"] = g["reasons"] & ~0x4, calm
            elif g.get("sm_mhz") is not None and not (g.get("reasons") or 0) & 0x1:
                calm = g["sm_mhz"]  # a busy uncapped clock (an idle one reads 345 MHz)
            if "fields" in g:
                other["fields"] = {k: 0 for k in g["fields"]}
            row["gpus"] = [other, g]
            f.write(json.dumps(row) + "\n")
    return dst


async def test_a_tensor_parallel_soak_names_the_straggler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two GPUs of one tensor-parallel engine (a recording made from the H200's: the cap on GPU 1 only),
    and a third run with the engine on GPU 0 alone: every GPU recorded with its UUID, the engine's judged,
    the straggler named in the spread series, the summary and the printout; the other tenant's cap is not
    this engine's."""
    recording = _two_gpus_one_capped(BURN, tmp_path / "two.jsonl.gz")
    over = {**recorded_gpu(recording), "engine.tensor_parallel_size": 2}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    soak = Soak(config(tmp_path, **over), engine_factory=lambda c, m, col: StubEngine(col))
    result = await asyncio.wait_for(soak.run(), 60)
    by: dict[str, list[Sample]] = {}
    for s in iter_samples(result.run_dir / "spool"):
        by.setdefault(s.measurement, []).append(s)
    assert {(s.tags["gpu"], s.tags["uuid"]) for s in by["gpu"]} == {
        ("0", "GPU-0000-calm"),
        ("1", "GPU-1111-capped"),
    }
    enters = [e for e in by["events"] if e.tags["kind"] == "throttle_enter"]
    assert [e.fields["gpu"] for e in enters] == [1]
    capped = [s for s in by["gpu_spread"] if s.fields["straggler"] == 1]
    assert capped and max(float(s.fields["sm_spread"]) for s in capped) > 0.15  # 1530 of 1980 MHz
    assert all(s.fields["straggler"] in (1, -1) for s in by["gpu_spread"])
    spread = result.summary["gpu_spread"]["0"]
    assert spread["gpus"] == [0, 1] and spread["straggler"] == 1
    meta = json.loads((result.run_dir / "meta.json").read_text())
    engine = meta["gpu"]["engine"]
    assert engine["gpus"] == [0, 1] and engine["replicas"] == [[0, 1]] and engine["known"] is True
    from soakd.cli.common import hardware_lines

    (line,) = [x for x in hardware_lines(result.summary) if "straggler" in x]
    assert line.startswith("  GPUs 0, 1 (replica 0): clock spread p50 ") and "straggler GPU 1 in " in line
    # The sign-off report says which GPUs were the engine's and names the straggler.
    from soakd.cli import main

    assert main(["report", str(result.run_dir), "--no-html"]) in (0, 1)
    report = json.loads((result.run_dir / "report.json").read_text())
    rows = dict(next(g["items"] for g in report["environment"] if g["group"] == "GPU"))
    assert rows["the engine's GPUs"].startswith("0, 1: 2 per replica, 1 replica(s)")
    assert rows["GPU spread"] == line.strip() and {"GPU 0", "GPU 1"} <= set(rows)

    # The engine on GPU 0 alone: GPU 1's cap is recorded, not judged.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0000")
    alone = config(tmp_path, **{**over, "engine.tensor_parallel_size": 1})
    result = await asyncio.wait_for(Soak(alone, engine_factory=lambda c, m, col: StubEngine(col)).run(), 60)
    samples = list(iter_samples(result.run_dir / "spool"))
    assert {s.tags["gpu"] for s in samples if s.measurement == "gpu"} == {"0", "1"}
    assert not [s for s in samples if s.measurement == "events" and s.tags["kind"] == "throttle_enter"]
    assert {s.tags["gpu"] for s in samples if s.measurement == "throttle" and "gpu" in s.tags} == {"0"}
    assert result.summary["gpu_spread"] is None and list(result.summary["gpu_throttle"]) == ["0"]


def test_a_tensor_parallel_engine_the_gpus_cannot_hold_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording = _two_gpus_one_capped(BURN, tmp_path / "two.jsonl.gz")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cfg = config(tmp_path, **{"telemetry.gpu_recording": str(recording), "engine.tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"needs 2 GPUs; CUDA_VISIBLE_DEVICES=1 .*leaves 1 of 2 \(1\)"):
        Soak(cfg, engine_factory=lambda c, m, col: StubEngine(col))
    assert not (tmp_path / "runs").exists()
