"""Private files of a run: created 0600 whatever the process umask, replaced atomically."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_private(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Replace `path` with `data` so a reader sees the old or the whole new content, never half; the
    file is created 0600 (its directory decides who may reach it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def open_private_append(path: Path) -> int:
    """A file descriptor appending to `path`, created 0600 if new."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
