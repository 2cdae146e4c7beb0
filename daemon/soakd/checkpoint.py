"""checkpoint.json: a run's replay time reached, its interruptions and the requests lost at them.

Written by the running daemon (atomically, every `run.checkpoint_interval`), read by a resumed start
(soakd.resume) and by `soakd report` for a run that died before its summary.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from soakd.files import read_json_no_follow, write_json_atomic
from soakd.rundir import CHECKPOINT_FILE

log = structlog.get_logger(__name__)

_WRITE_LOCK = threading.Lock()

RequestKey = tuple[int, int, int]
"""(loop, trace index, rate-scale copy): one scheduled request of a run."""


@dataclass(slots=True)
class Interruption:
    """One crash (or kill) of the daemon that a later start resumed from."""

    at_s: float
    """Replay time reached before the crash."""
    down_s: float
    """From the run's last sign of life to the resumed start."""
    lost_in_flight: int
    """Requests that had come due and had not finished when the daemon died."""
    resumed_utc: str


@dataclass(slots=True)
class Checkpoint:
    run_id: str
    fingerprint: str
    started_utc: str
    planned_s: float
    elapsed_s: float = 0.0
    """Replay time reached (seconds of trace replayed, across resumes)."""
    wall_ns: int = 0
    """When this checkpoint was written."""
    interruptions: list[Interruption] = field(default_factory=list)
    lost: list[RequestKey] = field(default_factory=list)
    """Every request counted as lost in flight so far: a later resume must not count them again."""
    stopped_by: str = ""
    """Set when the run was stopped on purpose (SIGTERM, SIGINT): such a run is never resumed, even if
    the stop outlasted the service manager's timeout and was cut short by SIGKILL."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "fingerprint": self.fingerprint,
            "started_utc": self.started_utc,
            "planned_s": self.planned_s,
            "elapsed_s": self.elapsed_s,
            "wall_ns": self.wall_ns,
            "stopped_by": self.stopped_by,
            "lost": [list(k) for k in self.lost],
            "interruptions": [asdict(i) for i in self.interruptions],
        }

    def write(self, run_dir: Path) -> None:
        """Atomically, from the event loop or a worker thread: the lock orders the two, so the last
        written is the last built (a stop's checkpoint is never overwritten by an older periodic one)."""
        with _WRITE_LOCK:
            self.wall_ns = time.time_ns()
            write_json_atomic(run_dir / CHECKPOINT_FILE, self.to_dict())


def read_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The run's checkpoint, or None when it has none or it cannot be read (then it is not resumable)."""
    try:
        # The run folder's own file, never a link's target (a refusal is an OSError: not resumable).
        data = read_json_no_follow(run_dir / CHECKPOINT_FILE)
        return Checkpoint(
            run_id=str(data["run_id"]),
            fingerprint=str(data["fingerprint"]),
            started_utc=str(data["started_utc"]),
            planned_s=float(data["planned_s"]),
            elapsed_s=float(data["elapsed_s"]),
            wall_ns=int(data["wall_ns"]),
            interruptions=[
                Interruption(
                    float(i["at_s"]), float(i["down_s"]), int(i["lost_in_flight"]), str(i["resumed_utc"])
                )
                for i in data.get("interruptions", [])
            ],
            stopped_by=str(data.get("stopped_by", "")),
            lost=[(int(k[0]), int(k[1]), int(k[2])) for k in data.get("lost", [])],
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("checkpoint_unreadable", run_dir=str(run_dir), error=f"{type(err).__name__}: {err}")
        return None
