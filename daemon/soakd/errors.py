"""The error hierarchy of soakd.

SoakdError                      anything soakd raises on purpose
├── InputError                  bad input from the user: one line, exit code 2, nothing written
│   ├── ConfigError             config.toml: names file, line and key
│   ├── TraceError              a trace file: names file, line and field
│   └── UsageError              command-line arguments
├── EngineError                 the inference engine failed to start or died
├── HarnessError                a part of soakd itself that drives the engine failed (the sender process)
├── CollectorError              one collector failed one collection (the runner contains it)
└── SinkError                   a write to a sink failed (the batch is kept and retried)
"""

from __future__ import annotations

from pathlib import Path

# The exit codes of soakd's commands (README, "Exit codes"); a verdict records the one its run returns.
EXIT_OK = 0
"""PASS, or a command that succeeded."""
EXIT_FAIL = 1
"""FAIL: a criterion did not hold (or a check that did not answer)."""
EXIT_INPUT = 2
"""Bad input: one line naming the file, line and key; nothing written."""
EXIT_ERROR = 3
"""Aborted: the run ended early on its own, its verdict could not be written, or an internal error."""
EXIT_STOPPED = 4
"""Stopped by a signal before its end (SIGINT, SIGTERM, SIGHUP): drained, verdict written."""


class SoakdError(Exception):
    """Base of every error soakd raises on purpose."""


class HarnessError(SoakdError):
    """A part of soakd that drives the engine failed (its sender process cannot be kept running): the
    replay ends, the engine is not blamed (no restart of it is spent)."""


class InputError(SoakdError):
    """Bad user input. `str(err)` is the one-line message printed before exiting with code 2."""

    def __init__(
        self,
        reason: str,
        *,
        file: str | Path | None = None,
        line: int | None = None,
        key: str | None = None,
    ) -> None:
        self.reason = reason
        self.file = str(file) if file is not None else None
        self.line = line
        self.key = key
        super().__init__(self._format())

    def _format(self) -> str:
        where = ""
        if self.file is not None:
            where = self.file + (f":{self.line}" if self.line is not None else "")
        what = f"{self.key}: " if self.key else ""
        return _one_line(f"{where}: {what}{self.reason}" if where else f"{what}{self.reason}")


def _one_line(text: str) -> str:
    """`text` with control characters escaped: a key read from the input may hold a newline."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ConfigError(InputError):
    """An invalid configuration file or value."""


class TraceError(InputError):
    """An invalid trace file or row."""


class UsageError(InputError):
    """Invalid command-line arguments."""


class EngineError(SoakdError):
    """The inference engine could not start, or failed while running."""


class CollectorError(SoakdError):
    """A collector could not collect this time; the runner logs it and goes on."""


class SinkError(SoakdError):
    """A sink could not take a batch; the batch stays in the spool and is retried."""


class SinkRejected(SinkError):
    """The sink answered that the data itself is wrong (HTTP 400: bad line, field type conflict).

    Retrying the same batch would block everything behind it forever; the forwarder sets it aside in
    the spool (rejected.lp) and reports it instead.
    """
