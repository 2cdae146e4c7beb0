"""Engine telemetry and lifecycle against real vLLM CPU engines, through the soakd CLI as a user runs it.

- server mode: soakd launches the api_server, the stat-logger plugin (loaded by the real server from
  soakd's entry point) sends every step over the socket, /metrics is scraped, the worker extension
  answers over /collective_rpc; ngram speculation gives per-position and per-output-position acceptance.
- attach mode: a server the test started, HTTP and /metrics only; the summary names what is missing.
- a scheduled rebuild mid-run with other capture sizes and max_num_seqs: every request counted once.
- the engine's worker killed mid-run: detected, restarted, counted, the run completes.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
from servers import Server, finish_soakd, run_soakd, start_soakd

from soakd.metric import Sample
from soakd.sinks.spool import iter_samples

pytestmark = pytest.mark.integration


# A swap stalls requests for the engine's start time (tens of seconds on CPU): the latency criteria
# would fail the verdict, and these runs test the lifecycle, not the engine's latency.
LIFECYCLE_CRITERIA = """
[criteria]
ttft_p99_ms = false
tpot_p99_ms = false
max_error_rate = false
"""


def write_config(path: Path, model: Path, engine: str, extra: str = "", duration: str = "30s") -> Path:
    path.write_text(
        f"""
[run]
duration = "{duration}"
output_dir = "{path.parent / "runs"}"
[trace]
format = "synthetic"
[trace.arrivals]
rate_rps = 2.0
[trace.synthetic]
duration = "20s"
input_tokens_mean = 200
output_tokens_mean = 48
output_tokens_max = 96
session_share = 0.5
turns_mean = 3.0
[engine]
model = "{model}"
max_model_len = 1024
max_num_seqs = 8
{engine}
[replay]
warmup_requests = 2
[telemetry]
interval = "1s"
slow_interval = "3s"
collectors = ["host", "engine", "allocator", "metrics"]
[telemetry.spec_drift]
baseline = "5s"
window = "5s"
min_draft_tokens = 10
{extra}
""",
        encoding="utf-8",
    )
    return path


def run_ok(config: Path) -> tuple[dict[str, Any], dict[str, list[Sample]]]:
    code, out, err = run_soakd(config, config.parent, timeout_s=900)
    assert out, err[-3000:]
    doc = json.loads(out)
    assert code == 0, (doc["verdict_detail"]["criteria"], doc["error"], err[-2000:])
    by: dict[str, list[Sample]] = {}
    for s in iter_samples(Path(doc["run_dir"]) / "spool"):
        by.setdefault(s.measurement, []).append(s)
    return doc, by


def assert_exact_accounting(doc: dict[str, Any], by: dict[str, list[Sample]]) -> None:
    replay = doc["replay"]
    requests = by["requests"]
    assert len(requests) == replay["scheduled"] == replay["completed"] + replay["failed"] + replay["shed"]
    keys = Counter((r.fields["loop"], r.fields["index"]) for r in requests)
    assert max(keys.values()) == 1, "a request was counted twice"


def test_server_mode_with_plugin_metrics_and_allocator(tmp_path: Path, tiny_model: Path) -> None:
    cfg = write_config(tmp_path / "server.toml", tiny_model, 'kind = "vllm-server"')
    doc, by = run_ok(cfg)
    tele = doc["engine_telemetry"]
    assert {"per_step", "spec_per_pos", "spec_per_request", "allocator", "metrics"} <= set(tele["signals"])
    (stat_logger,) = [e["stat_logger"] for e in tele["engines"]]
    assert stat_logger["steps"] > 0 and stat_logger["lost"] == 0 and stat_logger["malformed"] == 0
    assert stat_logger["record_us_mean"] > 0  # the plugin's own cost per step, measured in the server
    # Every step the plugin sent reached the engine collector.
    assert sum(int(s.fields["steps"]) for s in by["engine"]) == doc["engine_steps"] > 0
    # ngram speculation: per-position rates are real rates.
    spec = by["spec_decode"]
    rates = [float(s.fields[k]) for s in spec for k in s.fields if k.startswith("acceptance_rate_pos")]
    assert rates and all(0.0 <= r <= 1.0 for r in rates) and any(r > 0 for r in rates)
    assert any("acceptance_drift" in s.fields for s in spec)  # drift against the first window
    profile = tele["spec_decode"]["profile"]
    assert profile["requests"] > 0 and profile["by_output_position"][0]["from"] == 0
    assert 0 < profile["by_output_position"][0]["rate"] <= 1
    assert any(r["from"] > 0 for r in profile["by_turn"])  # later turns of sessions
    assert any("spec_acceptance_rate" in r.fields for r in by["requests"])
    # The server's own counters, as a cross-check next to the per-step stats.
    assert sum(int(s.fields.get("request_success", 0)) for s in by["vllm_metrics"]) > 0
    # The worker extension over /collective_rpc: the CPU worker's RSS, clearly labelled.
    alloc = by["allocator"]
    assert alloc and all(s.fields["source"] == "worker_rss" for s in alloc)
    assert all(int(s.fields["rss_bytes"]) > 0 for s in alloc)
    # No CUDA graphs on the CPU build: said outright, no graph fields written.
    assert tele["cudagraphs"]["applicable"] is False
    assert not any(k.startswith("cg_") for s in by["engine"] for k in s.fields)
    log = Path(doc["run_dir"]) / "engine-server.log"
    assert "# soakd: " in log.read_text(encoding="utf-8", errors="replace")
    assert_exact_accounting(doc, by)


def test_attach_mode_names_the_signals_it_cannot_see(
    tmp_path: Path, tiny_model: Path, vllm_server: Server
) -> None:
    cfg = write_config(
        tmp_path / "attach.toml", tiny_model, f'kind = "openai"\nurl = "{vllm_server.url}"', duration="12s"
    )
    doc, by = run_ok(cfg)
    tele = doc["engine_telemetry"]
    assert tele["signals"] == ["metrics"]
    missing = " ".join(tele["missing"])
    assert "per-step engine stats" in missing and "CUDA-graph" in missing and "allocator" in missing
    # The session server runs without speculation: no spec series, and the summary says so.
    assert tele["spec_decode"]["enabled"] is False and "spec_decode" not in by
    assert any("speculative" in m for m in tele["metrics_missing"])
    engine = by["engine"]
    assert all(s.fields["source"] == "metrics" for s in engine)
    assert sum(int(s.fields["generation_tokens"]) for s in engine) > 0
    assert "allocator" not in by and "vllm_metrics" not in by
    assert_exact_accounting(doc, by)


def test_rebuild_mid_run_with_other_capture_sizes_and_batch(tmp_path: Path, tiny_model: Path) -> None:
    change = (
        LIFECYCLE_CRITERIA
        + """
[[engine.changes]]
at = "10s"
mode = "drain"
reason = "smaller batch"
max_num_seqs = 4
cudagraph_capture_sizes = [1, 2, 4]
"""
    )
    cfg = write_config(tmp_path / "rebuild.toml", tiny_model, change, duration="25s")
    doc, by = run_ok(cfg)
    events = [e for e in by["events"] if e.tags["kind"] == "engine_rebuild"]
    assert len(events) == 1 and events[0].fields["ok"] == 1
    ev = events[0].fields
    assert ev["config_from"] != ev["config_to"]
    lifecycle = doc["engine_telemetry"]["lifecycle"]
    assert lifecycle["rebuilds"] == 1 and len(lifecycle["configs"]) == 2
    assert {s.tags["config"] for s in by["engine"]} == {ev["config_from"], ev["config_to"]}
    meta = json.loads((Path(doc["run_dir"]) / "meta.json").read_text())
    assert [e["details"]["max_num_seqs"] for e in meta["engines"]] == ["8", "4"]
    assert_exact_accounting(doc, by)
    failed = [r for r in by["requests"] if r.tags["status"] == "error"]
    assert len(failed) == ev["aborted"]  # drained requests finished; only aborted ones failed
    print(f"rebuild downtime on CPU: {float(ev['downtime_s']):.1f} s")


def _worker(root: psutil.Process) -> psutil.Process | None:
    """The vLLM CPU worker among soakd's descendants (the engine core's child)."""
    for p in root.children(recursive=True):
        try:
            text = " ".join([p.name(), *p.cmdline()])
        except psutil.Error:
            continue
        if "Worker" in text or "worker" in p.name():
            return p
    return None


def test_killing_the_worker_is_detected_restarted_and_counted(tmp_path: Path, tiny_model: Path) -> None:
    # Speculation off here: this run also shows that no spec series is written and the summary says so.
    cfg = write_config(
        tmp_path / "kill.toml",
        tiny_model,
        "[engine.speculative]\nenabled = false",
        extra=LIFECYCLE_CRITERIA,
        duration="40s",
    )
    proc = start_soakd(cfg, tmp_path)
    killed = None
    try:
        root = psutil.Process(proc.pid)
        runs = tmp_path / "runs"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            spool = list(runs.glob("*/spool/*.lp"))
            replaying = spool and any(b"\nrequests," in p.read_bytes() for p in spool)
            worker = _worker(root) if replaying else None
            if worker is not None:
                time.sleep(3)  # a few seconds of traffic on the first engine
                worker.send_signal(signal.SIGKILL)
                killed = worker.pid
                break
            time.sleep(0.5)  # poll for the replay to begin
    finally:
        code, out, err = finish_soakd(proc, timeout_s=600 if killed else 1)
    assert killed is not None, "the replay never started"
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    by: dict[str, list[Sample]] = {}
    for s in iter_samples(Path(doc["run_dir"]) / "spool"):
        by.setdefault(s.measurement, []).append(s)
    restarts = [e for e in by["events"] if e.tags["kind"] == "engine_restart"]
    assert len(restarts) == 1
    lifecycle = doc["engine_telemetry"]["lifecycle"]
    assert lifecycle["restarts"] == 1 and len(lifecycle["configs"]) == 2
    assert_exact_accounting(doc, by)
    lost = [r for r in by["requests"] if str(r.fields.get("error", "")).startswith("engine died")]
    assert len(lost) == lifecycle["lost"]
    assert doc["replay"]["completed"] > 0
    # Speculation off: no acceptance series, and the summary says so.
    assert "spec_decode" not in by and "spec_profile" not in by
    assert doc["engine_telemetry"]["spec_decode"]["enabled"] is False
    print(f"restart downtime on CPU: {float(restarts[0].fields['downtime_s']):.1f} s")
