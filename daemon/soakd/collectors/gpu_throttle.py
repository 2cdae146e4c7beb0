"""Throttle state per GPU during a soak: the episode detector and the harm judge fed with every fast
NVML sample of the engine's GPUs, their changes written as `throttle_*` / `harm_*` events (a `harm_leave`
says how the harm ended: `ended_by` "loss", "own_level" or "bound"), and a `throttle` point per GPU per
interval. With more than one GPU to an engine, a `gpu_spread` point per group and interval: how far
apart the GPUs ran (clock, power, temperature) and which one was the straggler, since every
tensor-parallel step waits for the slowest. It also integrates board power into energy (J) for the
control loop's tokens-per-joule."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
STRAGGLER_SPREAD = 0.02
"""Clock spread (of the fastest GPU's mean) below which no GPU of a group is named the straggler: equal
clocks within sampling noise (H200s at their boost clock differ by a few MHz of 1,980)."""


@dataclass(slots=True)
class _Acc:
    """One GPU's samples in the current interval, for the spread across its group."""

    sm_sum: float = 0.0
    sm_n: int = 0
    power_sum: float = 0.0
    power_n: int = 0
    temp_max: float | None = None


@dataclass(slots=True)
class _GroupRecord:
    """A group's spread over the run, for the summary."""

    intervals: int = 0
    spreads: list[float] = field(default_factory=list)
    slowest: dict[int, int] = field(default_factory=dict)
    """GPU -> intervals it was the straggler (spread at least STRAGGLER_SPREAD)."""


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
        groups: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """`max_sm_mhz`: the GPUs judged (the engine's), each with its maximum SM clock. `groups`: named
        sets of them whose spread is recorded (a tensor-parallel replica's GPUs; "all" the replicas)."""
        self._detectors = {
            gpu: ThrottleDetector(settings, max_mhz=mhz or None) for gpu, mhz in max_sm_mhz.items()
        }
        self._judges = {gpu: HarmJudge(harm, max_mhz=mhz or None) for gpu, mhz in max_sm_mhz.items()}
        self._groups = {
            name: tuple(g for g in gpus if g in self._judges)
            for name, gpus in (groups or {}).items()
            if len([g for g in gpus if g in self._judges]) >= 2
        }
        self._acc: dict[int, _Acc] = {gpu: _Acc() for gpu in self._judges}
        self._group_record = {name: _GroupRecord() for name in self._groups}
        self._power: dict[int, tuple[float, float]] = {}  # gpu -> (t, W) of the last sample
        self._energy_j = 0.0
        self._energy_s = 0.0
        """Seconds of samples integrated into `_energy_j`, per GPU judged (gaps left out, as there)."""
        self._on_event = on_event
        self._last_slow: dict[int, Mapping[str, Any]] = {}
        self._foreign: dict[int, Mapping[str, int]] = {}
        """Per GPU: the other processes computing on it at its last slow read that knew them."""
        self._now_foreign: dict[int, Mapping[str, int] | None] = {}
        """Per GPU: the same at its last slow read (None: unknown then)."""
        self._cotenant_episodes: dict[int, int] = {}
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
            self._cotenants(gpu, slow.get("foreign_procs"))
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
        if self._groups and inp.active is not False:
            # Busy samples only: an idle GPU's clock drops to its floor and says nothing of who is slow.
            self._accumulate(gpu, inp.sm_mhz, fast.get("power_mw"), slow.get("temp_c"))

    def _cotenants(self, gpu: int, foreign: Mapping[str, int] | None) -> None:
        """A `cotenant_enter` event when another process appears on the GPU with none before, and a
        `cotenant_leave` when the last one goes; an unknown list (None) ends nothing (the episode stays
        open until a list without one), but the GPU's state reads unknown."""
        self._now_foreign[gpu] = foreign
        if foreign is None:
            return
        before = self._foreign.get(gpu)
        self._foreign[gpu] = foreign
        if bool(foreign) == bool(before):
            return
        if foreign:
            self._cotenant_episodes[gpu] = self._cotenant_episodes.get(gpu, 0) + 1
            mem = sum(foreign.values())
            pids = ",".join(sorted(foreign, key=int))
            self._on_event(
                "cotenant_enter",
                f"GPU {gpu}: another process has a compute context on it (PID {pids}, "
                f"{mem / 2**30:.1f} GiB): the engine's SM time and power may be shared",
                gpu=gpu,
                pids=pids,
                foreign_procs=len(foreign),
                foreign_mem_bytes=mem,
            )
        else:
            self._on_event("cotenant_leave", f"GPU {gpu}: no other process computes on it", gpu=gpu)

    def shared(self) -> frozenset[str] | None:
        """The PIDs of the other processes with a compute context on any of the engine's GPUs at its last
        slow read (empty: none); None when a judged GPU's list was unknown at its last read (an engine
        between processes) or not read yet: a process out of sight is not absent. PIDs, not a count: a
        second process beside one there all along is a newcomer."""
        lists = [self._now_foreign.get(gpu) for gpu in self._judges]
        if not lists or any(f is None for f in lists):
            return None
        return frozenset(pid for f in lists if f is not None for pid in f)

    def _accumulate(self, gpu: int, sm_mhz: object, power_mw: object, temp_c: object) -> None:
        acc = self._acc[gpu]
        if isinstance(sm_mhz, int | float):
            acc.sm_sum += float(sm_mhz)
            acc.sm_n += 1
        if isinstance(power_mw, int | float) and 0 <= power_mw < 1e8:
            acc.power_sum += float(power_mw) / 1000.0
            acc.power_n += 1
        if isinstance(temp_c, int | float):
            acc.temp_max = float(temp_c) if acc.temp_max is None else max(acc.temp_max, float(temp_c))

    def _integrate(self, gpu: int, t_s: float, power_mw: object) -> None:
        if not isinstance(power_mw, int | float) or not 0 <= power_mw < 1e8:
            return
        watts = float(power_mw) / 1000.0
        last = self._power.get(gpu)
        # Trapezoids between fast samples; a gap over 5 s (a stalled tier) is not guessed across.
        if last is not None and 0 < t_s - last[0] <= 5.0:
            self._energy_j += (t_s - last[0]) * (watts + last[1]) / 2
            self._energy_s += (t_s - last[0]) / len(self._judges)
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
        threshold (thermal wins), "" when none: in tensor parallelism one GPU's harm is the engine's."""
        return worst_harm(j.kind for j in self._judges.values() if j.harmful)

    def harm_fading(self) -> bool:
        """Whether the GPUs' harm is in its tail on every GPU that has any: the loss under the level
        that starts harm, not yet under the level that ends it (its cause may be over); one GPU at its
        threshold, of any kind, is harm now."""
        judges = [j for j in self._judges.values() if j.harmful]
        return bool(judges) and all(j.in_tail for j in judges)

    def harm_source(self, kind: str) -> str:
        """Which GPUs have harm of this kind ("GPU 1", "GPUs 0, 3"), for the evidence of an action; ""
        when none (the harm acted on came from elsewhere: the host's CPUs)."""
        gpus = [gpu for gpu, j in self._judges.items() if j.harmful and j.kind == kind]
        if not gpus:
            return ""
        return f"GPU {gpus[0]}" if len(gpus) == 1 else "GPUs " + ", ".join(map(str, gpus))

    def limited(self) -> bool:
        """Whether any GPU showed a throttle reason in most of its last window of samples."""
        return any(j.limited >= 0.5 for j in self._judges.values())

    def energy_j(self) -> float:
        """GPU energy since the start (J, the engine's GPUs), integrated from the fast tier's board power."""
        return self._energy_j

    def energy_s(self) -> float:
        """The time the energy total covers (s, per GPU): a power is the energy's growth over this one's,
        not over a control interval that holds a sample more or less (10 % of a 1 s interval at 10 Hz)
        or a stalled tier's gap, whose energy is not guessed."""
        return self._energy_s

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
        out += self._spread(now_ns)
        return out

    def _spread(self, now_ns: int) -> list[Sample]:
        """One `gpu_spread` point per group whose GPUs all sampled a clock in the interval."""
        accs, self._acc = self._acc, {gpu: _Acc() for gpu in self._judges}
        out = []
        for name, gpus in self._groups.items():
            if any(accs[g].sm_n == 0 for g in gpus):
                continue
            sm = {g: accs[g].sm_sum / accs[g].sm_n for g in gpus}
            fast, slow = max(sm.values()), min(sm, key=lambda g: sm[g])
            spread = (fast - sm[slow]) / fast if fast > 0 else 0.0
            fields: dict[str, FieldValue] = {
                "gpus": len(gpus),
                "sm_mhz_min": round(sm[slow], 1),
                "sm_mhz_max": round(fast, 1),
                "sm_spread": round(spread, 4),
                "straggler": slow if spread >= STRAGGLER_SPREAD else -1,
            }
            power = [accs[g].power_sum / accs[g].power_n for g in gpus if accs[g].power_n]
            if len(power) == len(gpus):
                fields["power_w_min"], fields["power_w_max"] = round(min(power), 1), round(max(power), 1)
            temps = [t for g in gpus if (t := accs[g].temp_max) is not None]
            if len(temps) == len(gpus):
                fields["temp_c_min"], fields["temp_c_max"] = min(temps), max(temps)
            record = self._group_record[name]
            record.intervals += 1
            record.spreads.append(spread)
            if spread >= STRAGGLER_SPREAD:
                record.slowest[slow] = record.slowest.get(slow, 0) + 1
            out.append(Sample("gpu_spread", fields, now_ns, tags={"group": name}))
        return out

    def spread_summary(self) -> dict[str, object]:
        """Per group: its GPUs, the clock spread's median and maximum over the run, and the straggler:
        the GPU slowest in most intervals with a spread worth naming (none when there were none)."""
        out: dict[str, object] = {}
        for name, gpus in self._groups.items():
            record = self._group_record[name]
            ranked = sorted(record.spreads)
            slowest = max(record.slowest, key=lambda g: record.slowest[g], default=None)
            named = sum(record.slowest.values())
            out[name] = {
                "gpus": list(gpus),
                "intervals": record.intervals,
                "sm_spread_p50": ranked[len(ranked) // 2] if ranked else None,
                "sm_spread_max": ranked[-1] if ranked else None,
                "straggler": slowest,
                "straggler_intervals": record.slowest.get(slowest, 0) if slowest is not None else 0,
                "intervals_with_a_straggler": named,
            }
        return out

    def summary(self) -> dict[str, object]:
        return {
            str(gpu): {
                **det.summary(),
                "harm": self._judges[gpu].summary(),
                # Times another process came to compute on the GPU; None: its process list was never known.
                "cotenant_episodes": self._cotenant_episodes.get(gpu, 0) if gpu in self._foreign else None,
            }
            for gpu, det in self._detectors.items()
        }

    def close(self) -> None:
        return None
