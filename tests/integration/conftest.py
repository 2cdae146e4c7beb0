"""Session-scoped real servers for the integration tests: one influxd 1.x and one victoria-metrics.

A missing binary skips the tests that need it, unless SOAKD_REQUIRE_SERVERS=1 (set in CI, where both are
installed), which turns the skip into a failure so that a broken CI image cannot pass silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from servers import (
    INFLUXD,
    VICTORIA_METRICS,
    Server,
    binary_available,
    start_influxdb,
    start_victoria_metrics,
)


def _require(binary: str, package: str) -> None:
    if binary_available(binary):
        return
    reason = f"{binary} not found (apt-get install {package})"
    if os.environ.get("SOAKD_REQUIRE_SERVERS") == "1":
        pytest.fail(f"SOAKD_REQUIRE_SERVERS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def influxdb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """An influxd (Debian's 1.6.7) on a free loopback port, data in a temp folder."""
    _require(INFLUXD, "influxdb")
    server = start_influxdb(tmp_path_factory.mktemp("influxdb"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def victoria_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A single-node victoria-metrics on a free loopback port (it takes InfluxDB line protocol)."""
    _require(VICTORIA_METRICS, "victoria-metrics")
    server = start_victoria_metrics(tmp_path_factory.mktemp("victoria-metrics"))
    try:
        yield server
    finally:
        server.stop()


InfluxStarter = Callable[..., Server]


@pytest.fixture
def influxdb_starter() -> Iterator[InfluxStarter]:
    """`start_influxdb` for tests that stop and restart their own server; stops what it started."""
    _require(INFLUXD, "influxdb")
    started: list[Server] = []

    def start(root: Path, http_port: int | None = None, rpc_port: int | None = None) -> Server:
        server = start_influxdb(root, http_port, rpc_port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight model, built by the real CLI (`soakd model tiny`) once per session."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("model") / "tiny"
    proc = subprocess.run(
        [sys.executable, "-m", "soakd", "model", "tiny", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "config.json").is_file()
    return out


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Server]:
    """vLLM's OpenAI-compatible api_server (CPU build) serving the tiny model as "tiny" on loopback.

    Started once per session (about 40 s on two cores), stopped by its process group at the end.
    """
    from servers import start_vllm

    server = start_vllm(tiny_model, tmp_path_factory.mktemp("vllm"))
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class ServerSoak:
    """The shared server-mode soak: its summary, its spooled samples by measurement, and where InfluxDB
    holds it."""

    doc: dict[str, Any]
    by: dict[str, list[Any]]
    influx_url: str
    database: str


# A recorded H200 with two 700 W power-cap episodes (15-35 s and 50-71 s of 85 s), played at 3x so both
# fall inside the 30 s replay.
NVML_PHASES = Path(__file__).parents[1] / "data" / "h200" / "phases" / "nvml_phases.jsonl.gz"
SERVER_SOAK_DB = "server_soak"


@pytest.fixture(scope="session")
def server_soak(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, influxdb: Server) -> ServerSoak:
    """The server-mode soak of test_engine_lifecycle_e2e, run once for two readers: that test, and the
    dashboard and alert checks (test_dashboards_influx.py), which need a real run in a real InfluxDB.
    Besides the engine it replays the recorded H200 as its GPU (so the GPU collector, the throttle
    detector and the control loop act on a real throttle episode) and ships to the session InfluxDB."""
    from test_engine_lifecycle_e2e import LIFECYCLE_CRITERIA, run_ok, write_config

    tmp = tmp_path_factory.mktemp("server-soak")
    # The latency and error-rate criteria are off (as in the lifecycle tests): a CPU engine's TTFT on a
    # machine busy with other work is no finding of this run, which must pass for its readers.
    extra = (
        LIFECYCLE_CRITERIA
        + f"""
[sinks.influx]
enabled = true
url = "{influxdb.url}"
database = "{SERVER_SOAK_DB}"
interval = "0.5s"
[control.batch]
# Two 7 s power-cap episodes at 2 requests/s: short windows, and no queue needed (the CPU engine never
# makes one at this rate), so the policy makes and judges a trial inside each episode.
dwell = "3s"
settle = "1s"
eval = "2s"
min_binding = 0.0
"""
    )
    cfg = write_config(tmp / "server.toml", tiny_model, 'kind = "vllm-server"', extra=extra)
    collectors = 'collectors = ["host", "engine", "allocator", "metrics"]'
    text = cfg.read_text(encoding="utf-8")
    assert text.count(collectors) == 1
    gpu = f'collectors = ["host", "engine", "allocator", "metrics", "gpu"]\ngpu_recording = "{NVML_PHASES}"'
    cfg.write_text(text.replace(collectors, gpu + "\ngpu_recording_speed = 3.0"), encoding="utf-8")
    doc, by = run_ok(cfg)
    return ServerSoak(doc, by, influxdb.url, SERVER_SOAK_DB)
