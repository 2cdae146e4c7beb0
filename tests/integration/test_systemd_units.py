"""soakd's units under a real systemd (PID 1 of its own Debian root, tests/integration/systemd_root.py),
installed as systemd/README.md says, with every hardening option of the shipped unit in force:
Type=notify READY and STATUS, the timer's next elapse, a LoadCredential secret used against an InfluxDB
that requires it, a watchdog kill of a soakd that stopped answering followed by the restart and
`--resume` of the same run, and `systemctl stop` draining to exit 0.

The engine is the session's vLLM server (attach mode) on host loopback: the machine shares the host's
network namespace. Skipped only where namespaces cannot be made; SOAKD_REQUIRE_SYSTEMD=1 (CI) fails then.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from servers import Server, start_influxdb
from systemd_root import REPO, HarnessError, Machine, booted, build_root, build_wheel, prepare, unavailable

pytestmark = pytest.mark.integration

UNITS = REPO / "systemd"
# Test-only timing in a drop-in; the hardening and everything else is the shipped unit's.
DROP_IN = """\
[Service]
LoadCredential=SOAKD_INFLUX_PASSWORD:/etc/soakd/influx-password
WatchdogSec=6s
RestartSec=1s
"""


@pytest.fixture(scope="module")
def debian_root() -> Path:
    reason = unavailable()
    if reason:
        if os.environ.get("SOAKD_REQUIRE_SYSTEMD") == "1":
            pytest.fail(f"SOAKD_REQUIRE_SYSTEMD=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return build_root()


@pytest.fixture
def secured_influx(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    """An influxd that refuses writes without the admin password, with the database soakd writes to."""
    password = secrets.token_urlsafe(18)
    server = start_influxdb(tmp_path / "influxdb", admin_password=password)
    try:
        answer = httpx.post(
            server.url + "/query", data={"q": "CREATE DATABASE soakd"}, auth=("admin", password), timeout=10
        )
        assert answer.status_code == 200, answer.text
        unauthenticated = httpx.post(server.url + "/write?db=soakd", content=b"m v=1", timeout=10)
        assert unauthenticated.status_code == 401  # so data in it proves the credential was used
        yield server, password
    finally:
        server.stop()


def _config(engine_url: str, influx_url: str) -> str:
    return f"""\
[run]
name = "nightly"
duration = "30m"
output_dir = "/var/lib/soakd/runs"
[trace]
format = "synthetic"
[trace.arrivals]
rate_rps = 1.0
[trace.synthetic]
duration = "30m"
input_tokens_mean = 64
input_tokens_max = 128
output_tokens_mean = 12
output_tokens_max = 24
[engine]
kind = "openai"
url = "{engine_url}"
model = "/opt/soakd/models/tiny"
[replay]
warmup_requests = 0
drain_timeout = "10s"
[telemetry]
interval = "1s"
collectors = ["host", "engine", "metrics"]
[sinks.influx]
enabled = true
url = "{influx_url}"
database = "soakd"
username = "admin"
interval = "1s"
[criteria]
max_interruptions = 1
"""


def _wait(what: str, ready: Callable[[], object], timeout_s: float, poll_s: float = 0.2) -> float:
    """Seconds until `ready()` is truthy; fails naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def _files(tiny_model: Path, engine_url: str, influx_url: str, password: str) -> dict[str, tuple[bytes, int]]:
    files: dict[str, tuple[bytes, int]] = {
        "/etc/systemd/system/soakd.service": ((UNITS / "soakd.service").read_bytes(), 0o644),
        "/etc/systemd/system/soakd-nightly.timer": ((UNITS / "soakd-nightly.timer").read_bytes(), 0o644),
        "/etc/systemd/system/soakd.service.d/test.conf": (DROP_IN.encode(), 0o644),
        "/opt/soakd/systemd/README.md": ((UNITS / "README.md").read_bytes(), 0o644),
        "/etc/soakd/config.toml": (_config(engine_url, influx_url).encode(), 0o644),
        "/etc/soakd/influx-password": (password.encode() + b"\n", 0o600),
    }
    for path in tiny_model.rglob("*"):
        if path.is_file():
            files[f"/opt/soakd/models/tiny/{path.relative_to(tiny_model)}"] = (path.read_bytes(), 0o644)
    return files


def _next_2000_utc(now: datetime) -> datetime:
    at = now.replace(hour=20, minute=0, second=0, microsecond=0)
    return at if at > now else at + timedelta(days=1)


def test_soakd_under_a_real_systemd(
    tmp_path: Path,
    debian_root: Path,
    vllm_server: Server,
    tiny_model: Path,
    secured_influx: tuple[Server, str],
) -> None:
    influx, password = secured_influx
    timings: dict[str, float] = {}
    start = time.monotonic()
    wheel = build_wheel(tmp_path / "wheel")
    work = tmp_path / "machine"
    prepare(debian_root, work, _files(tiny_model, vllm_server.url, influx.url, password), wheel)
    timings["install_s"] = time.monotonic() - start
    start = time.monotonic()
    with booted(debian_root, work) as machine:
        timings["boot_s"] = time.monotonic() - start
        try:
            _exercise(machine, influx, password, timings)
        except (AssertionError, HarnessError, pytest.fail.Exception):
            print(machine.journal("soakd.service")[-6000:])
            raise
    print("systemd timings:", json.dumps({k: round(v, 2) for k, v in timings.items()}))


def _exercise(machine: Machine, influx: Server, password: str, timings: dict[str, float]) -> None:
    runs = machine.path("/var/lib/soakd/runs")

    # The timer: enabling it schedules tonight's 20:00 (the machine's zone is UTC) and starts no soak.
    machine.systemctl("enable", "--now", "soakd-nightly.timer")
    timer = machine.show("soakd-nightly.timer", "ActiveState", "NextElapseUSecRealtime")
    assert timer["ActiveState"] == "active", timer
    elapse = datetime.strptime(timer["NextElapseUSecRealtime"], "%a %Y-%m-%d %H:%M:%S %Z").replace(tzinfo=UTC)
    assert elapse == _next_2000_utc(datetime.now(UTC)), timer
    assert machine.show("soakd.service", "ActiveState")["ActiveState"] == "inactive"

    # README step 5: the config checked as the service user, with the credential, before the first night.
    check = machine.run(
        *("systemd-run", "--pipe", "--wait", "--quiet", "-p", "User=soakd"),
        *("-E", "SOAKD_CONFIG=/etc/soakd/config.toml"),
        *("-p", "LoadCredential=SOAKD_INFLUX_PASSWORD:/etc/soakd/influx-password"),
        *("/opt/soakd/venv/bin/soakd", "check"),
        check=False,
        timeout_s=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert password not in check.stdout + check.stderr

    # Type=notify: `systemctl start` returns once soakd has sent READY=1, with a STATUS= line.
    start = time.monotonic()
    machine.systemctl("start", "soakd.service", timeout_s=300)
    timings["start_to_ready_s"] = time.monotonic() - start
    unit = machine.show("soakd.service", "ActiveState", "SubState", "StatusText", "MainPID", "NRestarts")
    assert (unit["ActiveState"], unit["SubState"]) == ("active", "running"), unit
    assert unit["StatusText"].startswith("replaying"), unit
    assert unit["NRestarts"] == "0"
    first_pid = unit["MainPID"]
    (run_dir,) = _wait_for_run(runs)
    _wait("requests replayed", lambda: _journal_lines(run_dir) >= 3, 120)

    # The watchdog: a soakd that stops answering (SIGSTOP: no WATCHDOG=1 from its loop) is aborted
    # after WatchdogSec (systemd sends SIGCONT after the SIGABRT, so the stopped process receives it),
    # Python's faulthandler writes where it stood, and Restart= brings it back with --resume on the
    # same run.
    machine.run("bash", "-c", f"kill -STOP {first_pid}")
    stopped = time.monotonic()
    timings["watchdog_detect_s"] = _wait(
        "the watchdog timeout", lambda: "Watchdog timeout" in machine.journal("soakd.service"), 60
    )
    _wait(
        "the restart",
        lambda: (
            machine.show("soakd.service", "NRestarts", "ActiveState", "SubState")
            == {"NRestarts": "1", "ActiveState": "active", "SubState": "running"}
        ),
        180,
    )
    timings["watchdog_to_ready_again_s"] = time.monotonic() - stopped
    journal = machine.journal("soakd.service")
    assert "Fatal Python error: Aborted" in journal, journal[-3000:]
    assert re.search(r"soakd\.service: (Main process exited|Failed with result 'watchdog')", journal)
    unit = machine.show("soakd.service", "MainPID", "StatusText")
    assert unit["MainPID"] != first_pid and unit["StatusText"].startswith("replaying"), unit
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == [run_dir.name]  # resumed, not new
    lines_at_resume = _journal_lines(run_dir)
    _wait("requests replayed after the resume", lambda: _journal_lines(run_dir) >= lines_at_resume + 3, 120)

    # `systemctl stop`: SIGTERM, the drain, the verdict, exit 0.
    start = time.monotonic()
    machine.systemctl("stop", "soakd.service", timeout_s=400)
    timings["stop_s"] = time.monotonic() - start
    unit = machine.show("soakd.service", "ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    assert unit == {
        "ActiveState": "inactive",
        "Result": "success",
        "ExecMainStatus": "0",
        "ExecMainCode": "1",
    }, unit
    verdict = json.loads((run_dir / "verdict.json").read_text())
    # Stopped before its duration by the operator: judged on the work done, its duration line
    # informational; the daemon crash it was resumed from is counted (1, allowed 1). The stop itself is a
    # clean end of the service (exit 0 above, the code verdict.json records), PASS or FAIL.
    assert verdict["stopped_early"] is True and verdict["stopped_by"] == "SIGTERM"
    assert verdict["exit_code"] == 0
    (duration,) = [c for c in verdict["criteria"] if c["name"] == "duration_completed_s"]
    assert duration["informational"] and duration["passed"], duration
    (interruptions,) = [c for c in verdict["criteria"] if c["name"] == "interruptions"]
    assert interruptions["value"] == 1.0 and interruptions["passed"], interruptions
    # The word is the criteria's: the requests the kill lost in flight (if any) fail error_rate.
    assert (verdict["verdict"] == "PASS") == all(c["passed"] for c in verdict["criteria"])

    # The credential reached soakd and nothing else: the points are in the InfluxDB that refuses writes
    # without it, and the password is in no log line and not in the unit's environment.
    answer = httpx.get(
        influx.url + "/query",
        params={
            "db": "soakd",
            "q": f"SELECT count(ttft_s) FROM requests WHERE run_id = '{verdict['run_id']}'",
        },
        auth=("admin", password),
        timeout=10,
    ).json()
    count = answer["results"][0]["series"][0]["values"][0][1]
    # Every one, across both processes: at least the first request before the kill and the three after the
    # resume (the kill loses those in flight; a request is journaled as it is handed to the sender
    # process, up to 25 ms before its send, so the SIGSTOP above can find two in flight).
    assert count == verdict["requests"]["ttft"]["count"] >= 4, answer
    assert (
        verdict["requests"]["scheduled"] == verdict["requests"]["completed"] + verdict["requests"]["failed"]
    )
    assert password not in machine.journal("soakd.service")
    assert password not in machine.systemctl("show", "soakd.service", "--property=Environment")

    # Under journald every log line's keys are journal fields: `journalctl RUN_ID=...` is one run, both
    # processes (the killed one and the resumed one), with its events by kind.
    listed = machine.run("journalctl", "--no-pager", "-o", "json", f"RUN_ID={verdict['run_id']}").stdout
    entries = [json.loads(line) for line in listed.splitlines() if line.strip()]
    events = {e.get("EVENT") for e in entries}
    assert {"run_resumed", "signal_received", "event"} <= events, sorted(str(e) for e in events)
    assert len({e.get("_PID") for e in entries}) == 2 and all(
        e["SYSLOG_IDENTIFIER"] == "soakd" for e in entries
    )
    assert {"run_start", "run_resume", "run_end"} <= {e.get("KIND") for e in entries}
    assert any(e["EVENT"] == "signal_received" and e["PRIORITY"] == "4" for e in entries)

    # The hardening, as systemd rates it for the unit that just ran.
    security = machine.run("systemd-analyze", "security", "--no-pager", "soakd.service", check=False).stdout
    match = re.search(r"Overall exposure level for soakd\.service: (\d+\.\d+)", security)
    assert match, security[-2000:]
    timings["exposure_level"] = float(match.group(1))
    assert timings["exposure_level"] < 3.0, security[-3000:]


def _wait_for_run(runs: Path) -> list[Path]:
    _wait("the run folder", lambda: runs.is_dir() and any(p.is_dir() for p in runs.iterdir()), 60)
    return [p for p in runs.iterdir() if p.is_dir()]


def _journal_lines(run_dir: Path) -> int:
    try:
        return (run_dir / "replay.journal").read_bytes().count(b"\n")
    except OSError:
        return 0
