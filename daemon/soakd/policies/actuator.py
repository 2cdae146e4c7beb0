"""The one place that changes the engine or the admission ceiling: applies the policies' actions.

Every action is an event sample (a Grafana annotation) with its reason and evidence, a structlog line
and the systemd STATUS line, whether it is applied or (`dry_run`) only advised. Every move of the
ceiling comes through here, the controller's first one (`hold`, the replay's start) included. What a
move moves besides soakd's own gate (`AdmissionGate.set_limit`, immediate) is the run's `Lever`
(policies/lever.py, chosen once):

- admission: nothing more;
- scheduler: also vLLM's admission limit, live, through soakd's scheduler class (engine/sched.py),
  by rewriting the limit file it polls (engine/live_limit.py); where a started engine does not run
  that class, admission only;
- rebuild: also a rebuild with `max_num_seqs` = the ceiling (drains; minutes on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from soakd.config import EngineChange
from soakd.engine.live_limit import read_status, status_path, write_limit
from soakd.engine.supervisor import EngineSupervisor
from soakd.errors import EngineError
from soakd.metric import FieldValue
from soakd.notify import notify
from soakd.policies.downscale import BatchAction, TrialSkipped
from soakd.policies.lever import Lever
from soakd.policies.recapture import RecaptureAction
from soakd.replay.admission import AdmissionGate

log = structlog.get_logger(__name__)

EventFn = Callable[..., None]


def _evidence(evidence: dict[str, Any]) -> dict[str, FieldValue]:
    out: dict[str, FieldValue] = {}
    for k, v in evidence.items():
        if isinstance(v, bool | int | float | str):
            out[f"ev_{k}"] = v
    return out


class Actuator:
    """Applies batch, re-capture and speculation actions; says each one."""

    def __init__(
        self,
        engine: EngineSupervisor,
        on_event: EventFn,
        *,
        lever: Lever | None = None,
        dry_run: bool = False,
    ) -> None:
        self._engine = engine
        self._event = on_event
        self.lever = lever or Lever()
        self.dry_run = dry_run
        self.gate: AdmissionGate | None = None
        """The replay's gate, from the replay's start on (`hold`)."""
        self.applied = 0
        self.failed = 0
        self.engine_limit: int | None = None
        """The limit last written for the engine's scheduler (None: as the engine started)."""
        self._said_no_live = False

    def _say(self, kind: str, message: str, **fields: FieldValue) -> None:
        fields = {**fields, "dry_run": self.dry_run}
        self._event(kind, message, **fields)
        notify(f"STATUS={'advice' if self.dry_run else 'action'}: {message}"[:400])

    def say_skipped(self, skip: TrialSkipped) -> None:
        """A downscale not tried (nothing to apply, in control and advice-only alike), and why."""
        fields: dict[str, FieldValue] = {
            "from_limit": skip.from_limit,
            "to_limit": skip.to_limit,
            "reason": skip.reason,
            "lever": self.lever.kind,
            **_evidence(skip.evidence),
        }
        self._say("trial_skipped", f"trial_skipped: {skip.reason}", **fields)

    async def hold(self, gate: AdmissionGate, limit: int, start: int) -> None:
        """The replay begins: `gate` is the one a move moves from now on, and the ceiling the controller
        holds (restored from the run's saved state, or the start) takes effect in it and, when below the
        start, in the engine's limit file. No event: the move that set it was said when it was made."""
        self.gate = gate
        if self.dry_run:
            return
        if gate.limit != limit:
            await gate.set_limit(limit)
        if self.lever.limit_file is not None and limit < start:
            write_limit(self.lever.limit_file, limit)
            self.engine_limit = limit

    def engine_applied(self) -> int | None:
        """The limit the engine's scheduler says it enforces (not what was asked); None when it runs no
        scheduler of soakd's or has said nothing yet."""
        if self.lever.limit_file is None:
            return None
        status = read_status(status_path(self.lever.limit_file))
        return status.applied if status is not None and status.live else None

    async def set_ceiling(self, action: BatchAction) -> None:
        reason = f"{action.kind}: {action.reason}"
        fields: dict[str, FieldValue] = {
            "from_limit": action.from_limit,
            "to_limit": action.to_limit,
            "reason": action.reason,
            "lever": self.lever.kind,
            **_evidence(action.evidence),
        }
        if self.dry_run:
            self._say(action.kind, f"advice only: {reason}", **fields)
            return
        if self.gate is not None:
            await self.gate.set_limit(action.to_limit)
        fields["engine_live"] = self._move_engine_limit(action.to_limit)
        ok = True
        if self.lever.kind == "rebuild":
            change = EngineChange(
                at=1.0, mode="drain", reason=f"batch {reason}", max_num_seqs=action.to_limit
            )
            ok = await self._engine.rebuild(change)
            fields["rebuilt"] = ok
        self.applied += ok
        self.failed += not ok
        self._say(action.kind, reason, **fields)

    def _move_engine_limit(self, limit: int) -> bool:
        """The scheduler lever: the limit file rewritten for the engine's scheduler class. True when the
        engine running now moves its limit live."""
        if self.lever.kind != "scheduler" or self.lever.limit_file is None:
            return False
        try:
            capable: bool | None = self._engine.info.live_active_seqs
        except EngineError:
            # Between two engines (a rebuild or a restart): the next one reads the file as it starts.
            capable = None
        if capable is False:
            if not self._said_no_live:
                self._said_no_live = True
                log.warning(
                    "scheduler_lever_unavailable", reason="the engine's scheduler reports no live limit"
                )
            return False
        write_limit(self.lever.limit_file, limit)
        self.engine_limit = limit
        return capable is True

    async def recapture(self, action: RecaptureAction) -> bool:
        fields: dict[str, FieldValue] = {
            "sizes": ",".join(map(str, action.sizes)),
            "previous": ",".join(map(str, action.previous)),
            "reason": action.reason,
            **_evidence(dict(action.evidence)),
        }
        if self.dry_run:
            self._say("recapture", f"advice only: re-capture CUDA graphs: {action.reason}", **fields)
            return False
        change = EngineChange(
            at=1.0,
            mode="drain",
            reason=f"re-capture: {action.reason}",
            cudagraph_capture_sizes=list(action.sizes),
        )
        ok = await self._engine.rebuild(change)
        self.applied += ok
        self.failed += not ok
        fields["ok"] = ok
        self._say(
            "recapture", f"re-capture CUDA graphs ({'done' if ok else 'failed'}): {action.reason}", **fields
        )
        return ok

    async def speculation(self, enabled: bool, reason: str, **evidence: FieldValue) -> bool:
        kind = "mtp_on" if enabled else "mtp_off"
        fields: dict[str, FieldValue] = {"reason": reason, **evidence}
        if self.dry_run:
            self._say(
                kind, f"advice only: speculative decoding {'on' if enabled else 'off'}: {reason}", **fields
            )
            return False
        change = EngineChange(at=1.0, mode="drain", reason=reason, speculative_enabled=enabled)
        ok = await self._engine.rebuild(change)
        self.applied += ok
        self.failed += not ok
        fields["ok"] = ok
        self._say(
            kind,
            f"speculative decoding {'on' if enabled else 'off'} ({'done' if ok else 'failed'}): {reason}",
            **fields,
        )
        return ok

    def advise(self, kind: str, message: str, **fields: FieldValue) -> None:
        """An advisory event: nothing to apply (the MTP acceptance advisory)."""
        self._event(kind, message, **fields)
        notify(f"STATUS=advisory: {message}"[:400])
