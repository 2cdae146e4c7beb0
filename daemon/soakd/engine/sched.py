"""vLLM scheduler class whose admission limit soakd lowers and raises live (`--scheduler-cls`).

vLLM reads `max_num_active_reqs` (from `max_num_active_seqs`) on every step to admit waiting requests
into RUNNING; `max_num_seqs` sizes the model runner and its CUDA graphs and must not change live. So
this class keeps the runner as built and moves only the admission limit, never above its start value:
the engine side of soakd's batch downscaling, without a rebuild.

soakd writes the limit (a decimal integer, or nothing for "as started") to the file named by
SOAKD_ACTIVE_SEQS_FILE (atomically: soakd.policies.actuator.write_limit); the scheduler looks at its
mtime at most every 0.2 s, so a step costs one `os.stat` at worst. Loaded inside vLLM's engine-core
process; one class path serves both schedulers: `SoakdScheduler.__new__` returns the async variant
when the engine runs with async scheduling.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from soakd.engine.base import ACTIVE_SEQS_ENV

_CHECK_EVERY_S = 0.2

logger = logging.getLogger(__name__)


def read_limit(path: str) -> int | None:
    """The limit in the file: None when it is empty, missing or not a positive integer."""
    try:
        with open(path, encoding="ascii") as f:  # noqa: PTH123 - hot path, no Path object per read
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


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
        self._soakd_start: int | None = getattr(self, "max_num_active_reqs", None)
        self._soakd_live = _LiveLimit(os.environ.get(ACTIVE_SEQS_ENV))
        if self._soakd_start is None:
            logger.warning("soakd: this vLLM has no max_num_active_reqs; the live limit is off")

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # Arguments passed through: vLLM versions differ in them (throttle_prefills, ...).
        start = self._soakd_start
        if start is not None:
            limit = self._soakd_live.poll()
            self.max_num_active_reqs = start if limit is None else max(1, min(start, limit))
        return super().schedule(*args, **kwargs)


class SoakdAsyncScheduler(SoakdScheduler, AsyncScheduler):
    """The same live limit over vLLM's AsyncScheduler (async scheduling on)."""
