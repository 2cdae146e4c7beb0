"""Critical events as alerts, POSTed to an Alertmanager or any webhook from a cursor over the spool.

Every event reaches the spool first. This sink reads the spool with the InfluxDB forwarder's machinery
(soakd.sinks.forwarder.Forwarder: a persisted cursor, backoff while the receiver is down, the backlog,
resume after a crash), keeps the `events` lines of the configured kinds and the run's closing `run`
point, and turns them into alerts (RULES):

- an episode (throttle_enter ... throttle_leave, spec_drift ... spec_drift_cleared, spool_degraded ...
  spool_recovered, sink_outage ... sink_backfill) fires an alert at its start and resolves the SAME
  labels with `endsAt` at its end; while it lasts it is sent again every `resend_interval`, because an
  Alertmanager resolves an alert it has not heard of for `resolve_timeout` (5m by default);
- a one-shot event (engine_failed, gpu_xid, ...) fires once without `endsAt`: the receiver expires it;
- the `run` point sends the verdict (FAIL critical, PASS info) and resolves every episode still open;
  `run_start` / `run_resume` resolve the ones a crash left open (the new process detects afresh).

Two payloads: "alertmanager" is Alertmanager's `POST /api/v2/alerts` body (an array of postableAlert);
"webhook" is what Alertmanager's own webhook_config receiver sends (version "4", status, alerts[] with
fingerprints, groupLabels, commonLabels, ...), for receivers written against that.

Delivery is at least once, never lost: the open episodes are saved (ALERTS_FILE) after a batch's POSTs
were accepted, then the cursor (STATE_FILE); a crash between the two, or a batch whose later POST
failed, sends the batch's alerts again. Payloads depend only on the spool's lines and the config, so a
repeat is the same bytes: Alertmanager merges it (same labels, same startsAt), and a webhook receiver
can drop it by (fingerprint, status, startsAt, endsAt). A payload the receiver refuses with 400 or 422
(a retry cannot fix it) is kept in REJECTED_FILE and the cursor moves on; any other failure is retried.

Over 500 lines because episode tracking, the Alertmanager payload and the sender are one delivery contract
(resolve what was fired, never twice).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Literal

import httpx
import structlog

from soakd import __version__
from soakd.config import WebhookConfig
from soakd.errors import ConfigError, SinkError
from soakd.files import open_private_append, read_json_no_follow, write_private
from soakd.metric import FieldValue, Sample, parse_line
from soakd.rundir import VERDICT_FILE
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.influx import read_secret

log = structlog.get_logger(__name__)

STATE_FILE = "webhook.json"
"""The cursor over the spool (the Forwarder's state file), beside the segments."""
ALERTS_FILE = "webhook-alerts.json"
"""The episodes open as of the cursor: re-sent while they last, resolved with their first startsAt."""
REJECTED_FILE = "webhook-rejected.jsonl"
"""Payloads the receiver refused (HTTP 400/422), one JSON document a line, for a person to inspect."""

Severity = Literal["critical", "warning", "info"]
Format = Literal["alertmanager", "webhook"]
EventCallback = Callable[[str, dict[str, float | int | str]], None]
SleepFn = Callable[[float], Awaitable[None]]

# Alertmanager's webhook payload says "not known" for endsAt with Go's zero time.
_ZERO_TIME = "0001-01-01T00:00:00Z"
_FNV_OFFSET = 14695981039346656037
_FNV_PRIME = 1099511628211
_MAX_TEXT = 1000
_MAX_REASON = 200
# Events that resolve every open episode: a new process whose detectors start afresh.
_RESTARTS = frozenset({"run_start", "run_resume"})


@dataclass(frozen=True, slots=True)
class Rule:
    """How one event kind becomes an alert."""

    alertname: str
    severity: Severity
    summary: str
    ends: str = ""
    """The kind that resolves it (an episode); empty for a one-shot alert."""
    failed_only: bool = False
    """Only events whose `ok` field is 0 (engine_rebuild: a rebuild that worked is no alert)."""


RULES: dict[str, Rule] = {
    "throttle_enter": Rule("SoakdThrottling", "warning", "throttling", ends="throttle_leave"),
    "spec_drift": Rule(
        "SoakdSpecDrift", "warning", "speculative acceptance drifted", ends="spec_drift_cleared"
    ),
    "spool_degraded": Rule("SoakdSpoolDegraded", "warning", "spool degraded", ends="spool_recovered"),
    "sink_outage": Rule("SoakdInfluxOutage", "warning", "InfluxDB unreachable", ends="sink_backfill"),
    "webhook_outage": Rule(
        "SoakdWebhookOutage", "warning", "alert webhook unreachable", ends="webhook_backfill"
    ),
    "sink_rejected": Rule("SoakdInfluxRejected", "warning", "InfluxDB refused a batch"),
    "engine_failed": Rule("SoakdEngineFailed", "critical", "engine failed for good"),
    "engine_error": Rule("SoakdEngineStartFailed", "critical", "engine did not start"),
    "engine_restart": Rule("SoakdEngineRestarted", "warning", "engine died and was restarted"),
    "engine_rebuild": Rule("SoakdEngineRebuildFailed", "warning", "engine rebuild failed", failed_only=True),
    "replay_error": Rule("SoakdReplayError", "critical", "replay ended early"),
    "gpu_xid": Rule("SoakdGpuXid", "critical", "GPU XID error"),
    # A soak's figures are the engine's alone only while no other process computes on its GPU.
    "cotenant_enter": Rule("SoakdGpuShared", "warning", "another process on the GPU", ends="cotenant_leave"),
    "gpu_error": Rule("SoakdGpuError", "critical", "GPU error"),
}
_ENDS = {rule.ends: kind for kind, rule in RULES.items() if rule.ends}
# Event fields that tell one instance of an alert from another (which GPU, the host's CPUs).
_IDENTITY = ("gpu", "scope")
# Event fields worth a line of their own in the alert (annotations: text, never identity).
_DETAILS = ("reasons", "reason", "xid", "clock_ratio", "state", "downtime_s", "pids", "foreign_mem_bytes")


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert as sent: identity (labels), text (annotations), start and, once known, end."""

    labels: dict[str, str]
    annotations: dict[str, str]
    starts_ns: int
    ends_ns: int | None = None

    @property
    def fingerprint(self) -> str:
        """The label set's id, as Alertmanager computes it (Prometheus' LabelSet.Fingerprint: FNV-1a 64
        over the sorted names and values, each followed by 0xff): an alert is identified by its labels."""
        h = _FNV_OFFSET
        for name, value in sorted(self.labels.items()):
            for part in (name, value):
                for byte in part.encode("utf-8") + b"\xff":
                    h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
        return f"{h:016x}"

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "labels": self.labels,
            "annotations": self.annotations,
            "starts_ns": self.starts_ns,
        }
        if self.ends_ns is not None:
            doc["ends_ns"] = self.ends_ns
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Alert:
        labels, annotations = doc["labels"], doc["annotations"]
        starts, ends = doc["starts_ns"], doc.get("ends_ns")
        if not (_str_map(labels) and _str_map(annotations) and isinstance(starts, int)):
            raise ValueError("not an alert")
        if ends is not None and not isinstance(ends, int):
            raise ValueError("not an alert")
        return cls(dict(labels), dict(annotations), starts, ends)


def _str_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def rfc3339(time_ns: int) -> str:
    """UTC RFC 3339 to the microsecond, from Unix nanoseconds, written as Alertmanager (Go's
    RFC3339Nano) writes it: no trailing zeros in the fraction, no fraction at all on a whole second, so
    a payload of ours and Alertmanager's own notification carry the same string for the same time."""
    seconds, micros = divmod(time_ns // 1000, 1_000_000)
    moment = datetime.fromtimestamp(seconds, UTC)
    fraction = f"{micros:06d}".rstrip("0")
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + (f".{fraction}" if fraction else "") + "Z"


def _label(value: FieldValue) -> str:
    # Event numbers are written as floats: GPU 0 is 0.0 in the spool and "0" in a label.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


class AlertBook:
    """Turns spool samples into alerts and keeps the open episodes (a pure fold: no I/O)."""

    def __init__(
        self,
        kinds: Iterable[str],
        severity: Mapping[str, Severity] | None = None,
        open_alerts: Mapping[str, Alert] | None = None,
        failed_criteria: Callable[[str], str] | None = None,
    ) -> None:
        self.kinds = frozenset(kinds)
        self._failed_criteria = failed_criteria
        """run_id -> the names of the criteria its verdict failed (verdict.json), for the FAIL alert."""
        self.severity = dict(severity or {})
        self.relevant = (
            self.kinds | _RESTARTS | {RULES[k].ends for k in self.kinds if k in RULES and RULES[k].ends}
        )
        """The event kinds `fold` acts on: the rest need not be parsed."""
        self.open: dict[str, Alert] = dict(open_alerts or {})

    def fold(self, samples: Iterable[Sample]) -> tuple[list[Alert], dict[str, Alert]]:
        """The alerts `samples` call for, in order, and the open episodes after them; `self.open` is
        left as it was (the caller commits once the alerts are delivered)."""
        state = dict(self.open)
        out: list[Alert] = []
        for s in samples:
            if s.measurement == "run":
                self._close_all(state, s.time_ns, "the run ended", out)
                if "verdict" in self.kinds:
                    out.append(self._verdict(s))
                continue
            kind = s.tags.get("kind", "")
            if kind in _RESTARTS:
                self._close_all(state, s.time_ns, "soakd restarted; the detectors start afresh", out)
                continue
            opener = _ENDS.get(kind)
            if opener is not None:
                if opener in self.kinds:
                    ended = state.pop(self._alert(opener, s).fingerprint, None)
                    if ended is not None:
                        out.append(_resolved(ended, s.time_ns, str(s.fields.get("message", ""))))
                continue
            rule = RULES.get(kind)
            if rule is None or kind not in self.kinds:
                continue
            if rule.failed_only and s.fields.get("ok") not in (0, 0.0, False):
                continue
            alert = self._alert(kind, s)
            if rule.ends:
                before = state.get(alert.fingerprint)
                if before is not None:  # the same episode again (recovering, then throttled): its start
                    alert = replace(alert, starts_ns=before.starts_ns)
                state[alert.fingerprint] = alert
            out.append(alert)
        return out, state

    def _alert(self, kind: str, s: Sample) -> Alert:
        rule = RULES[kind]
        severity = self.severity.get(kind, rule.severity)
        if kind == "gpu_xid" and s.fields.get("benign") is True and kind not in self.severity:
            severity = "info"
        labels = {
            "alertname": rule.alertname,
            "severity": severity,
            "kind": kind,
            "run_id": s.tags.get("run_id", ""),
            "host": s.tags.get("host", ""),
        }
        who = ""
        for name in _IDENTITY:
            if name in s.fields:
                labels[name] = _label(s.fields[name])
                who = f"GPU {labels[name]} " if name == "gpu" else f"{labels[name]} "
        annotations = {
            "summary": _clip(f"{who}{rule.summary} on {labels['host']} (soak {labels['run_id']})"),
            "description": _clip(str(s.fields.get("message", ""))),
        }
        for name in _DETAILS:
            value = s.fields.get(name)
            if value is not None and value != "":
                annotations[name] = _clip(_label(value))
        return Alert({k: v for k, v in labels.items() if v}, annotations, s.time_ns)

    def _verdict(self, s: Sample) -> Alert:
        # A point without `verdict_written` is from a soakd that wrote it only with its verdict.
        written = s.fields.get("verdict_written", 1) in (1, True)
        passed = written and s.fields.get("passed") in (1, True)
        stopped = written and s.fields.get("stopped") in (1, True)
        # No verdict on disk claims neither PASS nor FAIL; a stopped run's PASS is of the work done.
        word = "NOT WRITTEN" if not written else "PASS" if passed else "FAIL"
        severity: Severity = (
            "info"
            if passed and not stopped
            else "warning"
            if stopped
            else self.severity.get("verdict", "critical")
        )
        alertname = (
            "SoakdVerdictNotWritten"
            if not written
            else "SoakdRunStopped"
            if stopped
            else "SoakdRunPassed"
            if passed
            else "SoakdRunFailed"
        )
        labels = {
            "alertname": alertname,
            "severity": severity,
            "kind": "verdict",
            "verdict": word,
            "run_id": s.tags.get("run_id", ""),
            "host": s.tags.get("host", ""),
        }

        def num(name: str) -> float:
            value = s.fields.get(name, 0)
            return float(value) if isinstance(value, int | float) else 0.0

        description = (
            f"soak {labels['run_id']}: {word}{' (stopped by a signal)' if stopped else ''}"
            f"{' (the disk refused verdict.json)' if not written else ''} after "
            f"{num('ran_s'):.0f} of {num('planned_s'):.0f} s; "
            f"{num('completed'):.0f} of {num('requests'):.0f} requests completed, {num('failed'):.0f} failed"
            + (f", {num('incomplete'):.0f} left at the end" if num("incomplete") else "")
        )
        annotations = {
            "summary": f"soak {word} on {labels['host']} (soak {labels['run_id']})",
            "description": description,
        }
        failed = self._failed_criteria(labels["run_id"]) if self._failed_criteria and not passed else ""
        if failed:
            annotations["failed_criteria"] = _clip(failed)
        return Alert({k: v for k, v in labels.items() if v}, annotations, s.time_ns)

    @staticmethod
    def _close_all(state: dict[str, Alert], time_ns: int, why: str, out: list[Alert]) -> None:
        for key in list(state):
            out.append(_resolved(state.pop(key), time_ns, why))


def _resolved(alert: Alert, time_ns: int, description: str) -> Alert:
    annotations = dict(alert.annotations)
    if description:
        annotations["description"] = _clip(description)
    # An end before the start (the wall clock set back) would be refused by Alertmanager.
    return replace(alert, annotations=annotations, ends_ns=max(time_ns, alert.starts_ns))


class _Refused(SinkError):
    """The receiver refused the payload itself (HTTP 400/422): sending it again cannot help."""


@dataclass(slots=True)
class Counters:
    """What the sink sent, for the `webhook` series and summary.json."""

    alerts_sent: int = 0
    posts: int = 0
    resends: int = 0
    alerts_rejected: int = 0
    failures: int = 0
    events_skipped: int = 0
    """`events` lines that could not be parsed (a damaged spool)."""
    last_error: str = ""


class WebhookSender:
    """The HTTP side: payloads in the configured format, auth, bounded timeouts; raises SinkError."""

    def __init__(
        self,
        cfg: WebhookConfig,
        *,
        token: str = "",
        password: str = "",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = cfg.url
        self.format: Format = cfg.format
        self.receiver = cfg.receiver
        self.external_url = cfg.external_url
        self.max_alerts = cfg.max_alerts
        headers = {"Content-Type": "application/json", "User-Agent": f"soakd/{__version__}"}
        auth = None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        elif cfg.username:
            auth = httpx.BasicAuth(cfg.username, password)
        # Redirects are not followed: they would carry the Authorization header to another place.
        self._client = httpx.AsyncClient(
            timeout=cfg.timeout, headers=headers, auth=auth, transport=transport, follow_redirects=False
        )

    def payloads(self, alerts: Sequence[Alert]) -> list[bytes]:
        """The request bodies for `alerts`, at most `max_alerts` each; the same alerts give the same bytes."""
        out = []
        for i in range(0, len(alerts), self.max_alerts):
            chunk = alerts[i : i + self.max_alerts]
            doc: Any = (
                [self._postable(a) for a in chunk] if self.format == "alertmanager" else self._webhook(chunk)
            )
            out.append(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8"))
        return out

    def _postable(self, alert: Alert) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "labels": alert.labels,
            "annotations": alert.annotations,
            "startsAt": rfc3339(alert.starts_ns),
        }
        if alert.ends_ns is not None:
            doc["endsAt"] = rfc3339(alert.ends_ns)
        if self.external_url:
            doc["generatorURL"] = self.external_url
        return doc

    def _webhook(self, alerts: Sequence[Alert]) -> dict[str, Any]:
        items = [
            {
                "status": "firing" if a.ends_ns is None else "resolved",
                "labels": a.labels,
                "annotations": a.annotations,
                "startsAt": rfc3339(a.starts_ns),
                "endsAt": _ZERO_TIME if a.ends_ns is None else rfc3339(a.ends_ns),
                "generatorURL": self.external_url,
                "fingerprint": a.fingerprint,
            }
            for a in alerts
        ]
        common_labels = _common([a.labels for a in alerts])
        common_annotations = _common([a.annotations for a in alerts])
        group = {"run_id": common_labels["run_id"]} if "run_id" in common_labels else {}
        key = ",".join(f'{k}="{v}"' for k, v in sorted(group.items()))
        return {
            "version": "4",
            "groupKey": f"{{}}:{{{key}}}",
            "truncatedAlerts": 0,
            "status": "firing" if any(a.ends_ns is None for a in alerts) else "resolved",
            "receiver": self.receiver,
            "groupLabels": group,
            "commonLabels": common_labels,
            "commonAnnotations": common_annotations,
            "externalURL": self.external_url,
            "alerts": items,
        }

    async def post(self, body: bytes) -> None:
        """POST one payload; SinkError when it was not accepted (_Refused for a 400/422)."""
        try:
            response = await self._client.post(self.url, content=body)
        except httpx.HTTPError as err:
            raise SinkError(
                f"webhook: {type(err).__name__}: {self._scrub(str(err)) or 'no detail'}"
            ) from None
        if response.is_success:
            return
        text = " ".join(response.text.split())[:_MAX_REASON]
        reason = f"webhook: HTTP {response.status_code}: {self._scrub(text)}".rstrip(": ")
        if response.status_code in (400, 422):
            raise _Refused(reason)
        raise SinkError(reason)

    def _scrub(self, text: str) -> str:
        # The URL may carry credentials (user:password@, ?token=); an error message never repeats it.
        return text.replace(self.url, "<url>")

    async def aclose(self) -> None:
        await self._client.aclose()


def _common(maps: Sequence[Mapping[str, str]]) -> dict[str, str]:
    if not maps:
        return {}
    first = maps[0]
    return {k: v for k, v in sorted(first.items()) if all(m.get(k) == v for m in maps[1:])}


def make_sender(cfg: WebhookConfig, env: Mapping[str, str]) -> WebhookSender:
    """The sender for `cfg`, its secrets read now (systemd credential, else environment variable, never
    logged): a bearer token (`token_env`) or basic auth (`username` and `password_env`), not both."""
    token = read_secret(cfg.token_env, env, key="sinks.webhook.token_env")
    password = read_secret(cfg.password_env, env, key="sinks.webhook.password_env") if cfg.username else ""
    if token and cfg.username:
        raise ConfigError(
            f"a bearer token ({cfg.token_env}) and basic auth both set: use one", key="sinks.webhook.username"
        )
    return WebhookSender(cfg, token=token, password=password)


class _AlertWriter:
    """A LineWriter for the Forwarder: the alerts a batch of spool lines calls for, delivered or raised."""

    def __init__(self, sink: WebhookSink) -> None:
        self._sink = sink

    async def write(self, lines: Sequence[str]) -> None:
        # Most batches hold no alert and would never await: yield once per batch, so that a long
        # backlog (the final drain included) never holds the event loop for more than one batch.
        await asyncio.sleep(0)
        await self._sink._deliver(lines)

    async def ping(self) -> str:
        return "unknown"

    async def aclose(self) -> None:
        await self._sink.sender.aclose()


class WebhookSink:
    """Reads the spool from a cursor (a Forwarder), sends what the AlertBook makes of it, re-sends
    the open episodes every `resend_interval_s`; its health is the `webhook` series."""

    def __init__(
        self,
        spool_dir: Path,
        sender: WebhookSender,
        cfg: WebhookConfig,
        *,
        on_event: EventCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: SleepFn = asyncio.sleep,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.spool_dir = spool_dir
        self.sender = sender
        self.counters = Counters()
        default_resend = 60.0 if cfg.format == "alertmanager" else 4 * 3600.0
        self.resend_interval_s = default_resend if cfg.resend_interval is None else cfg.resend_interval
        self._clock = clock
        self._on_event = on_event
        self._alerts_path = spool_dir / ALERTS_FILE
        severity: dict[str, Severity] = {str(k): v for k, v in cfg.severity.items()}
        self.book = AlertBook(
            cfg.kinds, severity, self._load_open(), failed_criteria=partial(failed_criteria, spool_dir.parent)
        )
        # When each alert was last delivered (monotonic): an open episode goes again once this is
        # `resend_interval_s` old. Empty after a restart, so the open episodes go out at the first tick.
        self._sent_at: dict[str, float] = {}
        # After a failed re-send, the next waits this long (a receiver that hangs would hold every tick).
        self._resend_after = float("-inf")
        self._backoff_max_s = backoff_max_s
        self._lock = asyncio.Lock()

        def renamed(kind: str, fields: dict[str, float | int | str]) -> None:
            # The forwarder's outage/backfill events, told apart from InfluxDB's.
            if self._on_event is not None:
                self._on_event(kind.replace("sink_", "webhook_", 1), fields)

        self.forwarder = Forwarder(
            spool_dir,
            _AlertWriter(self),
            cfg.batch_lines,
            state_path=spool_dir / STATE_FILE,
            on_event=renamed,
            sleep=sleep,
            clock=clock,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
        )

    # -- driving ------------------------------------------------------------------------------------

    async def tick(self, budget_s: float) -> None:
        """One scheduler run: deliver for up to `budget_s` (backing off while the receiver is down),
        then re-send the open episodes if they are due and the receiver answers."""
        async with self._lock:
            deadline = self._clock() + budget_s
            while await self.forwarder.step() > 0 and self._clock() < deadline:
                pass
            if self.forwarder.consecutive_failures == 0:
                await self.resend_if_due()

    async def drain(self, timeout_s: float) -> bool:
        """Deliver until caught up (True) or `timeout_s` passed (False): the run's last alerts."""
        # After a tick still in flight (the scheduler's shutdown does not wait for it): one reader of
        # the cursor at a time, or a batch could go twice.
        async with self._lock:
            return await self.forwarder.drain(timeout_s)

    async def resend_if_due(self) -> int:
        """POST again the open episodes not sent for `resend_interval_s`; how many."""
        now = self._clock()
        if not self.book.open or self.resend_interval_s <= 0 or now < self._resend_after:
            return 0
        alerts = [
            a
            for key, a in self.book.open.items()
            if now - self._sent_at.get(key, float("-inf")) >= self.resend_interval_s
        ]
        if not alerts:
            return 0
        try:
            await self._post(alerts)
        except SinkError as err:
            # The next tick tries again; the cursor is not involved (these alerts were delivered once).
            self.counters.failures += 1
            self.counters.last_error = str(err)
            self._resend_after = now + min(self.resend_interval_s, self._backoff_max_s)
            log.warning("webhook_resend_failed", alerts=len(alerts), reason=str(err))
            return 0
        self.counters.resends += 1
        return len(alerts)

    async def aclose(self) -> None:
        await self.sender.aclose()

    # -- state --------------------------------------------------------------------------------------

    def series_fields(self, now_ns: int | None = None) -> dict[str, FieldValue]:
        """The `webhook` point: backlog of the spool not yet read for alerts, outage, what was sent."""
        fwd = self.forwarder
        c = self.counters
        return {
            "backlog_lines": fwd.backlog_lines(),
            "backlog_bytes": fwd.backlog_bytes(),
            "backlog_age_s": fwd.backlog_age_s(now_ns),
            "outage_s": fwd.outage_s,
            "consecutive_failures": fwd.consecutive_failures,
            "failures": fwd.failures + c.failures,
            "alerts_sent": c.alerts_sent,
            "alerts_rejected": c.alerts_rejected,
            "posts": c.posts,
            "resends": c.resends,
            "firing": len(self.book.open),
        }

    def summary(self) -> dict[str, Any]:
        """For summary.json."""
        fields = self.series_fields()
        return {
            **{k: v for k, v in fields.items() if k not in ("backlog_bytes", "backlog_age_s")},
            "events_skipped": self.counters.events_skipped,
            "last_error": self.counters.last_error or self.forwarder.last_error,
        }

    # -- internals ----------------------------------------------------------------------------------

    async def _deliver(self, lines: Sequence[str]) -> None:
        samples = list(self._samples(lines))
        if not samples:
            return
        alerts, state = self.book.fold(samples)
        if alerts:
            try:
                await self._post(alerts)
            except SinkError as err:
                self.counters.last_error = str(err)
                raise
        if state != self.book.open:
            self.book.open = state
            self._save_open()

    async def _post(self, alerts: Sequence[Alert]) -> None:
        for body in self.sender.payloads(alerts):
            try:
                await self.sender.post(body)
            except _Refused as err:
                self._set_aside(body, str(err))
                continue
            self.counters.posts += 1
        self.counters.alerts_sent += len(alerts)
        now = self._clock()
        for a in alerts:
            self._sent_at[a.fingerprint] = now

    def _samples(self, lines: Sequence[str]) -> Iterable[Sample]:
        wanted = self.book.relevant
        for line in lines:
            # Cheap string tests first: nearly every line is telemetry or an event of no interest here,
            # and parsing an event (quoted, escaped text) costs ~0.1 ms.
            if line.startswith("events,"):
                at = line.find(",kind=")
                end = line.find(",", at + 6) if at >= 0 else -1
                if at < 0 or line[at + 6 : end if end >= 0 else line.find(" ", at)] not in wanted:
                    continue
            elif not line.startswith("run,"):
                continue
            try:
                yield parse_line(line)
            except ValueError as err:
                self.counters.events_skipped += 1
                log.warning("webhook_line_unreadable", error=str(err)[:_MAX_REASON])

    def _set_aside(self, body: bytes, reason: str) -> None:
        alerts = body.count(b'"labels"')
        self.counters.alerts_rejected += alerts
        record = json.dumps({"reason": reason, "payload": json.loads(body)}, separators=(",", ":"))
        kept_in = str(self.spool_dir / REJECTED_FILE)
        try:
            fd = open_private_append(self.spool_dir / REJECTED_FILE)
            try:
                os.write(fd, record.encode("utf-8") + b"\n")
            finally:
                os.close(fd)
        except OSError as err:
            kept_in = "nowhere (the events are still in the spool)"
            log.error("webhook_rejected_not_kept", error=str(err))
        log.error("webhook_rejected", alerts=alerts, reason=reason, kept_in=kept_in)

    def _load_open(self) -> dict[str, Alert]:
        try:
            doc = json.loads(self._alerts_path.read_text(encoding="utf-8"))
            alerts = [Alert.from_dict(d) for d in doc["open"]]
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as err:
            # Episodes open before the crash are then not resolved by this process; the receiver expires
            # them (Alertmanager: resolve_timeout after the last send).
            log.warning("webhook_alerts_unreadable", path=str(self._alerts_path), error=str(err)[:200])
            return {}
        return {a.fingerprint: a for a in alerts}

    def _save_open(self) -> None:
        doc = {"open": [a.to_dict() for a in self.book.open.values()]}
        try:
            write_private(self._alerts_path, json.dumps(doc).encode("utf-8"), fsync=True)
        except OSError as err:
            # Kept in memory; a restart resends from the last saved state (at least once, as always).
            log.error("webhook_alerts_not_saved", error=str(err))


def failed_criteria(run_dir: Path, run_id: str) -> str:
    """The criteria the run's verdict.json says failed, comma-separated ("" when unreadable or none)."""
    try:
        doc = read_json_no_follow(run_dir / VERDICT_FILE)
        if doc.get("run_id") != run_id:
            return ""
        return ", ".join(str(c["name"]) for c in doc["criteria"] if not c["passed"])
    # The alert goes out without the detail rather than not at all.
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""


class WebhookHealth:
    """Collector `webhook`: the sink's backlog, outage and counters, one point per collector run."""

    name = "webhook"

    def __init__(self, sink: WebhookSink) -> None:
        self._sink = sink

    def collect(self, now_ns: int) -> list[Sample]:
        return [Sample("webhook", self._sink.series_fields(now_ns), now_ns)]

    def close(self) -> None:
        return None
