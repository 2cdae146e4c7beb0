"""Keep the console (the terminal, the journal) for soakd, and give the engine's output its own file.

vLLM runs in-process and in child processes that inherit file descriptors 1 and 2: its warnings, torch's
FutureWarnings, the C++ runtime's NUMA notes and shutdown tracebacks all write there, from code soakd
does not control. So `detach()` moves soakd's own sys.stdout and sys.stderr onto duplicates of the
console's descriptors first; `route_engine_output(path)` then points descriptors 1 and 2 at the run's
engine log (children started afterwards inherit that), and `restore()` points them back. faulthandler
(PYTHONFAULTHANDLER=1 under systemd) is moved onto the console too, so a watchdog abort's traceback
stays in the journal.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import structlog

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Detached:
    stdout_fd: int
    """A duplicate of the console's stdout (fd 1 before routing)."""
    stderr_fd: int
    routed_to: Path | None = None
    showwarning: object = None


class _Holder:
    detached: _Detached | None = None


_held = _Holder()


def _text(fd: int, like: TextIO) -> TextIO:
    encoding = getattr(like, "encoding", None) or "utf-8"
    return open(fd, "w", buffering=1, encoding=encoding, errors="backslashreplace", closefd=False)


def detach() -> bool:
    """soakd's sys.stdout/sys.stderr onto their own descriptors; False (nothing changed) when they are not
    the process's fds 1 and 2 (a test capturing them, an embedding program)."""
    if _held.detached is not None:
        return True
    try:
        if sys.stdout.fileno() != 1 or sys.stderr.fileno() != 2:
            return False
    except (AttributeError, OSError, ValueError):
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    _state = _held.detached = _Detached(os.dup(1), os.dup(2))
    sys.stdout = _text(_state.stdout_fd, sys.stdout)
    sys.stderr = _text(_state.stderr_fd, sys.stderr)
    if faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    return True


def route_engine_output(path: Path) -> bool:
    """Descriptors 1 and 2 (what the engine's code and its children write to) onto `path`, appended;
    False when soakd's own streams were not detached (then nothing is moved)."""
    _state = _held.detached
    if _state is None:
        return False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    if _state.routed_to is None:
        # Python warnings raised in soakd's process by the engine's libraries (torch's FutureWarnings at
        # import) go with the engine's output, not onto the console.
        _state.showwarning = warnings.showwarning
        warnings.showwarning = _warning_to_engine_log
        log.info("engine_output", path=str(path))
    _state.routed_to = path
    return True


def _warning_to_engine_log(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    stream = sys.__stderr__
    if stream is not None:
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))
        stream.flush()


def restore() -> None:
    """Descriptors 1 and 2 back on the console (the engine stopped)."""
    _state = _held.detached
    if _state is None or _state.routed_to is None:
        return
    for stream in (sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    os.dup2(_state.stdout_fd, 1)
    os.dup2(_state.stderr_fd, 2)
    if callable(_state.showwarning):
        warnings.showwarning = _state.showwarning
    _state.routed_to = None
