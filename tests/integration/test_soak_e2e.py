"""One real soak through a night's faults: a Mooncake trace through a real vLLM CPU engine with ngram
speculation, telemetry through the spool into a real InfluxDB 1.6.7 that is killed mid-run and started
again, then the daemon itself SIGKILLed (with its engine, as systemd kills a cgroup) and started again
with --resume, as a user runs it (`python -m soakd run --config ... --json`).

At the end: the same run id; every request the trace schedules is recorded exactly once or counted as
lost in flight at the kill; InfluxDB holds exactly the spool's points, per measurement (the outage was
backfilled, nothing shipped twice); speculative decoding and prefix caching really ran; the InfluxDB
secret appears in no output, file, command line or engine environment; run files are 0600 in 0700
directories; `soakd report` re-judges the spool to the same verdict. About three and a half minutes
(two engine starts of ~40 s).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest import InfluxStarter
from servers import Server, finish_soakd, start_soakd

from soakd.metric import parse_line
from soakd.resume import read_journal
from soakd.rundir import ENGINE_OUTPUT_FILE, JOURNAL_FILE
from soakd.sinks.spool import iter_samples

pytestmark = pytest.mark.integration

DURATION_S = 45.0
TRACE_SPAN_MS = 29_000
TRACE_ROWS = 40
DB = "soak_e2e"


def write_mooncake(path: Path) -> list[float]:
    """A Mooncake trace: 40 requests over 29 s, 512-token blocks, half sharing a prefix block."""
    rows = []
    times = []
    for i in range(TRACE_ROWS):
        ts = round(i * TRACE_SPAN_MS / (TRACE_ROWS - 1))
        inp = 100 + (i * 37) % 600
        blocks = math.ceil(inp / 512)
        hash_ids = (
            [7] + [1000 + i * 4 + b for b in range(blocks - 1)]
            if i % 2
            else [2000 + i * 4 + b for b in range(blocks)]
        )
        rows.append(
            {"timestamp": ts, "input_length": inp, "output_length": 16 + (i * 13) % 48, "hash_ids": hash_ids}
        )
        times.append(ts / 1000)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return times


def expected_requests(times: list[float], duration: float) -> int:
    """Requests due within the duration when the trace loops, each pass shifted by span + mean gap."""
    span = times[-1] - times[0]
    period = span + span / (len(times) - 1)
    count = 0
    k = 0
    while k * period < duration:
        count += sum(1 for t in times if t + k * period < duration)
        k += 1
    return count


def influxql(server: Server, query: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{server.url}/query", params={"db": DB, "q": query, "epoch": "ns"}, timeout=30)
    r.raise_for_status()
    result = r.json()["results"][0]
    assert "error" not in result, result
    return list(result.get("series", []))


def _journal_len(runs: Path) -> int:
    journals = list(runs.glob(f"*/{JOURNAL_FILE}"))
    return len(journals[0].read_bytes().splitlines()) if journals else 0


def _wait(pred: Any, what: str, proc: Any, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"soakd exited while waiting for {what}: {err[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _soakd_line(line: str) -> bool:
    try:
        doc = json.loads(line)
    except ValueError:
        return False
    return isinstance(doc, dict) and "event" in doc and "level" in doc


def test_soak_through_a_database_outage_and_a_daemon_crash(
    tmp_path: Path, influxdb_starter: InfluxStarter, tiny_model: Path
) -> None:
    secret = "s3cret-" + secrets.token_hex(16)
    env = {"SOAKD_INFLUX_PASSWORD": secret}
    influx = influxdb_starter(tmp_path / "influx")
    times = write_mooncake(tmp_path / "trace.jsonl")
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f"""
[run]
name = "e2e"
duration = "{DURATION_S:.0f}s"
output_dir = "runs"
checkpoint_interval = "1s"
[trace]
path = "trace.jsonl"
format = "mooncake"
[engine]
model = "{tiny_model}"
max_model_len = 1024
enforce_eager = true  # torch.compile is not under test; it doubles a CPU engine's start
[engine.speculative]
enabled = true
method = "ngram"
num_speculative_tokens = 3
[telemetry]
interval = "1s"
[sinks.influx]
enabled = true
url = "{influx.url}"
api = "v1"
database = "{DB}"
username = "soakd"
interval = "0.5s"
timeout = "2s"
[criteria]
ttft_p99_ms = 60000.0
tpot_p99_ms = 5000.0
max_interruptions = 1
checks = ["errors == 0"]  # fails: the kill loses what was in flight, and the check must see it
""",
        encoding="utf-8",
    )
    runs = tmp_path / "runs"

    # -- the first process: the database goes away for a while, then the daemon is killed -------------
    first = start_soakd(cfg, tmp_path, env=env)
    try:
        _wait(lambda: _journal_len(runs) >= 5, "the replay", first)
        # The secret is in no command line, and no engine process inherited it.
        for proc in _process_tree(first.pid):
            assert secret not in " ".join(proc.cmdline())
            if proc.pid != first.pid:
                assert secret.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
        ports = (influx.ports["http"], influx.ports["rpc"])
        influx.stop()
        time.sleep(8.0)  # the replay goes on; the forwarder backs off and the spool keeps everything
        assert first.poll() is None
        influx = influxdb_starter(tmp_path / "influx", *ports)
        seen = _journal_len(runs)
        _wait(lambda: _journal_len(runs) >= seen + 15, "more traffic", first)
        # Kill just as a request comes due, so that one is in flight (its prefill takes far longer than
        # this poll): the crash then has something to lose.
        seen = _journal_len(runs)
        deadline = time.monotonic() + 60
        while _journal_len(runs) == seen and time.monotonic() < deadline:
            time.sleep(0.002)
        os.killpg(first.pid, signal.SIGKILL)  # the daemon and its engine, as systemd kills a cgroup
        first.wait(timeout=30)
    finally:
        _, _, first_err = finish_soakd(first, timeout_s=30)
    (run_dir,) = runs.iterdir()
    assert not (run_dir / "summary.json").exists()
    due = read_journal(run_dir / JOURNAL_FILE)
    finished = {
        (int(s.fields["loop"]), int(s.fields["index"]), int(s.fields.get("copy", 0)))
        for s in iter_samples(run_dir / "spool", "requests")
    }
    lost = set(due) - finished
    assert lost, "nothing was in flight at the kill"
    assert 0.0 < max(due.values()) < DURATION_S

    # -- the restart: same run, from where it stopped ----------------------------------------------------
    t_restart = time.monotonic()
    second = start_soakd(cfg, tmp_path, "--resume", env=env)
    _wait(lambda: _journal_len(runs) > len(due), "the resumed replay", second)
    resume_s = time.monotonic() - t_restart
    code, out, err = finish_soakd(second, timeout_s=400)
    assert code in (0, 1), err[-3000:]
    summary = json.loads(out)
    assert summary["run_id"] == run_dir.name and Path(summary["run_dir"]) == run_dir
    # The throughput judge read the prompt tokens the real engine computed (counted at its weight).
    assert summary["control"]["throughput"]["prompt_tokens_computed"] > 0
    # The console is soakd's: every line on stderr is one of its own log lines (no vLLM warning, no
    # torch FutureWarning, no traceback from the engine's clean shutdown); the engine's output is in
    # the run's engine log, both processes' of it.
    for text in (first_err, err):
        foreign = [line for line in text.splitlines() if line.strip() and not _soakd_line(line)]
        assert not foreign, foreign[:10]
    engine_log = (run_dir / ENGINE_OUTPUT_FILE).read_text(errors="replace")
    assert "WARNING" in engine_log and "output_handler failed" not in engine_log

    # Every scheduled request: recorded once, or lost in flight at the kill (and counted as such).
    want = expected_requests(times, DURATION_S)
    assert want > TRACE_ROWS  # the trace looped
    records = Counter(
        (int(s.fields["loop"]), int(s.fields["index"]), int(s.fields.get("copy", 0)))
        for s in iter_samples(run_dir / "spool", "requests")
    )
    assert max(records.values()) == 1
    assert not set(records) & lost
    verdict = json.loads((run_dir / "verdict.json").read_text())
    # The lost ones were scheduled and never completed: they count in the whole run's requests.
    assert verdict["requests"]["scheduled"] == sum(records.values()) + len(lost) == want
    assert verdict["requests"]["failed"] >= len(lost)
    assert verdict["lost_in_flight"] == len(lost)
    # One accounting: `metrics` (what checks and `compare` read) and the checks count them too.
    metrics = verdict["metrics"]
    assert metrics["requests"] == want and metrics["errors"] == verdict["requests"]["failed"] >= len(lost)
    assert metrics["completed"] == verdict["requests"]["completed"]
    assert metrics["completed_ratio"] == pytest.approx(verdict["requests"]["completed_ratio"])
    (errors_check,) = [c for c in verdict["criteria"] if c["expr"] == "errors == 0"]
    assert not errors_check["passed"] and errors_check["value"] == metrics["errors"]
    assert code == 1 and verdict["verdict"] == "FAIL"
    (gap,) = verdict["interruptions"]
    assert gap["down_s"] > 0 and gap["at_s"] >= max(due.values())
    assert verdict["exit_code"] == code
    # The run that ended on its own wrote its sign-off report, with the verdict it judged.
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"]["verdict"] == verdict["verdict"] and report["generated"]["source"] == "spool"
    assert "<svg" in (run_dir / "report.html").read_text()

    # InfluxDB has exactly the spool's points, measurement by measurement: the outage was backfilled,
    # the resumed forwarder shipped nothing twice, and no point of the two processes collides.
    spool: Counter[str] = Counter()
    keys: Counter[tuple[str, tuple[tuple[str, str], ...], int]] = Counter()
    for seg in sorted((run_dir / "spool").glob("seg-*.lp")):
        for line in seg.read_text(encoding="utf-8").splitlines():
            p = parse_line(line)
            spool[p.measurement] += 1
            keys[(p.measurement, tuple(sorted(p.tags.items())), p.time_ns)] += 1
    assert max(keys.values()) == 1
    assert summary["influx"]["all_shipped"] is True
    run_q = f"\"run_id\" = '{run_dir.name}'"
    for measurement, n in spool.items():
        series = influxql(influx, f'SELECT count(*) FROM "{measurement}" WHERE {run_q}')
        got = max(series[0]["values"][0][1:]) if series else 0
        assert got == n, (measurement, got, n)
    assert {"requests", "engine", "spec_decode", "host", "collector", "events", "run"} <= set(spool)
    assert summary["points"] == dict(spool)  # the summary counts both processes' points

    # Speculative decoding really ran, and its counters reached the database.
    spec = influxql(
        influx, f'SELECT sum("drafts"), sum("draft_tokens"), sum("accepted") FROM spec_decode WHERE {run_q}'
    )
    _, drafts, draft_tokens, accepted = spec[0]["values"][0]
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
    # Requests completed with the exact output lengths the trace asked for.
    short = influxql(
        influx,
        f'SELECT count("index") FROM requests WHERE "status" = \'ok\' AND '
        f'"output_tokens" <> "output_tokens_expected" AND {run_q}',
    )
    assert not short
    # One engine configuration across both processes (the same config id); the prefix cache saw hits.
    cfg_tags = influxql(influx, 'SHOW TAG VALUES FROM engine WITH KEY = "config"')
    assert cfg_tags and len(cfg_tags[0]["values"]) == 1
    hits = influxql(influx, f'SELECT sum("prefix_hits") FROM engine WHERE {run_q}')
    assert hits[0]["values"][0][1] > 0

    kinds = Counter(s.tags["kind"] for s in iter_samples(run_dir / "spool", "events"))
    assert kinds["sink_outage"] >= 1 and kinds["sink_backfill"] >= 1
    assert kinds["run_start"] == 1 and kinds["run_resume"] == 1

    # The secret is nowhere: not in the daemon's output (logs included), nor in any file of the run.
    for text in (first_err, out, err):
        assert secret not in text
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    # 0700 directories, 0600 files: the run's data is the service user's alone.
    for path in [run_dir, *run_dir.rglob("*")]:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))

    # `soakd report` re-judges from the spool alone and reaches the same verdict, interruption included.
    rep = subprocess.run(
        [sys.executable, "-m", "soakd", "report", str(run_dir), "--json", "--rejudge", "--exit-code"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert rep.returncode == code, rep.stderr
    again = json.loads(rep.stdout)
    assert again["verdict"] == verdict["verdict"] and again["interruptions"] == verdict["interruptions"]
    assert again["requests"] == verdict["requests"]  # the lost ones counted again, from the run folder
    assert again["metrics"]["errors"] == metrics["errors"] and again["metrics"]["requests"] == want
    # And `compare` reads the same accounting (the run against itself: both sides count the lost).
    cmp = subprocess.run(
        [sys.executable, "-m", "soakd", "compare", str(run_dir), str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert cmp.returncode == 0, cmp.stderr
    rows = {r["name"]: r for r in json.loads(cmp.stdout)["metrics"]}
    assert rows["errors"]["a"] == rows["errors"]["b"] == metrics["errors"]
    assert rows["completed_ratio"]["b"] == pytest.approx(metrics["completed_ratio"])

    print(f"\nresume: replaying again {resume_s:.1f} s after the restart; lost in flight {len(lost)}")
