"""The live-limit file, its one module: the two files between soakd and its scheduler class inside vLLM's
engine core (the limit soakd asks for, and the status the scheduler reports back: what the engine actually
applies), and the environment variable that names the first to the engine's processes.

soakd writes the limit file (`write_limit`: a decimal integer, or nothing for "as started"; only the
actuator calls it, policies/actuator.py). The scheduler reads it (`read_limit`) and writes the
status file, `<limit file>.engine`, as JSON when it starts and whenever the limit it enforces changes:
which vLLM attribute it moves (`max_num_running_reqs` on 0.26, `max_num_active_reqs` on 0.32; None when
this vLLM has neither, so the live limit is off), the start value, the limit in force and the running
count then. Events and run metadata quote this file, never the request. No vLLM import here: soakd's
own process reads these files too.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from soakd.files import write_private

ACTIVE_SEQS_ENV = "SOAKD_ACTIVE_SEQS_FILE"
"""Names the limit file to soakd's scheduler class (engine/sched.py) and to `reported_live`: set in the
environment the engine's processes inherit (`name_limit_file`)."""

STATUS_SUFFIX = ".engine"

# vLLM's live admission attribute, newest first: 0.32 splits `max_num_active_reqs` (admission) from
# `max_num_running_reqs` (runner size); 0.26 has only `max_num_running_reqs`, which gates admission too.
LIMIT_ATTRS: tuple[str, ...] = ("max_num_active_reqs", "max_num_running_reqs")


def status_path(limit_file: str | Path) -> Path:
    return Path(f"{limit_file}{STATUS_SUFFIX}")


def name_limit_file(path: Path | None, environ: MutableMapping[str, str] = os.environ) -> None:
    """Name the run's limit file in the environment the engine's processes inherit; None: the engine runs
    vLLM's own scheduler, and a name an earlier run in this process left there is removed."""
    if path is None:
        environ.pop(ACTIVE_SEQS_ENV, None)
    else:
        environ[ACTIVE_SEQS_ENV] = str(path)


def write_limit(path: Path, limit: int | None) -> None:
    """Replace the limit file atomically: the scheduler never reads half a number."""
    write_private(path, b"" if limit is None else str(int(limit)).encode())


def read_limit(path: str) -> int | None:
    """The limit in the file: None when it is empty, missing or not a positive integer."""
    try:
        with open(path, encoding="ascii") as f:  # noqa: PTH123 - hot path, no Path object per read
            text = f.read(32).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 1 << 31 else None


@dataclass(frozen=True, slots=True)
class EngineLimitStatus:
    """What the engine's scheduler reported last."""

    attr: str | None
    """The vLLM attribute moved live; None: this vLLM has none, the live limit is off."""
    start: int | None
    """The attribute's value as the engine started (max_num_seqs)."""
    applied: int | None
    """The limit in force now (== start when none was asked)."""
    running: int
    """Requests running when the status was written."""
    pid: int
    t: float
    """Wall time of the write (s)."""

    @property
    def live(self) -> bool:
        return self.attr is not None


def write_status(path: Path, status: EngineLimitStatus) -> None:
    """Atomic replace (the engine core writes; soakd reads at any moment)."""
    doc = {
        "attr": status.attr,
        "start": status.start,
        "applied": status.applied,
        "running": status.running,
        "pid": status.pid,
        "t": status.t,
    }
    write_private(path, json.dumps(doc).encode())


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def read_status(path: Path, *, since: float | None = None) -> EngineLimitStatus | None:
    """The status file, or None when missing, unreadable, or written before `since` (a previous
    engine's)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8")[:4096])
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    t = doc.get("t")
    if not isinstance(t, int | float) or (since is not None and t < since):
        return None
    attr = doc.get("attr")
    return EngineLimitStatus(
        attr=attr if isinstance(attr, str) and attr in LIMIT_ATTRS else None,
        start=_int_or_none(doc.get("start")),
        applied=_int_or_none(doc.get("applied")),
        running=_int_or_none(doc.get("running")) or 0,
        pid=_int_or_none(doc.get("pid")) or 0,
        t=float(t),
    )


def reported_attr() -> str | None:
    """The attribute the current engine's scheduler last reported moving (None: none, or no report)."""
    limit_file = os.environ.get(ACTIVE_SEQS_ENV)
    status = read_status(status_path(limit_file)) if limit_file else None
    return status.attr if status is not None else None


def reported_live(since: float) -> bool:
    """Whether the scheduler of an engine started at `since` (wall s) reported a live limit, in the
    status file beside the limit file this process's environment names (the engine inherits it)."""
    limit_file = os.environ.get(ACTIVE_SEQS_ENV)
    status = read_status(status_path(limit_file), since=since) if limit_file else None
    return status is not None and status.live
