"""A stop as an operator makes one, against real processes: `python -m soakd run` in its own session, so
the test can signal its whole process group as a terminal's Ctrl-C does.

- SIGINT to the group mid-replay (a real vLLM CPU engine in-process): the engine's processes never see
  it, soakd drains; no engine death, no request failed; exit 4 with a PASS of the work done.
- SIGINT to the group while the engine starts: the start is cut short in seconds, its processes killed;
  exit 4, and the verdict says the replay never began.
- A full output disk (a small tmpfs) when the verdict is written: exit 3, one line saying so, and
  nothing claims PASS.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from servers import finish_soakd, start_soakd

from soakd.rundir import ENGINE_OUTPUT_FILE
from soakd.sinks.spool import iter_samples

pytestmark = pytest.mark.integration


def _config(path: Path, model: Path, duration: str = "120s", out: Path | None = None) -> Path:
    # Outputs long enough (hundreds of tokens) that requests are in flight whenever the signal comes.
    path.write_text(
        f"""
[run]
duration = "{duration}"
output_dir = "{out or path.parent / "runs"}"
report = false
[trace]
format = "synthetic"
[trace.arrivals]
rate_rps = 3.0
[trace.synthetic]
duration = "20s"
input_tokens_mean = 64
output_tokens_mean = 300
output_tokens_max = 400
[engine]
model = "{model}"
max_model_len = 512
max_num_seqs = 8
enforce_eager = true
[engine.speculative]
enabled = false
[replay]
warmup_requests = 1
[telemetry]
interval = "1s"
slow_interval = "3s"
collectors = ["host", "engine"]
[criteria]
# Latency on two shared CPU cores is not under test; failures and restarts are.
ttft_p99_ms = false
tpot_p99_ms = false
max_error_rate = 0.0
checks = ["engine_restarts == 0"]
""",
        encoding="utf-8",
    )
    return path


def _engine_processes(root: psutil.Process) -> list[psutil.Process]:
    out = []
    for p in root.children(recursive=True):
        try:
            if "VLLM::" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _wait(pred: object, what: str, proc: subprocess.Popen[str], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        assert proc.poll() is None, f"soakd exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.2)


def _none_alive(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """The pids still running after up to timeout_s (an orphan reaped by init is gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_ctrl_c_reaches_soakd_alone_and_the_work_done_passes(tmp_path: Path, tiny_model: Path) -> None:
    cfg = _config(tmp_path / "stop.toml", tiny_model)
    # vLLM's INFO lines in engine.log: the engine core logs any termination signal it receives there.
    proc = start_soakd(cfg, tmp_path, env={"VLLM_LOGGING_LEVEL": "INFO"})
    try:
        root = psutil.Process(proc.pid)

        def completed() -> int:
            return sum(
                1
                for seg in (tmp_path / "runs").glob("*/spool/*.lp")
                for line in seg.read_bytes().splitlines()
                if line.startswith(b"requests,") and b"status=ok" in line
            )

        _wait(lambda: completed() >= 3, "three completed requests", proc)
        engine = [p.pid for p in _engine_processes(root)]
        assert engine, "no vLLM processes under soakd"
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        code, out, err = finish_soakd(proc, timeout_s=300)
    finally:
        if proc.poll() is None:
            finish_soakd(proc, timeout_s=1)
    assert code == 4, err[-3000:]
    doc = json.loads(out)
    run_dir = Path(doc["run_dir"])
    engine_log = (run_dir / ENGINE_OUTPUT_FILE).read_text(encoding="utf-8", errors="replace")
    # vLLM stops its engine core with SIGTERM; a SIGINT there would be the terminal's.
    assert "received signal=SIGINT" not in engine_log, engine_log[-3000:]
    assert "EngineDeadError" not in engine_log, engine_log[-3000:]
    events = [s.tags["kind"] for s in iter_samples(run_dir / "spool", "events")]
    assert "engine_restart" not in events and "engine_failed" not in events
    replay = doc["replay"]
    # Requests were in flight at the signal (outputs of hundreds of tokens at 3/s) and drained: none
    # failed, none is missing its record.
    assert replay["failed"] == 0 and replay["completed"] == replay["scheduled"] > 3, replay
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS", verdict["criteria"]
    assert verdict["exit_code"] == 4 and verdict["stopped_by"] == "SIGINT" and verdict["stopped_early"]
    assert verdict["replay_began"] is True and verdict["interruptions"] == []
    assert doc["stopped_early"] is True and doc["stopped_by"] == "SIGINT" and doc["error"] == ""
    assert _none_alive(engine) == []  # vLLM's own shutdown stopped its processes


def test_ctrl_c_during_the_engine_start_ends_it_in_seconds(tmp_path: Path, tiny_model: Path) -> None:
    cfg = _config(tmp_path / "start.toml", tiny_model)
    proc = start_soakd(cfg, tmp_path)
    try:
        root = psutil.Process(proc.pid)
        # The engine core is up and loading: the start is under way, not yet done.
        _wait(lambda: bool(_engine_processes(root)), "an engine process", proc, timeout_s=300)
        descendants = [p.pid for p in root.children(recursive=True)]
        assert not list((tmp_path / "runs").glob("*/spool/*.lp")) or not any(
            b"engine_start" in p.read_bytes() for p in (tmp_path / "runs").glob("*/spool/*.lp")
        ), "the engine had started already"
        t_signal = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code, out, err = finish_soakd(proc, timeout_s=120)
        took_s = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            finish_soakd(proc, timeout_s=1)
    assert code == 4, err[-3000:]
    # Cut short, not waited out (whatever the machine's speed): soakd says it killed the half-started
    # engine, and no engine start was ever recorded; the time is a hang guard (soakd waits 5 s at most
    # for the start's thread after the kill; the start itself takes 20-35 s on two cores).
    assert "engine_start_cut_short" in err, err[-3000:]
    assert took_s < 60, f"the stop took {took_s:.1f} s"
    doc = json.loads(out)
    spooled = [s.tags["kind"] for s in iter_samples(Path(doc["run_dir"]) / "spool", "events")]
    assert "engine_start" not in spooled, spooled
    verdict = json.loads((Path(doc["run_dir"]) / "verdict.json").read_text())
    assert verdict["replay_began"] is False and verdict["stopped_by"] == "SIGINT"
    assert verdict["exit_code"] == 4 and verdict["verdict"] == "FAIL"
    assert doc["replay"]["scheduled"] == 0
    assert _none_alive(descendants) == []  # the half-started engine was killed, not orphaned
    print(f"a stop during the engine start: exit {took_s:.1f} s after the signal")


# A soakd whose engine (the stub of soakd.testing) fills the output disk as it stops: after the replay,
# right before the verdict is written.
_FULL_DISK_SOAK = """
import sys
from soakd import app, cli, testing


class FillsTheDisk(testing.StubEngine):
    async def stop(self):
        await super().stop()
        with open(sys.argv[1] + "/filler", "wb") as f:
            for size in (1 << 20, 1 << 12, 1):
                try:
                    while True:
                        f.write(b"x" * size)
                        f.flush()
                except OSError:
                    continue


app.make_engine = lambda cfg, model, collector, log_dir=None: FillsTheDisk(collector)
sys.exit(cli.main(sys.argv[2:]))
"""


def test_a_verdict_the_full_disk_refuses_exits_3_and_claims_nothing(tmp_path: Path) -> None:
    out_dir = tmp_path / "small"
    out_dir.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(out_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode != 0:
        reason = f"cannot mount a tmpfs here: {mount.stderr.strip()}"
        if os.environ.get("SOAKD_REQUIRE_SERVERS") == "1":
            pytest.fail(f"SOAKD_REQUIRE_SERVERS=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    try:
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        (model / "w.safetensors").write_text("")
        cfg = tmp_path / "full.toml"
        cfg.write_text(
            f"""
[run]
duration = "3s"
output_dir = "{out_dir}"
[trace]
format = "synthetic"
[trace.arrivals]
rate_rps = 20.0
[trace.synthetic]
duration = "2s"
output_tokens_mean = 8
output_tokens_max = 16
[engine]
model = "{model}"
[telemetry]
interval = "0.5s"
collectors = ["host", "engine"]
[sinks.spool]
min_free_bytes = 0  # the whole small disk is the spool's until it is filled
""",
            encoding="utf-8",
        )
        argv = ["run", "--config", str(cfg), "--json", "--no-progress"]
        proc = subprocess.run(
            [sys.executable, "-c", _FULL_DISK_SOAK, str(out_dir), *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        runs = [p for p in out_dir.iterdir() if p.is_dir()]
        assert len(runs) == 1 and (out_dir / "filler").stat().st_size > 0
        assert not (runs[0] / "verdict.json").exists()
    finally:
        subprocess.run(["umount", str(out_dir)], check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("soakd: ")]
    assert len(errors) == 1 and errors[0].startswith("soakd: verdict not written (")
    assert "No space left on device" in errors[0]
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "NOT WRITTEN" and doc["verdict_detail"] is None and doc["exit_code"] == 3
    assert "PASS" not in proc.stdout and "PASS" not in proc.stderr
