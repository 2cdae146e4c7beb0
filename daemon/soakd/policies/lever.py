"""The batch lever a run uses, chosen once (`choose_lever`): the one owner of that decision.

The engine's configuration (whether vLLM runs soakd's scheduler class, wiring.engine_config), the
controller and the actuator all receive the same `Lever`; none decides again. `control.batch.lever` is
what the config asks for; what the engine can do may degrade it: the scheduler lever needs soakd's
scheduler class inside the engine, and where the engine cannot run it the admission gate alone moves.
Whether a started engine's scheduler then really moves vLLM's limit (`EngineInfo.live_active_seqs`) is
that engine's own report, which the actuator reads at each move.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from soakd.config import Config, EngineConfig
from soakd.engine import compat
from soakd.engine.vllm_local import SCHEDULER_CLS
from soakd.rundir import LIMIT_FILE

LeverKind = Literal["admission", "scheduler", "rebuild"]


@dataclass(frozen=True, slots=True)
class Lever:
    """What a ceiling move moves besides soakd's own admission gate (`AdmissionGate`, always moved):

    - admission: nothing more;
    - scheduler: vLLM's admission limit, live, through the limit file soakd's scheduler class reads;
    - rebuild: `max_num_seqs`, by rebuilding the engine (drains; minutes on a GPU).
    """

    kind: LeverKind = "admission"
    limit_file: Path | None = None
    """The file soakd's scheduler class reads its limit from (engine/live_limit.py); None: the engine runs
    vLLM's own scheduler. Set for the scheduler lever, advice-only runs included (an A/B of control
    against advice-only then compares policies on one engine, not two schedulers)."""
    note: str = ""
    """Why the configured lever was not the one chosen, or empty."""

    @property
    def scheduler_cls(self) -> str:
        """The `engine.scheduler_cls` the engine starts with for this lever ("" for vLLM's own)."""
        return SCHEDULER_CLS if self.limit_file is not None else ""


def choose_lever(cfg: Config, run_dir: Path) -> Lever:
    """The lever this run uses. The scheduler lever degrades to the admission gate where the engine cannot
    run soakd's scheduler class (`scheduler_class_refused`); without batch control the engine runs vLLM's
    own scheduler and the lever is only named."""
    control = cfg.control
    wanted: LeverKind = control.batch.lever
    if wanted != "scheduler" or not (control.enabled and control.batch.enabled):
        return Lever(wanted)
    why = scheduler_class_refused(cfg.engine)
    if why:
        return Lever(
            "admission", note=f"the scheduler lever is unavailable ({why}): the admission gate alone"
        )
    return Lever("scheduler", limit_file=run_dir / LIMIT_FILE)


def scheduler_class_refused(engine: EngineConfig) -> str:
    """Why the engine cannot run soakd's scheduler class, or "" when it can. The one check the lever's
    choice asks: what a vLLM release supports is decided here too."""
    if engine.kind == "openai":
        return "an OpenAI-compatible server runs its own scheduler"
    if engine.scheduler_cls and engine.scheduler_cls != SCHEDULER_CLS:
        return f"the config names its own scheduler class ({engine.scheduler_cls})"
    if not compat.lever_available():
        # Read from the installed vLLM's source by feature (engine/compat.py), not by version.
        lever = compat.installed().get("scheduler_lever")
        return f"this vLLM has no admission limit the class can move: {lever.detail}"
    return ""
