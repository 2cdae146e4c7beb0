"""vLLM scheduler class whose admission limit soakd lowers and raises live (`--scheduler-cls`).

vLLM checks an admission limit on every step before it moves a waiting request into RUNNING: 0.32 reads
`max_num_active_reqs` (from `max_num_active_seqs`), 0.26 reads `max_num_running_reqs` (from
`max_num_seqs`). `max_num_seqs` also sizes the model runner and its CUDA graphs and must not change, so
this class moves only the attribute, never above its start value. 0.26 asserts at the end of each step
that no more requests run than the attribute allows, so a lower limit takes effect as running requests
finish: the attribute never goes below the running count (no request is preempted or killed).

soakd writes the limit to the file named by SOAKD_ACTIVE_SEQS_FILE (soakd.engine.live_limit); the
scheduler looks at its mtime at most every 0.2 s, so a step costs one `os.stat` at worst, and reports
what it enforces in the status file beside it. Loaded inside vLLM's engine-core process; one class path
serves both schedulers: `SoakdScheduler.__new__` returns the async variant when the engine runs with
async scheduling.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from soakd.engine.live_limit import (
    ACTIVE_SEQS_ENV,
    LIMIT_ATTRS,
    EngineLimitStatus,
    read_limit,
    status_path,
    write_status,
)

_CHECK_EVERY_S = 0.2

logger = logging.getLogger(__name__)

__all__ = ["SoakdAsyncScheduler", "SoakdScheduler", "live_attr", "read_limit"]


def live_attr(scheduler: object) -> str | None:
    """The admission attribute this vLLM's scheduler reads, or None when it has none we know."""
    for name in LIMIT_ATTRS:
        if isinstance(getattr(scheduler, name, None), int):
            return name
    return None


class _LiveLimit:
    """What the scheduler needs of the file: the current limit, re-read only when the file changed."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._mtime_ns = -1
        self._next = 0.0
        self.limit: int | None = None

    def poll(self) -> int | None:
        if self.path is None:
            return None
        now = time.monotonic()
        if now < self._next:
            return self.limit
        self._next = now + _CHECK_EVERY_S
        try:
            mtime = os.stat(self.path).st_mtime_ns  # noqa: PTH116
        except OSError:
            self.limit = None
            return None
        if mtime != self._mtime_ns:
            self._mtime_ns = mtime
            self.limit = read_limit(self.path)
        return self.limit


class SoakdScheduler(Scheduler):
    """vLLM's Scheduler with a live admission limit (see the module docstring)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> SoakdScheduler:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        sched_cfg = getattr(vllm_config, "scheduler_config", None)
        if cls is SoakdScheduler and getattr(sched_cfg, "async_scheduling", False):
            return object.__new__(SoakdAsyncScheduler)
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get(ACTIVE_SEQS_ENV)
        self._soakd_live = _LiveLimit(path)
        self._soakd_status = status_path(path) if path else None
        self._soakd_attr = live_attr(self)
        self._soakd_start: int | None = None
        self._soakd_applied: int | None = None
        if self._soakd_attr is None:
            logger.warning(
                "soakd: this vLLM's scheduler has none of %s; the live limit is off", ", ".join(LIMIT_ATTRS)
            )
        else:
            self._soakd_start = int(getattr(self, self._soakd_attr))
            self._soakd_applied = self._soakd_start
        self._soakd_report()

    def _soakd_report(self) -> None:
        if self._soakd_status is None:
            return
        status = EngineLimitStatus(
            attr=self._soakd_attr,
            start=self._soakd_start,
            applied=self._soakd_applied,
            running=len(getattr(self, "running", ())),
            pid=os.getpid(),
            t=time.time(),
        )
        try:
            write_status(Path(self._soakd_status), status)
        except OSError as err:  # the run folder went away: the engine must keep serving
            logger.warning("soakd: cannot write %s: %s", self._soakd_status, err)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # Arguments passed through: vLLM versions differ in them (throttle_prefills, ...).
        self._soakd_apply()
        return super().schedule(*args, **kwargs)

    def _soakd_apply(self) -> None:
        attr, start = self._soakd_attr, self._soakd_start
        if attr is not None and start is not None:
            limit = self._soakd_live.poll()
            wanted = start if limit is None else max(1, min(start, limit))
            # Never below what runs now (0.26 asserts running <= the attribute): admission stops until
            # enough requests finish, none is preempted.
            busy = len(self.running) + int(getattr(self, "num_waiting_for_streaming_input", 0) or 0)
            setattr(self, attr, max(wanted, min(start, busy)))
            if wanted != self._soakd_applied and busy <= wanted:
                self._soakd_applied = wanted
                self._soakd_report()


class SoakdAsyncScheduler(SoakdScheduler, AsyncScheduler):
    """The same live limit over vLLM's AsyncScheduler (async scheduling on)."""
