"""structlog set-up: JSON lines on stderr for journald, UTC timestamps, process-wide keys bound once."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# journald reads a "<N>" prefix as the syslog priority of the line.
_SYSLOG = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}


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

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _PrefixedJSON(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        # sys.stderr is looked up per logger, not bound once, so a replaced stream is followed.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )


def bind(**keys: Any) -> None:
    """Bind process-wide keys (run_id, host) to every later log line."""
    structlog.contextvars.bind_contextvars(**keys)
