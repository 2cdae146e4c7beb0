"""The webhook alert sink against a real HTTP receiver on loopback, over real spool files.

Events reach the spool as in a run (SampleWriter over a Spool); a throttle episode comes from the
detector fed with the recorded H200 power-cap burn. The receiver is an aiohttp server started and
stopped by each test; "down" means its port is closed (connection refused), as for a stopped
Alertmanager.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import re
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from soakd.app import Soak
from soakd.cli import main
from soakd.collectors.gpu_throttle import emit_transition
from soakd.config import WebhookConfig, load
from soakd.errors import ConfigError
from soakd.metric import Sample
from soakd.policies.throttle import ThrottleDetector, ThrottleInput, counters_from_fields
from soakd.sinks.spool import Spool, iter_samples
from soakd.sinks.webhook import ALERTS_FILE, REJECTED_FILE, STATE_FILE, WebhookSink, make_sender
from soakd.sinks.writer import SampleWriter
from soakd.testing import ManualTime, StubEngine, stub_config

RECORDING = Path(__file__).parents[2] / "data" / "h200" / "nvml_soak_then_matmul_burn.jsonl.gz"
RUN_ID = "20261130T000000Z-soak-abcd"
T0 = 1_790_000_000 * 10**9
SECRET = "tok-3f9a1c-never-logged"


class Receiver:
    """A real HTTP server on 127.0.0.1 that records each POST; answers `statuses` in turn, then 200."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.posts: list[tuple[dict[str, str], Any]] = []
        self.statuses = list(statuses or [])
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._sock.close()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v2/alerts"

    async def _handle(self, request: web.Request) -> web.Response:
        self.posts.append((dict(request.headers), await request.json()))
        status = self.statuses.pop(0) if self.statuses else 200
        return web.Response(status=status, text="" if status == 200 else f"refused ({status})")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/api/v2/alerts", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def alerts(self) -> list[dict[str, Any]]:
        """Every alert received, in order (either payload format)."""
        out: list[dict[str, Any]] = []
        for _, body in self.posts:
            out.extend(body if isinstance(body, list) else body["alerts"])
        return out


@pytest.fixture
async def receiver() -> Any:
    rx = Receiver()
    await rx.start()
    yield rx
    await rx.stop()


class Run:
    """A run's spool and event writer with a settable wall clock (seconds after T0)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "spool"
        self.spool = Spool(self.dir, segment_bytes=1 << 16, fsync_interval_s=1.0)
        self.t = 0.0
        self.writer = SampleWriter(self.spool, {"run_id": RUN_ID, "host": "h200-a"}, self.wall_ns)

    def wall_ns(self) -> int:
        return T0 + int(self.t * 1e9)

    def event(self, kind: str, message: str, **fields: Any) -> None:
        self.t += 1.0
        self.writer.event(kind, message, **fields)

    def telemetry(self, n: int) -> None:
        self.writer(Sample("gpu", {"sm_mhz": 1980.0 - i}, self.wall_ns() + i, {"gpu": "0"}) for i in range(n))

    def verdict(self, passed: bool, stopped: bool = False, written: bool | None = None) -> None:
        self.t += 1.0
        fields = {"passed": int(passed), "ran_s": 3600.0, "planned_s": 3600.0, "requests": 10, "completed": 9}
        fields["stopped"] = int(stopped)
        if written is not None:
            fields["verdict_written"] = int(written)
        self.writer([Sample("run", {**fields, "failed": 1}, self.wall_ns())])


def sink_for(
    run: Run, clock: ManualTime, url: str, events: list[str] | None = None, **over: Any
) -> WebhookSink:
    cfg = WebhookConfig(enabled=True, url=url, **{"resend_interval": 0.0, **over})

    def on_event(kind: str, fields: dict[str, Any]) -> None:
        if events is not None:
            events.append(kind)

    return WebhookSink(
        run.dir,
        make_sender(cfg, {}),
        cfg,
        on_event=on_event,
        clock=clock,
        sleep=clock.sleep,
        backoff_initial_s=1.0,
        backoff_max_s=4.0,
    )


# -- Alertmanager's API v2 `postableAlerts` (api/v2/openapi.yaml), as a check -------------------------
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _rfc3339(value: object) -> datetime:
    assert isinstance(value, str) and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", value), value
    return datetime.fromisoformat(value)


def check_postable_alerts(body: object) -> None:
    """postableAlerts: an array of postableAlert = {labels (required): labelSet, annotations: labelSet,
    startsAt, endsAt: date-time, generatorURL: uri}; labelSet: string -> string. Alertmanager itself also
    refuses an empty label set, invalid label names and an end before the start."""
    assert isinstance(body, list) and body
    for alert in body:
        assert isinstance(alert, dict)
        assert set(alert) <= {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
        labels = alert["labels"]
        assert isinstance(labels, dict) and labels and "alertname" in labels
        for name, value in labels.items():
            assert _LABEL_NAME.match(name) and isinstance(value, str) and value
        annotations = alert.get("annotations", {})
        assert isinstance(annotations, dict)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in annotations.items())
        if "endsAt" in alert:
            assert _rfc3339(alert["endsAt"]) >= _rfc3339(alert["startsAt"])
        elif "startsAt" in alert:
            _rfc3339(alert["startsAt"])
        if "generatorURL" in alert:
            assert re.match(r"^https?://[^/\s]+", alert["generatorURL"])


def h200_throttle_episode(run: Run) -> list[str]:
    """The recorded H200 burn through the real detector; each transition written as soakd writes it."""
    with gzip.open(RECORDING, "rt") as fh:
        rows = [json.loads(line) for line in fh][1:]
    last = rows[-1]
    # The recording ends 1.5 s after the burn: idle readings after it let the detector recover.
    idle = [
        {"t": last["t"] + 0.1 * i, "gpus": [{"sm_mhz": 345, "reasons": 1, "util_gpu": 0}]}
        for i in range(1, 600)
    ]
    det = ThrottleDetector()
    kinds: list[str] = []

    def on_event(kind: str, message: str, **fields: Any) -> None:
        kinds.append(kind)
        run.writer.event(kind, message, **fields)

    for row in rows + idle:
        g = row["gpus"][0]
        run.t = row["t"]
        inp = ThrottleInput(
            t_s=row["t"],
            sm_mhz=g["sm_mhz"],
            reasons=g["reasons"],
            throttle_ns=counters_from_fields(g.get("fields", {})),
            thermal_margin_c=g.get("margin_c"),
            active=g["util_gpu"] > 0,
        )
        for tr in det.update(inp):
            emit_transition(on_event, tr, "GPU 0", {"gpu": 0})
        if row is rows[-1] or row is idle[-1]:
            run.telemetry(50)
    return kinds


async def test_h200_throttle_episode_fires_then_resolves_the_same_labels(
    tmp_path: Path, receiver: Receiver
) -> None:
    run = Run(tmp_path)
    clock = ManualTime(1000.0)
    sink = sink_for(run, clock, receiver.url, resend_interval=60.0)
    kinds = h200_throttle_episode(run)
    assert kinds == ["throttle_enter", "throttle_recovering", "throttle_leave"]
    await sink.tick(5.0)
    firing, resolved = receiver.alerts
    assert len(receiver.posts) == 1  # one batch: both in order, in one POST
    for _, body in receiver.posts:
        check_postable_alerts(body)
    assert (
        firing["labels"]
        == resolved["labels"]
        == {
            "alertname": "SoakdThrottling",
            "severity": "warning",
            "kind": "throttle_enter",
            "run_id": RUN_ID,
            "host": "h200-a",
            "gpu": "0",
        }
    )
    assert "endsAt" not in firing and firing["startsAt"] == resolved["startsAt"]
    assert _rfc3339(resolved["endsAt"]) > _rfc3339(firing["startsAt"])
    assert "sw_power_cap" in firing["annotations"]["reasons"]
    assert "ok -> throttled" in firing["annotations"]["description"]
    assert "-> ok" in resolved["annotations"]["description"]
    assert receiver.posts[0][0]["Content-Type"] == "application/json"
    assert sink.summary()["firing"] == 0 and sink.summary()["backlog_lines"] == 0


async def test_an_open_episode_is_sent_again_until_it_ends(tmp_path: Path, receiver: Receiver) -> None:
    run = Run(tmp_path)
    clock = ManualTime(1000.0)
    sink = sink_for(run, clock, receiver.url, resend_interval=60.0)
    run.event("throttle_enter", "GPU 1: ok -> throttled (power cap)", gpu=1, reasons="sw_power_cap")
    run.event("engine_restart", "engine died (oom); restarted in 40 s", ok=1, restarts=1)
    await sink.tick(5.0)
    first = receiver.posts[-1][1]
    assert [a["labels"]["alertname"] for a in first] == ["SoakdThrottling", "SoakdEngineRestarted"]
    await sink.tick(5.0)
    clock.now += 59.0
    await sink.tick(5.0)
    assert len(receiver.posts) == 1  # nothing new, and not due yet
    clock.now += 1.0
    await sink.tick(5.0)
    # Only the episode is re-sent (a one-shot alert expires at the receiver), byte for byte the same.
    assert receiver.posts[-1][1] == [first[0]]
    assert sink.counters.resends == 1
    run.event("throttle_leave", "GPU 1: recovering -> ok", gpu=1)
    await sink.tick(5.0)
    assert receiver.posts[-1][1][0]["labels"] == first[0]["labels"] and "endsAt" in receiver.posts[-1][1][0]
    clock.now += 600.0
    await sink.tick(5.0)
    assert len(receiver.posts) == 3  # resolved: no more re-sends


async def test_another_process_on_a_gpu_is_an_episode_per_gpu(tmp_path: Path, receiver: Receiver) -> None:
    """`cotenant_enter` fires SoakdGpuShared with the PIDs and memory as annotations, on by default;
    `cotenant_leave` of that GPU resolves it, another GPU's stays open."""
    run = Run(tmp_path)
    sink = sink_for(run, ManualTime(1000.0), receiver.url)
    for gpu, pid in ((0, "4242"), (1, "77")):
        run.event(
            "cotenant_enter",
            f"GPU {gpu}: another process",
            gpu=gpu,
            pids=pid,
            foreign_procs=1,
            foreign_mem_bytes=3 << 30,
        )
    run.event("cotenant_leave", "GPU 0: no other process computes on it", gpu=0)
    await sink.tick(5.0)
    alerts = receiver.posts[-1][1]
    got = [(a["labels"]["alertname"], a["labels"]["gpu"], "endsAt" in a) for a in alerts]
    assert got == [
        ("SoakdGpuShared", "0", False),
        ("SoakdGpuShared", "1", False),
        ("SoakdGpuShared", "0", True),
    ]
    assert alerts[0]["labels"]["severity"] == "warning"
    assert alerts[1]["annotations"]["pids"] == "77" and alerts[1]["annotations"]["foreign_mem_bytes"] == str(
        3 << 30
    )
    assert sink.summary()["firing"] == 1


async def test_receiver_down_then_up_backfills_everything_in_order(tmp_path: Path) -> None:
    rx = Receiver()  # not started: its port refuses connections
    run = Run(tmp_path)
    clock = ManualTime(1000.0)
    events: list[str] = []
    sink = sink_for(run, clock, rx.url, events)
    run.event("throttle_enter", "GPU 0: ok -> throttled", gpu=0)
    run.telemetry(200)
    run.event("throttle_enter", "host CPUs: ok -> throttled", scope="host")
    run.event("gpu_xid", "GPU 1: XID 79 (fallen off the bus)", gpu=1, xid=79, benign=False)
    await sink.tick(5.0)
    assert events == ["webhook_outage"] and sink.forwarder.consecutive_failures == 1
    assert sink.summary()["backlog_lines"] == 203 and sink.book.open == {}
    run.event("throttle_leave", "GPU 0: recovering -> ok", gpu=0)
    run.event("engine_rebuild", "engine rebuilt", ok=1)  # a rebuild that worked is no alert
    run.event("engine_rebuild", "engine rebuild failed, previous configuration restored", ok=0)
    criteria = [{"name": "ttft_p99_ms", "passed": False}, {"name": "max_error_rate", "passed": True}]
    (tmp_path / "verdict.json").write_text(json.dumps({"run_id": RUN_ID, "criteria": criteria}))
    run.verdict(passed=False)
    await sink.tick(5.0)  # still backing off: no attempt
    assert sink.forwarder.failures == 1
    await rx.start()
    try:
        clock.now += 1.0
        await sink.tick(5.0)
        expected = [
            ("SoakdThrottling", "0", None, False),
            ("SoakdThrottling", None, "host", False),
            ("SoakdGpuXid", "1", None, False),
            ("SoakdThrottling", "0", None, True),
            ("SoakdEngineRebuildFailed", None, None, False),
            ("SoakdThrottling", None, "host", True),  # the run's end resolves what is still open
            ("SoakdRunFailed", None, None, False),
        ]
        got = [
            (a["labels"]["alertname"], a["labels"].get("gpu"), a["labels"].get("scope"), "endsAt" in a)
            for a in rx.alerts
        ]
        assert got == expected
        check_postable_alerts(rx.alerts)
        assert rx.alerts[2]["labels"]["severity"] == rx.alerts[-1]["labels"]["severity"] == "critical"
        assert rx.alerts[-1]["annotations"]["failed_criteria"] == "ttft_p99_ms"
        assert events == ["webhook_outage", "webhook_backfill"]
        posts = len(rx.posts)
        clock.now += 3600.0
        await sink.tick(5.0)
        await sink.drain(1.0)
        assert len(rx.posts) == posts  # nothing twice
    finally:
        await rx.stop()


async def test_restart_resumes_from_the_cursor_with_its_open_episodes(
    tmp_path: Path, receiver: Receiver
) -> None:
    run = Run(tmp_path)
    clock = ManualTime(1000.0)
    first = sink_for(run, clock, receiver.url)
    run.event("spec_drift", "draft acceptance 41% is 30% below the run's first window", drift=-0.3)
    await first.tick(5.0)
    await first.aclose()
    assert (run.dir / STATE_FILE).is_file() and (run.dir / ALERTS_FILE).is_file()
    assert (run.dir / ALERTS_FILE).stat().st_mode & 0o777 == 0o600
    fired = receiver.alerts[0]

    second = sink_for(run, clock, receiver.url)  # a restarted daemon
    await second.tick(5.0)
    assert len(receiver.posts) == 1  # resumed at the cursor: nothing re-sent
    # A crash after a POST was accepted but before the cursor was saved: that batch goes again,
    # identical (Alertmanager merges it by its labels; a webhook receiver by fingerprint and times).
    saved = {name: (run.dir / name).read_bytes() for name in (STATE_FILE, ALERTS_FILE)}
    run.event("spec_drift_cleared", "draft acceptance back within 10% of the first window", drift=-0.02)
    await second.tick(5.0)
    resolved = receiver.alerts[-1]
    assert resolved["labels"] == fired["labels"] and resolved["startsAt"] == fired["startsAt"]
    assert "endsAt" in resolved
    await second.aclose()
    for name, data in saved.items():
        (run.dir / name).write_bytes(data)
    third = sink_for(run, clock, receiver.url)
    await third.tick(5.0)
    assert receiver.posts[-1][1] == receiver.posts[-2][1] == [resolved]
    await third.aclose()

    # A resumed run: its run_resume resolves what the crashed process left open.
    run.event("throttle_enter", "GPU 0: ok -> throttled", gpu=0)
    fourth = sink_for(run, clock, receiver.url)
    await fourth.tick(5.0)
    run.event("run_resume", "soak resumed at 1800 s of 3600 s")
    await fourth.tick(5.0)
    assert receiver.alerts[-1]["labels"]["alertname"] == "SoakdThrottling" and "endsAt" in receiver.alerts[-1]
    assert fourth.book.open == {}
    await fourth.aclose()


async def test_bearer_token_from_credentials_is_sent_and_never_logged(
    tmp_path: Path, receiver: Receiver, capsys: pytest.CaptureFixture[str]
) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOAKD_WEBHOOK_TOKEN").write_text(SECRET + "\n")
    run = Run(tmp_path)
    clock = ManualTime(1000.0)
    cfg = WebhookConfig(
        enabled=True, url=receiver.url, format="webhook", external_url="http://grafana:3000/d/soak"
    )
    receiver.statuses = [401, 503]
    events: list[tuple[str, dict[str, Any]]] = []
    sink = WebhookSink(
        run.dir,
        make_sender(cfg, {"CREDENTIALS_DIRECTORY": str(creds)}),
        cfg,
        on_event=lambda kind, fields: events.append((kind, fields)),
        clock=clock,
        sleep=clock.sleep,
    )
    with capture_logs() as logs:
        run.event("engine_failed", "engine died (CUDA error) and 3 restarts are used up")
        await sink.tick(5.0)
        clock.now += 10.0
        await sink.tick(5.0)
        clock.now += 10.0
        await sink.tick(5.0)
    # Said in the log (the first failure) and in the outage/backfill events (the last reason): the retry's
    # own log line is at debug level, which a configured logger may filter before capture.
    seen = [*logs, *events]
    assert [status for status in ("401", "503") if any(status in str(e) for e in seen)] == ["401", "503"]
    assert len(receiver.posts) == 3
    assert all(headers["Authorization"] == f"Bearer {SECRET}" for headers, _ in receiver.posts)
    payload = receiver.posts[-1][1]
    assert payload["version"] == "4" and payload["status"] == "firing" and payload["receiver"] == "soakd"
    assert (
        payload["groupLabels"] == {"run_id": RUN_ID}
        and payload["externalURL"] == "http://grafana:3000/d/soak"
    )
    alert = payload["alerts"][0]
    assert alert["status"] == "firing" and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["labels"]["alertname"] == "SoakdEngineFailed" and len(alert["fingerprint"]) == 16
    assert payload["commonLabels"] == alert["labels"]
    # The secret is nowhere but in the request header.
    out, err = capsys.readouterr()
    written = b"".join(p.read_bytes() for p in run.dir.iterdir() if p.is_file())
    for text in (repr(logs), repr(events), out, err, json.dumps(sink.summary()), written.decode()):
        assert SECRET not in text
    await sink.aclose()


async def test_basic_auth_and_a_refused_payload_is_set_aside(tmp_path: Path, receiver: Receiver) -> None:
    run = Run(tmp_path)
    clock = ManualTime(1000.0)
    cfg = WebhookConfig(enabled=True, url=receiver.url, username="soakd", resend_interval=0.0)
    sink = WebhookSink(run.dir, make_sender(cfg, {"SOAKD_WEBHOOK_PASSWORD": "pw"}), cfg, clock=clock)
    receiver.statuses = [400]
    run.event("replay_error", "replay ended early: trace changed")
    await sink.tick(5.0)  # refused: kept aside, not retried, the cursor moves on
    run.event("engine_error", "engine did not start: no GPU")
    await sink.tick(5.0)
    assert [b[0]["labels"]["alertname"] for _, b in receiver.posts] == [
        "SoakdReplayError",
        "SoakdEngineStartFailed",
    ]
    assert receiver.posts[0][0]["Authorization"] == "Basic " + base64.b64encode(b"soakd:pw").decode()
    kept = [json.loads(line) for line in (run.dir / REJECTED_FILE).read_text().splitlines()]
    assert kept[0]["reason"].startswith("webhook: HTTP 400") and kept[0]["payload"] == receiver.posts[0][1]
    assert sink.counters.alerts_rejected == 1 and sink.forwarder.failures == 0
    await sink.aclose()


def test_bad_webhook_config_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = {
        "[sinks.webhook]\nenabled = true\n": "3: sinks.webhook.url: needed when sinks.webhook.enabled",
        '[sinks.webhook]\nurl = "alertmanager:9093"\n': "4: sinks.webhook.url: expected an http:// or https://",
        '[sinks.webhook]\nkinds = ["throttle_leave"]\n': "4: sinks.webhook.kinds.0: input should be",
        '[sinks.webhook.severity]\ngpu_xid = "page"\n': "4: sinks.webhook.severity.gpu_xid: input should be",
    }
    for text, message in cases.items():
        cfg = tmp_path / "c.toml"
        cfg.write_text('[run]\noutput_dir = "runs"\n' + text)
        assert main(["run", "--config", str(cfg)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"soakd: error: {cfg}:") and message in err and "\n" not in err, err
        assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match=r"sinks\.webhook\.username"):
        make_sender(load(None, {"sinks.webhook.username": "u"}).sinks.webhook, {"SOAKD_WEBHOOK_TOKEN": "t"})


async def test_a_soak_sends_its_throttle_episode_and_verdict(tmp_path: Path, receiver: Receiver) -> None:
    """The whole wiring: a soak over the recorded H200 burn with the sink on; secrets leave the env."""
    recording = RECORDING
    over = {
        "run.duration": "6s",
        "telemetry.collectors": ["engine", "gpu"],
        "telemetry.gpu_recording": str(recording),
        "telemetry.gpu_recording_speed": 40.0,
        "telemetry.gpu_fast_interval": "25ms",
        "telemetry.gpu_slow_interval": "250ms",
        "sinks.webhook.enabled": True,
        "sinks.webhook.url": receiver.url,
        "sinks.webhook.interval": "0.5s",
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOAKD_WEBHOOK_TOKEN", SECRET)
        soak = Soak(stub_config(tmp_path, **over), engine_factory=lambda c, m, col: StubEngine(col))
        assert "SOAKD_WEBHOOK_TOKEN" not in os.environ
    result = await asyncio.wait_for(soak.run(), 60)
    names = [(a["labels"]["alertname"], "endsAt" in a) for a in receiver.alerts]
    assert names[0] == ("SoakdThrottling", False)
    assert ("SoakdThrottling", True) in names and names[-1] == ("SoakdRunPassed", False)
    assert all(h["Authorization"] == f"Bearer {SECRET}" for h, _ in receiver.posts)
    summary = json.loads((result.run_dir / "summary.json").read_text())["webhook"]
    assert summary["all_delivered"] is True and summary["backlog_lines"] == 0 and summary["firing"] == 0
    assert summary["alerts_sent"] == len(receiver.alerts)
    points = [s for s in iter_samples(result.run_dir / "spool") if s.measurement == "webhook"]
    assert points and int(points[-1].fields["alerts_sent"]) >= 1


def test_times_are_written_as_alertmanager_writes_them() -> None:
    from soakd.sinks.webhook import rfc3339

    base = 1_796_000_000 * 10**9
    assert rfc3339(base + 591_050_123) == "2026-11-30T00:53:20.59105Z"  # Go's RFC3339Nano: no trailing 0
    assert rfc3339(base + 100_000_000) == "2026-11-30T00:53:20.1Z"
    assert rfc3339(base) == "2026-11-30T00:53:20Z"
    assert rfc3339(base + 999) == "2026-11-30T00:53:20Z"  # below a microsecond: not written


async def test_a_run_stopped_on_purpose_is_a_warning_not_a_page(tmp_path: Path, receiver: Receiver) -> None:
    run = Run(tmp_path)
    clock = ManualTime(1000.0)
    cfg = WebhookConfig(enabled=True, url=receiver.url, resend_interval=0.0)
    sink = WebhookSink(run.dir, make_sender(cfg, {}), cfg, clock=clock)
    run.verdict(passed=False, stopped=True)
    await sink.tick(5.0)
    run.verdict(passed=False)
    await sink.tick(5.0)
    # A stopped run that PASSed on the work done: still said to be stopped, not a plain PASS.
    run.verdict(passed=True, stopped=True, written=True)
    await sink.tick(5.0)
    # No verdict on disk (a full disk): neither PASS nor FAIL is claimed, and it pages.
    run.verdict(passed=False, written=False)
    await sink.tick(5.0)
    stopped, failed, stopped_pass, unwritten = receiver.alerts[-4:]
    assert (stopped["labels"]["alertname"], stopped["labels"]["severity"]) == ("SoakdRunStopped", "warning")
    assert "stopped by a signal" in stopped["annotations"]["description"]
    assert (failed["labels"]["alertname"], failed["labels"]["severity"]) == ("SoakdRunFailed", "critical")
    assert (
        stopped_pass["labels"]["alertname"] == "SoakdRunStopped"
        and stopped_pass["labels"]["verdict"] == "PASS"
    )
    assert "PASS (stopped by a signal)" in stopped_pass["annotations"]["description"]
    labels = unwritten["labels"]
    assert (labels["alertname"], labels["severity"], labels["verdict"]) == (
        "SoakdVerdictNotWritten",
        "critical",
        "NOT WRITTEN",
    )
    await sink.aclose()
