"""structlog set-up: JSON lines on stderr for journald, UTC timestamps, process-wide keys bound once."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from soakd.redact import redact_text

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# journald reads a "<N>" prefix as the syslog priority of the line.
_SYSLOG = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}


def _redact(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Every string in a log line with its URLs redacted (an error quoting a server's URL with its
    credentials, a traceback): the last stop before the journal."""
    for key, value in event_dict.items():
        if isinstance(value, str) and "://" in value:
            event_dict[key] = redact_text(value)
    return event_dict


def configure(level: str = "info", *, journald_prefix: bool = False) -> None:
    """Configure structlog for the process. Logs go to stderr so stdout stays for results."""

    class _PrefixedJSON:
        def __init__(self) -> None:
            self._json = structlog.processors.JSONRenderer(sort_keys=False)

        def __call__(self, logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
            text = str(self._json(logger, name, event_dict))
            if journald_prefix:
                return f"<{_SYSLOG.get(str(event_dict.get('level', 'info')), 6)}>{text}"
            return text

    render = _PrefixedJSON()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redact,
            render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        # sys.stderr is looked up per logger, not bound once, so a replaced stream is followed.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(render, level)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler that writes to whatever sys.stderr is now (as the structlog logger above does)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _route_stdlib(render: Any, level: str) -> None:
    """Libraries that log through `logging` (APScheduler's skipped and failed jobs, with their
    tracebacks) come out as the same JSON lines, not as bare text between them. vLLM keeps its own
    handlers (it does not propagate to the root logger)."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
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
