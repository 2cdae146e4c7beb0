"""The run's live state that its parts read while it runs: the replay under way, its clock, why it ended.

The scheduler's jobs, the controller's inputs, the signal handler and the replay collector all ask the
same questions (is the replay running, how far is it, was it stopped); they ask this object, not the
Soak, so each part is built from what it reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from soakd.checkpoint import Checkpoint
from soakd.clock import Clock
from soakd.judge.metrics import RunMetrics
from soakd.replay.runner import Replayer

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class LiveRun:
    clock: Clock
    planned_s: float
    offset_s: float = 0.0
    """Replay time already done before this process started (a resumed run)."""
    metrics: RunMetrics = field(default_factory=RunMetrics)
    checkpoint: Checkpoint | None = None
    replayer: Replayer | None = None
    """The replayer running now: the warm-up's, then the soak's."""
    replay_start: float | None = None
    """The clock's time when the soak's replay (not the warm-up) began."""
    replaying: bool = False
    engine_started: bool = False
    interrupted: bool = False
    stopped_by: str = ""
    """The signal that stopped the run (SIGTERM: a service stop), or empty."""
    phase: str = "setup"
    """The phase the run is in (judge.criteria.STOP_PHASES), set by the run as it goes."""
    stopped_in: str = ""
    """The phase the stop signal came in, or empty."""
    error: str = ""
    """Why the run ended early on its own (engine failure, a criterion, the trace changed)."""

    @property
    def replay_ended(self) -> bool:
        """The replay had reached its planned end before this process began (a run resumed after a crash
        while it stopped the engine or shipped): only its verdict is left to make, no engine to start."""
        return self.offset_s >= self.planned_s

    def enter(self, phase: str) -> None:
        """The run reached `phase` (judge.criteria.STOP_PHASES): what a stop signal's verdict names."""
        if self.phase != phase:
            self.phase = phase
            log.info("run_phase", phase=phase)

    def adopt(self, replayer: Replayer) -> None:
        """`replayer` is the one a stop signal ends from now on. A signal that came while it was being
        made (the warm-up's phase logged, the schedule read) found none to end: it ends this one now,
        before its first send (the warm-up aborted, the replay stopped), or it would be lost."""
        self.replayer = replayer
        if self.stopped_by:
            replayer.stop()

    def elapsed(self) -> float:
        """Replay time reached, across resumes."""
        if self.replay_start is None:
            return self.offset_s
        # Never below the offset: the replay's clock starts a moment after it is set up.
        return self.offset_s + max(0.0, self.clock.monotonic() - self.replay_start)

    def soak_replayer(self) -> Replayer | None:
        """The soak's replayer once its replay began (never the warm-up's)."""
        return self.replayer if self.replay_start is not None else None

    def interruptions(self) -> list[dict[str, Any]]:
        return [asdict(i) for i in self.checkpoint.interruptions] if self.checkpoint is not None else []

    def write_checkpoint(self, run_dir: Path, elapsed_s: float | None = None) -> None:
        if self.checkpoint is None:
            return
        self.checkpoint.elapsed_s = self.elapsed() if elapsed_s is None else elapsed_s
        self.checkpoint.write(run_dir)
