"""A run folder has one owner: the process that runs or resumes it holds an exclusive lock on its
`.lock` file for its whole life, with its pid written inside.

Two `soakd run --resume` of one crashed run (a systemd restart racing one by hand) would otherwise both
take it up: requests journaled and recorded twice, two verdicts. The lock is taken before anything in the
folder is read (a resume) or right after the folder is made (a new run); a second process is refused with
the holder's pid (exit 2). `soakd report` never locks: it reads a live run's files as they are, read-only.

flock(2) locks belong to the open file description: the kernel drops the lock when the owner dies, even by
SIGKILL, so a crashed run is never left locked (a stale pid in the file means nothing without the lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from soakd.errors import InputError
from soakd.files import lstat_kind, open_no_follow
from soakd.rundir import LOCK_FILE, RUN_FILES, SPOOL_DIR
from soakd.sinks.spool import SEGMENT_RE

FORWARDER_STATE = "forwarder.json"
"""The forwarder's cursor in the spool (sinks.forwarder's default state path)."""

_HELD: dict[str, int] = {}
"""The run folders this process owns (real path -> the lock file's descriptor): taking one again in the
same process is a no-op (an in-process resume of a run it ran), never a refusal."""


class RunOwned(InputError):
    """The run folder is owned by another live process."""


def _holder(fd: int) -> str:
    """The pid the owner wrote, as text. The owner writes it just after locking: a pid read twice alike
    a moment apart is the owner's, not the one a crashed owner left ("unknown" if none settles)."""
    seen = ""
    for _ in range(25):
        time.sleep(0.02)
        with contextlib.suppress(OSError):
            raw = os.pread(fd, 32, 0).strip()
            now = raw.decode() if raw.isdigit() else ""
            if now and now == seen:
                return now
            seen = now
    return seen or "unknown"


def take(run_dir: Path, *, wait_s: float = 0.0) -> None:
    """Own `run_dir` for the rest of this process's life, or raise RunOwned naming the holder's pid. A
    `.lock` that is a symlink or not a regular file is refused (an InputError) and never followed.
    `wait_s`: how long to retry a held lock (a new run's folder, which a `--resume` may be looking at)."""
    key = os.path.realpath(run_dir)
    if key in _HELD:
        return
    path = run_dir / LOCK_FILE
    try:
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    except OSError as err:  # NotRegularFile (a link, a FIFO...) included: its strerror says which
        raise InputError(f"cannot own the run folder: {err.strerror}", file=path) from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() >= deadline:
                holder = _holder(fd)
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise InputError(f"cannot lock the run folder: {err.strerror}", file=path) from None
                raise RunOwned(
                    f"the run is owned by another soakd process (pid {holder}): one run folder, one "
                    "process; stop that one or wait for it to end",
                    file=run_dir,
                ) from None
            time.sleep(0.02)
    try:
        # One write of a fixed width: a reader sees the old pid or the new one, never a mix.
        os.pwrite(fd, f"{os.getpid():<20}\n".encode(), 0)
        os.ftruncate(fd, 21)
    except OSError:
        # The lock is what owns the folder; the pid is only what a refused process is told.
        pass
    _HELD[key] = fd


def owns(run_dir: Path) -> bool:
    """Whether this process owns `run_dir`."""
    return os.path.realpath(run_dir) in _HELD


def release(run_dir: Path) -> None:
    """Give `run_dir` up (a resume that found nothing to take up; tests)."""
    fd = _HELD.pop(os.path.realpath(run_dir), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def check_run_files(run_dir: Path, *, segments: bool = True, error: type[InputError] = InputError) -> None:
    """Refuse a run folder whose files soakd reads back are not its own: a symlink (its target would be
    read into a verdict or a report, or appended to) or anything but a regular file is an `error` naming
    it (exit 2), raised before any of them is read. `segments`: the spool's segments too (a resume, which
    appends to the spool; a report skips such a segment with a warning, as every spool reader does)."""
    spool = run_dir / SPOOL_DIR
    paths = [run_dir / name for name in RUN_FILES]
    try:
        spool_mode: int | None = spool.lstat().st_mode
    except FileNotFoundError:
        spool_mode = None
    if spool_mode is not None:
        if not stat.S_ISDIR(spool_mode):
            what = "a symlink" if stat.S_ISLNK(spool_mode) else "not a directory"
            raise error(f"refused: {what}; a run folder's files are never followed", file=spool)
        if segments:
            paths += sorted(p for p in spool.iterdir() if SEGMENT_RE.match(p.name))
        paths.append(spool / FORWARDER_STATE)
    for path in paths:
        kind = lstat_kind(path)
        if kind is not None:
            raise error(f"refused: {kind}; a run folder's files are never followed", file=path)
