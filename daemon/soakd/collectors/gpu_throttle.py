"""Throttle state per GPU during a soak: the episode detector and the harm judge fed with every fast
NVML sample, their changes written as `throttle_*` / `harm_*` events (a `harm_leave` says how the harm
ended: `ended_by` "loss", "own_level" or "bound"), and a `throttle` point per GPU per interval. It also
integrates board power into energy (J) for the control loop's tokens-per-joule."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from soakd.metric import FieldValue, Sample
from soakd.policies.throttle import (
    HarmChange,
    HarmJudge,
    HarmSettings,
    ThrottleDetector,
    ThrottleInput,
    ThrottleSettings,
    ThrottleState,
    Transition,
    counters_from_fields,
    worst_harm,
)

EventFn = Callable[..., None]
STATE_CODE = {ThrottleState.OK: 0, ThrottleState.THROTTLED: 1, ThrottleState.RECOVERING: 2}
_GPU_IDLE = 0x1


_EVENT_KIND = {
    ThrottleState.THROTTLED: "throttle_enter",
    ThrottleState.RECOVERING: "throttle_recovering",
    ThrottleState.OK: "throttle_leave",
}


def emit_transition(on_event: EventFn, tr: Transition, who: str, ident: Mapping[str, FieldValue]) -> None:
    """One detector transition as a `throttle_*` event; `ident` names the device (`gpu`, or `scope`)."""
    fields: dict[str, FieldValue] = {
        **ident,
        "from_state": str(tr.from_state),
        "to_state": str(tr.to_state),
        "reasons": ",".join(tr.reasons),
        "detail": tr.detail[:300],
    }
    if tr.clock_ratio is not None:
        fields["clock_ratio"] = tr.clock_ratio
    on_event(_EVENT_KIND[tr.to_state], f"{who}: {tr.from_state} -> {tr.to_state} ({tr.detail})", **fields)


class GpuThrottleWatch:
    """One ThrottleDetector per GPU. `observe` is NvmlCollector's `on_fast` hook."""

    name = "throttle"

    def __init__(
        self,
        max_sm_mhz: Mapping[int, float | None],
        on_event: EventFn,
        settings: ThrottleSettings | None = None,
        harm: HarmSettings | None = None,
    ) -> None:
        self._detectors = {
            gpu: ThrottleDetector(settings, max_mhz=mhz or None) for gpu, mhz in max_sm_mhz.items()
        }
        self._judges = {gpu: HarmJudge(harm, max_mhz=mhz or None) for gpu, mhz in max_sm_mhz.items()}
        self._power: dict[int, tuple[float, float]] = {}  # gpu -> (t, W) of the last sample
        self._energy_j = 0.0
        self._on_event = on_event
        self._last_slow: dict[int, Mapping[str, Any]] = {}
        self.transitions = 0

    def observe(self, gpu: int, t_s: float, fast: Mapping[str, Any], slow: Mapping[str, Any]) -> None:
        det = self._detectors.get(gpu)
        if det is None:
            return
        reasons = fast.get("reasons")
        util = slow.get("util_gpu")  # a slow-tier gauge: the last read
        idle = isinstance(reasons, int) and bool(reasons & _GPU_IDLE)
        # The counters change only with a new slow read: converted once per read, not per fast sample.
        counters: Mapping[str, int] = {}
        if slow is not self._last_slow.get(gpu):
            self._last_slow[gpu] = slow
            fields = slow.get("fields") or {}
            counters = counters_from_fields({k: v for k, v in fields.items() if v is not None})
        inp = ThrottleInput(
            t_s=t_s,
            sm_mhz=fast.get("sm_mhz"),
            reasons=reasons,
            throttle_ns=counters,
            thermal_margin_c=slow.get("margin_c"),
            active=None if util is None and reasons is None else (not idle and (util is None or util > 0)),
        )
        for tr in det.update(inp):
            self.transitions += 1
            emit_transition(self._on_event, tr, f"GPU {gpu}", {"gpu": gpu})
        change = self._judges[gpu].update(
            t_s, inp.sm_mhz, reasons, active=inp.active, thermal_margin_c=inp.thermal_margin_c
        )
        if change is not None:
            self._harm_event(gpu, change)
        self._integrate(gpu, t_s, fast.get("power_mw"))

    def _integrate(self, gpu: int, t_s: float, power_mw: object) -> None:
        if not isinstance(power_mw, int | float) or not 0 <= power_mw < 1e8:
            return
        watts = float(power_mw) / 1000.0
        last = self._power.get(gpu)
        # Trapezoids between fast samples; a gap over 5 s (a stalled tier) is not guessed across.
        if last is not None and 0 < t_s - last[0] <= 5.0:
            self._energy_j += (t_s - last[0]) * (watts + last[1]) / 2
        self._power[gpu] = (t_s, watts)

    def _harm_event(self, gpu: int, ch: HarmChange) -> None:
        ref = f" of {ch.reference_mhz:.0f} MHz" if ch.reference_mhz else ""
        own = f"{ch.own_cap_mhz:.0f} MHz" if ch.own_cap_mhz else "unknown"
        fields: dict[str, FieldValue] = {"gpu": gpu, "harm_kind": ch.kind, "clock_loss": round(ch.loss, 4)}
        if ch.reference_mhz:
            fields["reference_mhz"] = round(ch.reference_mhz, 1)
        if ch.own_cap_mhz:
            fields["own_cap_mhz"] = round(ch.own_cap_mhz, 1)
        if ch.harmful:
            kind = "harm_enter"
            what = f"GPU {gpu}: clock loss {ch.loss:.1%}{ref} ({ch.kind}): throttling costs work"
        else:
            kind = "harm_leave"
            fields["ended_by"] = ch.ended_by
            if ch.ended_by == "own_level":
                how = f"the clock back within half the threshold of the engine's own at-cap clock ({own})"
            elif ch.ended_by == "bound":
                stale = self._judges[gpu].settings.stale_s
                how = (
                    f"ended by the bound: no loss over the threshold for {stale:g} s; the clock now ({own}) "
                    "is the engine's own at-cap level, a new episode needs a new drop"
                )
            else:
                how = "below half the threshold"
            what = f"GPU {gpu}: clock loss {ch.loss:.1%}{ref}, {how}: the harm is over"
        self._on_event(kind, what, **fields)

    def throttled(self) -> bool:
        """Whether any GPU's detector is in the throttled state now (the episode record)."""
        return any(det.state is ThrottleState.THROTTLED for det in self._detectors.values())

    def harm(self) -> str:
        """The harm the control loop acts on: "thermal" or "power" when any GPU loses clock beyond its
        threshold (thermal wins), "" when none."""
        return worst_harm(j.kind for j in self._judges.values() if j.harmful)

    def limited(self) -> bool:
        """Whether any GPU showed a throttle reason in most of its last window of samples."""
        return any(j.limited >= 0.5 for j in self._judges.values())

    def energy_j(self) -> float:
        """GPU energy since the start (J, all GPUs), integrated from the fast tier's board power."""
        return self._energy_j

    def collect(self, now_ns: int) -> Sequence[Sample]:
        out = []
        for gpu, det in self._detectors.items():
            judge = self._judges[gpu]
            fields: dict[str, FieldValue] = {
                "state": STATE_CODE[det.state],
                "throttled_s": det.throttled_s,
                "harm": int(judge.harmful),
                "harm_s": judge.harm_s,
                "clock_loss": judge.loss,
            }
            for name, secs in det.per_reason_s.items():
                fields[f"throttle_{name}_total_s"] = secs
            out.append(Sample("throttle", fields, now_ns, tags={"gpu": str(gpu)}))
        return out

    def summary(self) -> dict[str, object]:
        return {
            str(gpu): {**det.summary(), "harm": self._judges[gpu].summary()}
            for gpu, det in self._detectors.items()
        }

    def close(self) -> None:
        return None
