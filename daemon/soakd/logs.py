"""structlog set-up: readable lines on a terminal, JSON lines in a pipe, journal fields under journald.

Under systemd (stderr connected to the journal, `JOURNAL_STREAM`) each line goes to journald's native
socket with its keys as journal fields (`RUN_ID`, `EVENT`, `KIND`, `PRIORITY`, ...), so
`journalctl RUN_ID=...` selects one run. The native protocol is sent by hand (KEY=VALUE lines in one
datagram; a value with a newline length-prefixed): the library that wraps libsystemd for this is a
compiled extension (glibc >= 2.34 wheels) that reports no failed send, and a line journald does not
take must not vanish: it goes to stderr instead, as a prefixed JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import struct
import sys
from collections.abc import MutableMapping
from typing import Any, Literal

import structlog

from soakd.redact import redact_text

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# journald's priorities (syslog's numbers); also the "<N>" prefix of a line journald reads from stderr.
_SYSLOG = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}
JOURNAL_SOCKET = "/run/systemd/journal/socket"

LogFormat = Literal["auto", "console", "json", "journald"]
LOG_FORMATS: tuple[LogFormat, ...] = ("auto", "console", "json", "journald")


def _redact(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Every string in a log line with its URLs redacted (an error quoting a server's URL with its
    credentials, a traceback): the last stop before the journal."""
    for key, value in event_dict.items():
        if isinstance(value, str) and "://" in value:
            event_dict[key] = redact_text(value)
    return event_dict


def under_journald() -> bool:
    """Whether stderr is the journal stream systemd connected (JOURNAL_STREAM names its device and inode,
    so a child whose stderr was redirected elsewhere is not fooled by the inherited variable)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return f"{st.st_dev}:{st.st_ino}" == f"{dev}:{ino}"


def resolve_format(requested: LogFormat) -> LogFormat:
    if requested != "auto":
        return requested
    if under_journald():
        return "journald"
    isatty = getattr(sys.stderr, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


_FIELD = re.compile(r"[^A-Z0-9_]")
# Fields soakd sets itself or journald gives meaning to: a key of that name is kept as SOAKD_<NAME>
# (an event's `message` key is SOAKD_MESSAGE beside the line's MESSAGE).
_RESERVED = frozenset(
    {"MESSAGE", "MESSAGE_ID", "PRIORITY", "SYSLOG_IDENTIFIER", "SYSLOG_FACILITY", "SYSLOG_PID", "EVENT"}
)
_RESERVED_PREFIXES = ("CODE_", "ERRNO", "COREDUMP", "OBJECT_", "INVOCATION_ID", "DOCUMENTATION")


def journal_fields(event_dict: MutableMapping[str, Any]) -> list[tuple[str, str]]:
    """A log event as journal fields: MESSAGE (the event and its keys, readable), PRIORITY,
    SYSLOG_IDENTIFIER, and every key upper-cased (`run_id` -> RUN_ID, `event` -> EVENT)."""
    level = str(event_dict.get("level", "info"))
    event = str(event_dict.get("event", ""))
    rest = {k: v for k, v in event_dict.items() if k not in ("event", "level", "timestamp")}
    text = " ".join(f"{k}={_value(v)}" for k, v in rest.items() if k not in ("run_id", "host"))
    fields = [
        ("MESSAGE", f"{event} {text}".strip()),
        ("PRIORITY", str(_SYSLOG.get(level, 6))),
        ("SYSLOG_IDENTIFIER", "soakd"),
        ("EVENT", event),
    ]
    for key, value in rest.items():
        name = _FIELD.sub("_", str(key).upper())
        if not name or not name[0].isalpha():
            name = f"F_{name}"
        if name in _RESERVED or name.startswith(_RESERVED_PREFIXES):
            name = f"SOAKD_{name}"
        fields.append((name[:64], _value(value)))
    return fields


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str, separators=(",", ":"))


def encode_journal(fields: list[tuple[str, str]]) -> bytes:
    """journald's native datagram: `KEY=value\\n`, or for a value with a newline `KEY\\n`, its length as
    a 64-bit little-endian integer, the value and `\\n`."""
    out = bytearray()
    for key, value in fields:
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class _Journal:
    """Sends events to journald; `send` returns False when journald did not take one."""

    def __init__(self, path: str | None = None) -> None:
        self._path = path or JOURNAL_SOCKET
        self._sock: socket.socket | None = None

    def send(self, event_dict: MutableMapping[str, Any]) -> bool:
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto(encode_journal(journal_fields(event_dict)), self._path)
        except OSError:
            # Gone, full, or a line over the datagram limit: the caller writes it to stderr instead.
            return False
        return True


class _Renderer:
    """The last processor: the line for stderr, or (journald) nothing when journald took the event."""

    def __init__(self, fmt: LogFormat, journal: _Journal | None = None) -> None:
        self._fmt = fmt
        self._journal = journal
        self._json = structlog.processors.JSONRenderer(sort_keys=False)
        isatty = getattr(sys.stderr, "isatty", None)
        colors = isatty is not None and bool(isatty())
        self._console = structlog.dev.ConsoleRenderer(colors=colors) if fmt == "console" else None

    def __call__(self, logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
        if self._console is not None:
            return str(self._console(logger, name, event_dict))
        if self._journal is not None:
            if self._journal.send(event_dict):
                raise structlog.DropEvent
            level = str(event_dict.get("level", "info"))
            return f"<{_SYSLOG.get(level, 6)}>{self._text(logger, name, event_dict)}"
        return self._text(logger, name, event_dict)

    def _text(self, logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
        out = self._json(logger, name, event_dict)
        return out.decode() if isinstance(out, bytes) else out


def configure(level: str = "info", *, fmt: LogFormat = "auto") -> LogFormat:
    """Configure structlog for the process (stderr: stdout stays for results); returns the format used."""
    used = resolve_format(fmt)
    render = _Renderer(used, _Journal() if used == "journald" else None)
    # The console renderer draws tracebacks itself; the others carry them as one text field.
    exc: list[Any] = [] if used == "console" else [structlog.processors.format_exc_info]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *exc,
            _redact,
            render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        # sys.stderr is looked up per logger, not bound once, so a replaced stream is followed.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(render, level, exc)
    return used


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler that writes to whatever sys.stderr is now (as the structlog logger above does), and
    writes nothing for a record the journal took."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
        except structlog.DropEvent:
            return
        try:
            self.stream.write(msg + self.terminator)
            self.flush()
        except Exception:  # noqa: BLE001  (logging's own contract: a failed emit is handled, not raised)
            self.handleError(record)


def _route_stdlib(render: Any, level: str, exc: list[Any]) -> None:
    """Libraries that log through `logging` (APScheduler's skipped and failed jobs, with their
    tracebacks) come out as the same lines, not as bare text between them. vLLM keeps its own
    handlers (it does not propagate to the root logger)."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *exc,
            _redact,
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, render],
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    root.addHandler(handler)
    # Library chatter below a warning (APScheduler's "Added job ...") stays out of the journal.
    root.setLevel(max(logging.WARNING, _LEVELS.get(level, logging.INFO)))


def bind(**keys: Any) -> None:
    """Bind process-wide keys (run_id, host) to every later log line."""
    structlog.contextvars.bind_contextvars(**keys)
