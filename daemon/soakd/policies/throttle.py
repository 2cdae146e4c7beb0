"""Throttle detection: a pure state machine over a window of clock/reason/counter readings.

No I/O and no clock of its own: every reading carries its time (`ThrottleInput.t_s`), and the caller
turns the returned `Transition`s into event samples. Four signals are combined, as mature tools do:

1. growth of the cumulative throttle counters (NVML ns counters, or sysfs event counts on a host):
   exact, and nothing is missed between polls;
2. the clock-event reason bitmask held over a window, ignoring the benign bits (GpuIdle,
   ApplicationsClocksSetting, DisplayClockSetting) and a HwSlowdown flag seen in one isolated sample;
3. the SM (or CPU) clock as a fraction of the run's early clock, only while the device is active;
4. the thermal margin (degrees C left before the slowdown threshold).

Any signal present makes the device "throttled"; different enter/leave levels (hysteresis), a minimum
dwell in each state and a quiet period in "recovering" keep the state from flapping:
ok -> throttled -> recovering -> ok, and recovering -> throttled when the signals come back. These
episodes are the record (exact counters, every limit touch).

What the control loop acts on is narrower: `HarmJudge` says when throttling *costs* something, a
sustained SM-clock loss against the clock the device runs at unthrottled, with thermal and HW-slowdown
reasons held to a stricter loss than the SW power cap. An H200 serving alone touches its power cap in
1-2 % of 100 ms samples at 340-430 W without losing clock; running at the cap is normal operation on a
datacenter GPU, and a brief touch is not a reason to give up batch. Harm under the power cap ends when
its cause ends: back near the engine's own at-cap clock, or on a bound when its loss has not reached the
threshold for a while (a downscale kept during harm is undone only after the harm ends).
`ThroughputJudge` says when a limit shared with another process costs tokens/s against the engine's own
recent level.

Over 500 lines because detection (counters, reasons, clocks, harm) is one state machine whose four signals
are judged together; each signal's rule sits beside the others.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from soakd import nvml_fields
from soakd.config import HarmControlConfig
from soakd.metric import counter_growth

__all__ = [
    "BENIGN_REASONS",
    "ENDED_BY",
    "NVML_FIELD_COUNTERS",
    "REASON_BITS",
    "HarmJudge",
    "HarmSettings",
    "ThrottleDetector",
    "ThrottleInput",
    "ThrottleSettings",
    "ThrottleState",
    "ThroughputJudge",
    "ThroughputSettings",
    "Transition",
    "counters_from_fields",
    "host_input",
    "reason_names",
    "worst_harm",
]

GPU_IDLE: Final = 0x1
APPLICATIONS_CLOCKS_SETTING: Final = 0x2
SW_POWER_CAP: Final = 0x4
HW_SLOWDOWN: Final = 0x8
DISPLAY_CLOCK_SETTING: Final = 0x100

# One definition of the bits and counters, shared with the NVML collector that reads them.
REASON_BITS: Final[Mapping[int, str]] = dict(nvml_fields.REASON_BITS)
"""Clock-event (throttle) reason bits of `nvmlDeviceGetCurrentClocksEventReasons`, by name."""

BENIGN_REASONS: Final = GPU_IDLE | APPLICATIONS_CLOCKS_SETTING | DISPLAY_CLOCK_SETTING

NVML_FIELD_COUNTERS: Final[Mapping[int, str]] = dict(nvml_fields.THROTTLE_COUNTERS)
"""NVML field ids of the cumulative throttle-time counters (ns), by the counter names used here."""

DEFAULT_ENTER_COUNTERS: Final = frozenset(
    {"power", "thermal", "sw_thermal", "hw_thermal", "hw_power_brake", "board_limit"}
)


def reason_names(bits: int) -> tuple[str, ...]:
    """Names of the reason bits set in `bits`, lowest bit first (unknown bits as hex)."""
    names = [name for bit, name in REASON_BITS.items() if bits & bit]
    unknown = bits & ~sum(REASON_BITS)
    if unknown:
        names.append(hex(unknown))
    return tuple(names)


def counters_from_fields(fields: Mapping[str, int] | Mapping[int, int]) -> dict[str, int]:
    """NVML field values (id -> ns, ids as int or str, as a JSON recording has them) by counter name."""
    out: dict[str, int] = {}
    for key, value in fields.items():
        name = NVML_FIELD_COUNTERS.get(int(key))
        if name is not None:
            out[name] = int(value)
    return out


class ThrottleState(StrEnum):
    """ok -> throttled -> recovering -> ok (or back to throttled)."""

    OK = "ok"
    THROTTLED = "throttled"
    RECOVERING = "recovering"


@dataclass(frozen=True, slots=True)
class ThrottleSettings:
    """Thresholds of the detector. Times in seconds of the inputs' `t_s`, temperatures in degrees C."""

    window_s: float = 5.0
    """Window over which the bitmask share, counter growth, clock ratio and margin are judged (s)."""
    enter_fraction: float = 0.5
    """Share of the window's samples with a non-benign reason bit that signals throttling (0-1)."""
    leave_fraction: float = 0.2
    """While throttled/recovering, the share must fall below this to count as quiet (0-1)."""
    clock_ratio_enter: float = 0.85
    """Window median of clock / early clock below which the clock signals throttling."""
    clock_ratio_leave: float = 0.93
    """While throttled/recovering, the ratio must rise above this to count as quiet."""
    thermal_margin_enter_c: float = 5.0
    """Thermal margin (C to the slowdown threshold) below which the margin signals throttling."""
    thermal_margin_leave_c: float = 8.0
    """While throttled/recovering, the margin must rise above this to count as quiet (C)."""
    min_dwell_s: float = 10.0
    """No state change sooner than this after the previous one (s)."""
    recover_s: float = 30.0
    """Time in "recovering" without any throttle signal before "ok" (s)."""
    baseline_samples: int = 50
    """The early clock is the median of this many first active samples (unless a max clock is given)."""
    benign_mask: int = BENIGN_REASONS
    """Reason bits that never signal throttling (GpuIdle, ApplicationsClocksSetting, DisplayClockSetting)."""
    transient_mask: int = HW_SLOWDOWN
    """Reason bits that count only when set in at least two consecutive samples (HwSlowdown)."""
    enter_counters: frozenset[str] = DEFAULT_ENTER_COUNTERS
    """Throttle-time counters whose growth signals throttling (not low_util, clocks, sync_boost...)."""

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.min_dwell_s < 0 or self.recover_s < 0:
            raise ValueError("window_s must be > 0, min_dwell_s and recover_s >= 0")
        if not 0 < self.enter_fraction <= 1 or not 0 <= self.leave_fraction <= self.enter_fraction:
            raise ValueError("need 0 <= leave_fraction <= enter_fraction <= 1, enter_fraction > 0")
        if not 0 < self.clock_ratio_enter <= self.clock_ratio_leave:
            raise ValueError("need 0 < clock_ratio_enter <= clock_ratio_leave")
        if self.thermal_margin_leave_c < self.thermal_margin_enter_c:
            raise ValueError("need thermal_margin_enter_c <= thermal_margin_leave_c")
        if self.baseline_samples < 1:
            raise ValueError("baseline_samples must be >= 1")


@dataclass(frozen=True, slots=True)
class ThrottleInput:
    """One reading of a device. Every field but the time may be missing (None / empty)."""

    t_s: float
    """Time of the reading (s, any monotonic origin)."""
    sm_mhz: float | None
    """SM clock (or CPU clock on a host) in MHz."""
    reasons: int | None
    """Clock-event reason bitmask (NVML), None where not read."""
    throttle_ns: Mapping[str, int] = field(default_factory=dict)
    """Cumulative throttle time counters (ns) by counter name; empty between slow-tier readings."""
    thermal_margin_c: float | None = None
    """Degrees C left before the thermal slowdown threshold."""
    active: bool | None = None
    """Whether the device is busy (e.g. utilization > 0); the clock ratio is judged only when not False."""
    throttle_counts: Mapping[str, int] = field(default_factory=dict)
    """Cumulative throttle event counts (no time unit, e.g. sysfs thermal_throttle); growth signals."""
    ref_mhz: float | None = None
    """Reference clock for this reading (e.g. a CPU's max MHz); overrides the early clock when given."""


@dataclass(frozen=True, slots=True)
class Transition:
    """One state change; the app writes it as an event sample."""

    t_s: float
    from_state: ThrottleState
    to_state: ThrottleState
    reasons: tuple[str, ...]
    """Reason bits and counters seen in the window (names), empty when leaving on quiet."""
    clock_ratio: float | None
    """Window median of clock / early clock at the transition, None when not judged."""
    detail: str


@dataclass(slots=True)
class _Entry:
    t_s: float
    bits: int  # non-benign, transient-filtered reason bits; 0 when none
    has_reasons: bool
    ratio: float | None
    margin: float | None
    ref_mhz: float | None = None


@dataclass(frozen=True, slots=True)
class _Signals:
    share: float | None
    ratio: float | None
    margin: float | None
    grown: tuple[str, ...]
    bits: int
    ref_mhz: float | None = None

    def describe(self) -> str:
        parts = []
        if self.share is not None:
            parts.append(f"reason_share={self.share:.2f}")
        if self.ratio is not None and self.ref_mhz:
            # In MHz, as the report's SM-clock plot draws it, and the ratio against what it was taken
            # from (the GPU's max clock, or the clock seen early in the run), so the two agree.
            parts.append(
                f"sm_clock={self.ratio * self.ref_mhz:.0f}MHz ({self.ratio:.3f} of {self.ref_mhz:.0f}MHz)"
            )
        elif self.ratio is not None:
            parts.append(f"clock_ratio={self.ratio:.3f}")
        if self.margin is not None:
            parts.append(f"thermal_margin_c={self.margin:g}")
        if self.grown:
            parts.append("counters_grew=" + "+".join(self.grown))
        return " ".join(parts) or "no signals"


class ThrottleDetector:
    """Feed readings in time order with `update`; it returns the state changes they cause."""

    def __init__(self, settings: ThrottleSettings | None = None, max_mhz: float | None = None) -> None:
        self.settings = settings or ThrottleSettings()
        self._max_mhz = max_mhz
        self._baseline: list[float] = []
        self._window: deque[_Entry] = deque()
        self._prev_raw_bits = 0
        self._last_ns: dict[str, int] = {}
        self._last_counts: dict[str, int] = {}
        self._grown_at: dict[str, float] = {}
        self._per_reason_ns: dict[str, int] = {}
        self._per_reason_events: dict[str, int] = {}
        self._counter_resets = 0
        self._state = ThrottleState.OK
        self._since: float | None = None
        self._quiet_since: float | None = None
        self._last_t: float | None = None
        self._throttled_s = 0.0
        self._enters = 0
        self._transitions = 0

    # --- public views -------------------------------------------------------------------------
    @property
    def state(self) -> ThrottleState:
        return self._state

    @property
    def throttled_s(self) -> float:
        """Total time spent in the "throttled" state so far (s)."""
        return self._throttled_s

    @property
    def per_reason_s(self) -> dict[str, float]:
        """Throttle time by counter name, accumulated from counter deltas (s)."""
        return {name: ns / 1e9 for name, ns in sorted(self._per_reason_ns.items())}

    @property
    def per_reason_events(self) -> dict[str, int]:
        """Throttle events by counter name, from the growth of the event counts."""
        return dict(sorted(self._per_reason_events.items()))

    @property
    def baseline_mhz(self) -> float | None:
        """The clock the ratio is taken against: the max clock if given, else the early median."""
        if self._max_mhz is not None:
            return self._max_mhz
        return statistics.median(self._baseline) if self._baseline else None

    def summary(self) -> dict[str, object]:
        return {
            "state": self._state.value,
            "throttled_s": round(self._throttled_s, 3),
            "enters": self._enters,
            "transitions": self._transitions,
            "per_reason_s": {k: round(v, 6) for k, v in self.per_reason_s.items()},
            "per_reason_events": self.per_reason_events,
            "counter_resets": self._counter_resets,
            "baseline_mhz": self.baseline_mhz,
        }

    # --- update -------------------------------------------------------------------------------
    def update(self, inp: ThrottleInput) -> list[Transition]:
        s = self.settings
        t = inp.t_s
        if self._last_t is not None:
            if t < self._last_t:
                raise ValueError(f"readings out of order: {t} after {self._last_t}")
            if self._state is ThrottleState.THROTTLED:
                self._throttled_s += t - self._last_t
        self._last_t = t

        self._counters(inp)
        self._window.append(self._entry(inp))
        while self._window and self._window[0].t_s <= t - s.window_s:
            self._window.popleft()
        sig = self._signals(t)

        hot = self._is_signal(sig, leaving=False)
        warm = self._is_signal(sig, leaving=True)  # with the leave levels: not yet quiet
        # The first state has no dwell to serve: a run that starts throttled is caught at once.
        dwelt = self._since is None or t - self._since >= s.min_dwell_s
        out: list[Transition] = []
        if self._state is ThrottleState.OK:
            if hot and dwelt:
                out.append(self._move(t, ThrottleState.THROTTLED, sig))
        elif self._state is ThrottleState.THROTTLED:
            if not warm and dwelt:
                out.append(self._move(t, ThrottleState.RECOVERING, sig))
                self._quiet_since = t
        else:  # recovering
            if warm:
                self._quiet_since = None
            elif self._quiet_since is None:
                self._quiet_since = t
            if hot and dwelt:
                out.append(self._move(t, ThrottleState.THROTTLED, sig))
            elif self._quiet_since is not None and t - self._quiet_since >= s.recover_s and dwelt:
                out.append(self._move(t, ThrottleState.OK, sig))
        return out

    def _move(self, t: float, to: ThrottleState, sig: _Signals) -> Transition:
        tr = Transition(
            t_s=t,
            from_state=self._state,
            to_state=to,
            reasons=self._reason_list(sig),
            clock_ratio=sig.ratio,
            detail=sig.describe(),
        )
        self._state = to
        self._since = t
        self._transitions += 1
        if to is ThrottleState.THROTTLED:
            self._enters += 1
        return tr

    @staticmethod
    def _reason_list(sig: _Signals) -> tuple[str, ...]:
        names = list(reason_names(sig.bits)) if sig.bits else []
        names += [f"counter:{name}" for name in sig.grown]
        return tuple(names)

    def _counters(self, inp: ThrottleInput) -> None:
        # Time counters (ns) signal when one of the entering kinds grew; event counters (sysfs) on
        # any growth. Each keeps its own totals.
        self._grow(inp.throttle_ns, self._last_ns, self._per_reason_ns, inp.t_s, self.settings.enter_counters)
        self._grow(inp.throttle_counts, self._last_counts, self._per_reason_events, inp.t_s, None)

    def _grow(
        self,
        values: Mapping[str, int],
        last: dict[str, int],
        totals: dict[str, int],
        t_s: float,
        signal: frozenset[str] | None,
    ) -> None:
        for name, value in values.items():
            prev = last.get(name)
            last[name] = value
            if prev is None:
                continue
            delta, reset = counter_growth(prev, value)
            self._counter_resets += reset
            if delta > 0:
                totals[name] = totals.get(name, 0) + delta
                if signal is None or name in signal:
                    self._grown_at[name] = t_s

    def _entry(self, inp: ThrottleInput) -> _Entry:
        s = self.settings
        bits = 0
        raw = inp.reasons
        idle = raw is not None and bool(raw & GPU_IDLE)
        if raw is not None:
            bits = raw & ~s.benign_mask
            # A transient bit (HwSlowdown) counts only when the previous sample had it too.
            bits &= ~(s.transient_mask & ~self._prev_raw_bits)
            self._prev_raw_bits = raw
        ratio: float | None = None
        eligible = inp.active is not False and not idle
        if inp.sm_mhz is not None and inp.sm_mhz > 0 and eligible:
            ref = inp.ref_mhz
            if ref is None:
                if self._max_mhz is None and len(self._baseline) < s.baseline_samples:
                    self._baseline.append(float(inp.sm_mhz))
                ref = self.baseline_mhz
            if ref:
                ratio = float(inp.sm_mhz) / ref
                return _Entry(inp.t_s, bits, raw is not None, ratio, inp.thermal_margin_c, float(ref))
        return _Entry(inp.t_s, bits, raw is not None, ratio, inp.thermal_margin_c)

    def _signals(self, t: float) -> _Signals:
        s = self.settings
        with_reasons = [e for e in self._window if e.has_reasons]
        share = None
        bits = 0
        if with_reasons:
            flagged = [e for e in with_reasons if e.bits]
            share = len(flagged) / len(with_reasons)
            for e in flagged:
                bits |= e.bits
        ratios = [e.ratio for e in self._window if e.ratio is not None]
        ratio = statistics.median(ratios) if ratios else None
        margins = [e.margin for e in self._window if e.margin is not None]
        margin = min(margins) if margins else None
        grown = tuple(sorted(n for n, at in self._grown_at.items() if at > t - s.window_s))
        refs = [e.ref_mhz for e in self._window if e.ref_mhz is not None]
        ref = statistics.median(refs) if refs else None
        return _Signals(share, ratio, margin, grown, bits, ref)

    def _is_signal(self, sig: _Signals, *, leaving: bool) -> bool:
        s = self.settings
        if sig.grown:
            return True
        if sig.share is not None:
            if leaving and sig.share >= s.leave_fraction and sig.share > 0:
                return True
            if not leaving and sig.share >= s.enter_fraction:
                return True
        limit = s.clock_ratio_leave if leaving else s.clock_ratio_enter
        if sig.ratio is not None and sig.ratio < limit:
            return True
        margin_limit = s.thermal_margin_leave_c if leaving else s.thermal_margin_enter_c
        return sig.margin is not None and sig.margin < margin_limit


def host_input(
    t_s: float,
    cpu_mhz: float | None,
    max_mhz: float | None,
    throttle_counts: Mapping[str, int],
    margin_c: float | None,
    *,
    active: bool | None = None,
) -> ThrottleInput:
    """A reading of a host's CPUs for CPU-only soaks.

    `throttle_counts` are the cumulative sysfs thermal-throttle counts (e.g. {"package": n, "core": m});
    any increase signals throttling. The clock ratio is `cpu_mhz / max_mhz`; there is no bitmask.
    `margin_c` is degrees C left before the CPU's throttle temperature, if known.
    """
    return ThrottleInput(
        t_s=t_s,
        sm_mhz=cpu_mhz,
        reasons=None,
        thermal_margin_c=margin_c,
        active=active,
        throttle_counts=dict(throttle_counts),
        ref_mhz=max_mhz if max_mhz else None,
    )


THERMAL_REASONS: Final = 0x8 | 0x20 | 0x40 | 0x80
"""HwSlowdown, SW/HW thermal slowdown, HW power brake: the device protects itself (edge-GPU throttling)."""


# Defaults are written once, in the config's [control.harm]; the settings take them from there.
_HARM = HarmControlConfig()
_NONE: frozenset[str] = frozenset()
_SOME = frozenset({"?"})
"""Another process, its PID not known (the judge told only whether one was there)."""


@dataclass(frozen=True, slots=True)
class HarmSettings:
    """When throttling costs enough to act on. Losses are shares of the unthrottled SM clock."""

    window_s: float = _HARM.window
    """The loss is the median over this window of fast samples (a 100 ms tier: ~10 samples)."""
    power_loss: float = _HARM.power_loss
    """Clock loss under the SW power cap alone that counts as harm."""
    thermal_loss: float = _HARM.thermal_loss
    """Clock loss that counts as harm when a thermal, HW-slowdown or power-brake reason is set."""
    enter_s: float = _HARM.enter
    """The loss must hold this long before harm is declared."""
    leave_s: float = _HARM.leave
    """The loss must stay below half its threshold (or, under the power cap, the clock within half the
    threshold of the engine's own at-cap clock) this long before the harm is over."""
    stale_s: float = _HARM.stale
    """A power-cap episode whose loss has not reached its threshold for this long holds no evidence of its
    cause and ends ("bound"); the clock then is the engine's own at-cap level."""
    reference_samples: int = 300
    """The unthrottled clock: median of up to this many recent active samples with no throttle reason (the
    engine's own at-cap clock: as many samples with the power cap alone, outside harm)."""
    min_reference: int = 20
    """Fewer unthrottled samples than this: the device's max SM clock is the reference (fewer at-cap
    samples: no own at-cap level)."""

    def __post_init__(self) -> None:
        for name in ("window_s", "enter_s", "leave_s", "stale_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 <= v <= 3600):
                raise ValueError(f"{name} must be finite, 0-3600 s")
        if self.window_s <= 0 or self.stale_s <= 0:
            raise ValueError("window_s and stale_s must be > 0")
        if not (0 < self.thermal_loss <= self.power_loss < 1):
            raise ValueError("need 0 < thermal_loss <= power_loss < 1")
        if not (1 <= self.min_reference <= self.reference_samples <= 100_000):
            raise ValueError("need 1 <= min_reference <= reference_samples <= 100000")

    @classmethod
    def from_config(cls, h: HarmControlConfig) -> HarmSettings:
        """[control.harm]'s clock-loss thresholds and times."""
        return cls(
            window_s=h.window,
            power_loss=h.power_loss,
            thermal_loss=h.thermal_loss,
            enter_s=h.enter,
            leave_s=h.leave,
            stale_s=h.stale,
        )


ENDED_BY: Final = ("loss", "own_level", "bound")
"""How harm ends: the loss below half its threshold; the clock back within half the threshold of the
engine's own at-cap clock; the bound on an episode without evidence (`HarmSettings.stale_s`)."""


@dataclass(frozen=True, slots=True)
class HarmChange:
    """Harm began or ended."""

    t_s: float
    harmful: bool
    kind: str
    """"thermal" or "power"."""
    loss: float
    """Median clock loss over the window at the change (0-1)."""
    reference_mhz: float | None
    own_cap_mhz: float | None = None
    """The engine's own at-cap clock after the change (for "bound": the clock it was rebased to), None
    when unknown."""
    ended_by: str = ""
    """How it ended (one of `ENDED_BY`); "" when it began."""


def worst_harm(kinds: Iterable[str]) -> str:
    """One harm for several sources: "thermal" over any other kind (the device protecting itself weighs
    most), else any kind named, else ""."""
    named = {k for k in kinds if k}
    return "thermal" if "thermal" in named else min(named, default="")


class HarmJudge:
    """Feed every fast sample (time, SM clock, reason bits, thermal margin); `harmful` says whether the
    device has lost more clock than its reason class allows, for longer than `enter_s`.

    Harm ends when its cause ends. Under the power cap the judge keeps a second reference, the engine's
    own at-cap clock: the median of recent busy samples with the SW power cap alone, taken outside harm
    and its run-up. A window whose clock is within half the threshold of it is the engine's own doing:
    it neither begins harm nor keeps it going (an H200 draining its backlog alone at the cap lost ~6 %
    of clock, between half the threshold and the threshold, for minutes after the load had gone).
    Thermal harm keeps the strict test: its loss below half the threshold. A power-cap episode whose
    loss has not reached the threshold for `stale_s` ends on that bound, and the clock then becomes the
    own at-cap level, so a new episode needs a new drop."""

    def __init__(self, settings: HarmSettings | None = None, max_mhz: float | None = None) -> None:
        self.settings = settings or HarmSettings()
        self._max_mhz = max_mhz if max_mhz and max_mhz > 0 else None
        self._ref: deque[float] = deque(maxlen=self.settings.reference_samples)
        self._own: deque[float] = deque(maxlen=self.settings.reference_samples)
        self._own_pending: deque[tuple[float, float]] = deque()
        """At-cap samples still in the window: they join `_own` unless harm or its run-up comes first."""
        self._own_rebased = False
        # (t, loss, class: 0 none 1 power 2 thermal, a reason bit was set, SM clock when busy)
        self._window: deque[tuple[float, float, int, bool, float | None]] = deque()
        self._over_since: float | None = None
        self._under_since: float | None = None
        self._last_over: float | None = None
        """During an episode: the last time the loss was at its threshold (the evidence)."""
        self._last_t: float | None = None
        self.harmful = False
        self.kind = ""
        self.loss = 0.0
        """Median clock loss over the window now (0 when not judged)."""
        self.harm_s = 0.0
        self.episodes = 0
        self.ended_by: dict[str, int] = {}
        """Episodes ended, by how (`ENDED_BY`)."""
        self.max_loss = 0.0
        self.limited = 0.0
        """Share of the window's samples with a throttle reason set (the device at a limit)."""
        self.at_threshold = False
        """Whether the loss now is at the level that starts harm (False in an episode's tail, between
        half the threshold and the threshold, or below it, and near the engine's own at-cap clock)."""
        self.in_tail = False
        """An open episode whose loss has not been at the threshold for under `stale_s`: its cause may
        be over. Past `stale_s` in the band the loss is the device's level now, not a tail (a power
        episode ends there; a thermal one stays open, and is harm to act on again)."""

    @property
    def reference_mhz(self) -> float | None:
        if len(self._ref) >= self.settings.min_reference:
            return float(statistics.median(self._ref))
        return self._max_mhz

    @property
    def own_cap_mhz(self) -> float | None:
        """The engine's own clock at the power cap, None until `min_reference` samples (or a rebase)."""
        if self._own and (len(self._own) >= self.settings.min_reference or self._own_rebased):
            return float(statistics.median(self._own))
        return None

    def update(
        self,
        t_s: float,
        sm_mhz: float | None,
        reasons: int | None,
        *,
        active: bool | None = None,
        thermal_margin_c: float | None = None,
        margin_limit_c: float = 5.0,
    ) -> HarmChange | None:
        s = self.settings
        if self._last_t is not None:
            if t_s < self._last_t:
                raise ValueError(f"readings out of order: {t_s} after {self._last_t}")
            if self.harmful:
                self.harm_s += t_s - self._last_t
        self._last_t = t_s
        idle = reasons is not None and bool(reasons & GPU_IDLE)
        bad = 0 if reasons is None else reasons & ~BENIGN_REASONS
        cls = 2 if bad & THERMAL_REASONS else 1 if bad else 0
        if thermal_margin_c is not None and thermal_margin_c < margin_limit_c:
            cls = 2
        if reasons is None and cls == 0:
            cls = 1  # no bitmask to read: a clock loss is taken as a power-cap loss
        loss = 0.0
        clock: float | None = None
        # A throttle reason means the device draws power: busy, whatever a stale utilization said.
        if sm_mhz is not None and sm_mhz > 0 and (active is not False or bad) and not idle:
            clock = float(sm_mhz)
            if bad == 0 and reasons is not None:
                self._ref.append(clock)
            ref = self.reference_mhz
            if ref and cls:
                loss = max(0.0, 1.0 - clock / ref)
        else:
            cls = 0  # an idle device loses no work to its clock
        self._window.append((t_s, loss, cls, bad != 0, clock))
        while self._window and self._window[0][0] <= t_s - s.window_s:
            self._window.popleft()
        losses = [x[1] for x in self._window]
        self.loss = float(statistics.median(losses)) if losses else 0.0
        self.limited = sum(1 for x in self._window if x[3]) / len(self._window)
        self.max_loss = max(self.max_loss, self.loss)
        worst = max((x[2] for x in self._window), default=0)
        change = self._judge(t_s, worst)
        # The engine's own at-cap clock: samples with the power cap alone, once out of the window with
        # neither harm nor its run-up begun meanwhile (the first samples of a drop are not its level).
        if clock is not None and cls == 1 and bad & SW_POWER_CAP:
            self._own_pending.append((t_s, clock))
        if self.harmful or self._over_since is not None:
            self._own_pending.clear()
        while self._own_pending and self._own_pending[0][0] <= t_s - s.window_s:
            self._own.append(self._own_pending.popleft()[1])
        return change

    def _judge(self, t_s: float, worst: int) -> HarmChange | None:
        change = self._judge_episode(t_s, worst)
        self.in_tail = (
            self.harmful
            and not self.at_threshold
            and self._last_over is not None
            and t_s - self._last_over < self.settings.stale_s
        )
        return change

    def _judge_episode(self, t_s: float, worst: int) -> HarmChange | None:
        s = self.settings
        threshold = s.thermal_loss if worst == 2 else s.power_loss
        kind = "thermal" if worst == 2 else "power"
        # Within half the threshold of the engine's own at-cap clock: its own doing, neither the start
        # nor the continuation of harm (never for thermal reasons: the device protecting itself).
        own = None if worst == 2 or self.kind == "thermal" else self.own_cap_mhz
        clocks = [x[4] for x in self._window if x[4] is not None]
        near_own = own is not None and bool(clocks) and 1 - statistics.median(clocks) / own < threshold / 2
        self.at_threshold = self.loss >= threshold and not near_own
        if self.at_threshold:
            self._under_since = None
            if self._over_since is None:
                self._over_since = t_s
            if self.harmful:
                self._last_over = t_s
                if kind == "thermal":
                    self.kind = kind
            elif t_s - self._over_since >= s.enter_s:
                self.harmful, self.kind, self._last_over = True, kind, t_s
                self.episodes += 1
                return HarmChange(t_s, True, kind, self.loss, self.reference_mhz, self.own_cap_mhz)
            return None
        self._over_since = None
        if self.loss < threshold / 2 or near_own:
            if self._under_since is None:
                self._under_since = t_s
            if self.harmful and t_s - self._under_since >= s.leave_s:
                return self._end(t_s, "loss" if self.loss < threshold / 2 else "own_level")
        else:
            self._under_since = None
        stale = self._last_over is not None and t_s - self._last_over >= s.stale_s
        if self.harmful and self.kind == "power" and stale:
            # In the band for stale_s: the clock now is the engine's own level, a new episode a new drop.
            self._own.clear()
            self._own.extend(clocks)
            self._own_rebased = bool(clocks)
            self._own_pending.clear()
            return self._end(t_s, "bound")
        return None

    def _end(self, t_s: float, how: str) -> HarmChange:
        change = HarmChange(
            t_s, False, self.kind, self.loss, self.reference_mhz, self.own_cap_mhz, ended_by=how
        )
        self.harmful, self.kind, self._last_over = False, "", None
        self.ended_by[how] = self.ended_by.get(how, 0) + 1
        return change

    def summary(self) -> dict[str, object]:
        own = self.own_cap_mhz
        return {
            "harmful": self.harmful,
            "harm_s": round(self.harm_s, 3),
            "episodes": self.episodes,
            "ended_by": dict(sorted(self.ended_by.items())),
            "max_clock_loss": round(self.max_loss, 4),
            "reference_mhz": self.reference_mhz,
            "own_cap_mhz": None if own is None else round(own, 1),
        }


@dataclass(frozen=True, slots=True)
class ThroughputSettings:
    """When a limit costs throughput: the engine's tokens/s while requests wait, against its own recent
    level. Clock loss misses the case where the limit is shared (another process at the power cap takes
    SM time, not clock: on an H200, 6 % clock and 35 % of tokens)."""

    loss: float = _HARM.throughput_loss
    """Share of the engine's own tokens/s lost while the device is at a limit."""
    recent: int = 3
    """The loss is judged on the median of this many recent control intervals."""
    reference: int = 60
    """The engine's own tokens/s: median of up to this many intervals with a queue, at a limit or not,
    before the recent ones and outside throughput harm."""
    min_reference: int = 10
    step: int = 10
    """The loss must also show against this many intervals just before the recent ones (their median the
    whole loss, each of them half of it): a limit shared with another process arrives as a step, while an
    engine alone at the cap drifts with its workload (on an H200 at 64 requests: 6-11k tok/s from second
    to second, 20 % down over a minute)."""
    leave_s: float = _HARM.leave
    """The harm is over once most of its last `leave_s` had no limit, less than half the loss, or tokens/s
    recovered."""
    prefill_weight: float = _HARM.prefill_weight
    """Each prompt token the engine computed (not served from its prefix cache) counts as this share of an
    output token in the tokens/s judged. An engine that is busy spends its step time on prefill when long
    prompts arrive, and serves fewer output tokens for it: on an H100 (8B shape, twice the trace's rate,
    64 requests and a queue, no outside load) output tokens/s fell 0.17-0.22 per prompt token/s, and a
    3 s surge of prompts (8k prompt tok/s against ~3k) read as a 24 % loss, harm with no cause outside
    the engine. A limit shared with another process lowers both. That per-second fit's slope is biased
    low by the noise in per-second prompt counts (the reverse fit bounds it at ~0.75). Replayed over every
    recorded matrix arm, any weight from 0.3 to 1.0 leaves each shared load's first detection in its
    second and leaves no episode without an outside cause."""

    def __post_init__(self) -> None:
        if not 0 < self.loss < 1:
            raise ValueError("loss must be in (0, 1)")
        if not (1 <= self.recent <= 100 and 1 <= self.min_reference <= self.reference <= 100_000):
            raise ValueError("need 1 <= recent <= 100 and 1 <= min_reference <= reference <= 100000")
        if not 1 <= self.step <= 1000:
            raise ValueError("step must be 1-1000 intervals")
        if not (math.isfinite(self.leave_s) and 0 <= self.leave_s <= 3600):
            raise ValueError("leave_s must be finite, 0-3600 s")
        if not (math.isfinite(self.prefill_weight) and 0 <= self.prefill_weight <= 4):
            raise ValueError("prefill_weight must be finite, 0-4")

    @classmethod
    def from_config(cls, h: HarmControlConfig) -> ThroughputSettings:
        """[control.harm]'s throughput loss and prefill weight, and its `leave` (the clock harm's too)."""
        return cls(loss=h.throughput_loss, leave_s=h.leave, prefill_weight=h.prefill_weight)


class ThroughputJudge:
    """Feed each control interval: tokens/s (output tokens, plus the prompt tokens the engine computed at
    `prefill_weight`), whether requests waited for admission (only then is tokens/s
    the engine's capacity, not the offered load; a backlog growing inside the engine counts too, see
    `_backlog`), the requests in the engine, and whether the device was at a limit (a throttle reason in
    most samples) and the GPU's power. Harm: at a limit in each recent interval, with a queue, tokens/s
    below (1 - loss) x the reference and as far below the intervals just before (a step), with the GPU
    as busy as in those intervals (`_gpu_as_busy`).

    The reference is the engine's own steady level: intervals with a queue whether at a limit or not,
    never those of a throughput-harm episode (nor the drop that began it) and never the recent intervals
    being judged, so a fresh drop does not drag its own reference down. The limit does not gate it: an
    engine at the power cap most of the time (~80 % of seconds on an H200) never had the intervals for an
    unlimited reference, and a 40 % fall under a shared load read as no loss; the shared load is kept out
    of the reference by the episode and the step, not by the limit bit. Until enough intervals with a
    queue exist, the reference is what the engine served lately with none (the median of the last
    `min_reference` busy intervals: the offered load, all of it served, a lower bound of its capacity
    that follows the trace): on an H200 whose queue formed only when a shared load arrived, the only
    intervals with a queue were the loaded ones, and a 27-45 % fall made its own reference.

    Over once most of the episode's last `leave_s` were quiet: the limit gone, the loss below half, or
    tokens/s recovered by the loss's share over the episode's own level (the drop that began it reversed).
    Most, not all: an engine alone at 64 requests can sit at an H200's power cap most of the time with
    tokens/s that wander a third from second to second, back at a limit with a loss now and then, which
    a run of quiet seconds would have to outlast long after the outside load has gone. On a recovery the
    reference restarts from the recovered figures, so a new episode needs a new drop."""

    def __init__(self, settings: ThroughputSettings | None = None) -> None:
        self.settings = settings or ThroughputSettings()
        self._ref: deque[float] = deque(maxlen=self.settings.reference)
        self._served: deque[float] = deque(maxlen=self.settings.min_reference)
        """tokens/s of the last busy intervals without a queue: the reference until `_ref` has enough."""
        self._pending: deque[tuple[float, bool]] = deque()
        """Intervals (tokens/s, with a queue) not yet in a reference: the recent ones, being judged."""
        self._binding_seen = 0
        self._recent: deque[tuple[float, bool]] = deque(maxlen=self.settings.recent)
        self._history: deque[tuple[float, float | None, frozenset[str] | None]] = deque(
            maxlen=self.settings.recent + self.settings.step
        )
        """(tokens/s, the GPU's power in W or None when unknown, the other processes on the GPU or None when
        unknown) of the last intervals: the recent ones and the `step` before them, what a step is judged
        against."""
        self.shared_intervals = 0
        """Intervals with another process computing on the engine's GPU (where the process list is known)."""
        self.cotenant_entries = 0
        """Episodes begun with another process newly on the GPU: the power gate did not apply."""
        self._flight: deque[tuple[float, float]] = deque(maxlen=self.settings.step)
        """(requests in the engine, tokens/s) of the last `step` intervals: what a backlog is seen against."""
        self.backlogs = 0
        """Intervals read as the engine's capacity from a backlog in it (no queue for admission yet)."""
        self._episode: deque[float] = deque(maxlen=self.settings.reference)
        """tokens/s with a queue during the episode: its level, which a recovery is measured from."""
        self._lately: deque[tuple[float, bool, float | None]] = deque()
        """The episode's last `leave_s`: (time, quiet, tokens/s when requests waited)."""
        self._began: float | None = None
        self._rebased = False
        """The reference restarted from a recovery's figures (few, but measured at this workload)."""
        self.harmful = False
        self.at_threshold = False
        """The last interval was harm's own (at a limit with the loss), not one of an episode's quiet ones:
        harm now, whose cause is present, not its tail."""
        self.loss = 0.0
        self.episodes = 0

    @property
    def reference(self) -> float | None:
        kind = self.reference_kind
        if kind == "capacity":
            return float(statistics.median(self._ref))
        # The offered load follows the trace: what it served lately (the last `min_reference`), not since
        # the run's ramp-up.
        return float(statistics.median(self._served)) if kind == "served" else None

    @property
    def reference_kind(self) -> str:
        """Which reference is in use: capacity (intervals with a queue), served (the offered load served
        in full) or empty (none)."""
        if self._ref and (len(self._ref) >= self.settings.min_reference or self._rebased):
            return "capacity"
        return "served" if len(self._served) == self._served.maxlen else ""

    def update(
        self,
        t_s: float,
        tokens_per_s: float,
        *,
        binding: bool,
        limited: bool,
        in_flight: int | None = None,
        prefill_per_s: float | None = None,
        power_w: float | None = None,
        shared: frozenset[str] | bool | None = None,
    ) -> bool | None:
        """The new harm state when it changed (True: began, False: ended), else None. `in_flight`: requests
        in the engine now (None while the replay drains: no arrivals, so no backlog can show).
        `prefill_per_s`: prompt tokens the engine computed per second over the interval (None: unknown,
        output tokens alone are judged); they count at the settings' `prefill_weight`. `power_w`: the
        GPU's mean power over the interval (None: unknown, see `_gpu_as_busy`). `shared`: the PIDs of
        other processes with a compute context on the GPU, or where only that is known, whether one had
        (None: unknown)."""
        s = self.settings
        if prefill_per_s is not None and prefill_per_s > 0:
            tokens_per_s += s.prefill_weight * prefill_per_s
        if not binding and in_flight is not None and self._backlog(tokens_per_s, in_flight):
            binding = True
            self.backlogs += 1
        if in_flight is not None:
            self._flight.append((float(in_flight), tokens_per_s))
        others = shared if isinstance(shared, frozenset) or shared is None else _SOME if shared else _NONE
        self._history.append((tokens_per_s, power_w, others))
        self.shared_intervals += bool(others)
        if binding:
            self._recent.append((tokens_per_s, limited))
            self._binding_seen += 1
        else:
            self._recent.clear()
        self._pending.append((tokens_per_s, binding))
        # An interval joins a reference once it is no longer judged (`recent` later ones) with no harm
        # meanwhile: with a queue, the capacity; without, the load served in full (idle ones left out).
        while len(self._pending) > s.recent:
            value, queued = self._pending.popleft()
            if queued:
                self._ref.append(value)
            elif value > 0:
                self._served.append(value)
        change = self._judge(t_s, tokens_per_s, binding=binding, limited=limited)
        if self.harmful or change is False:
            self._pending.clear()  # the episode's intervals, and the drop that began it, are no reference
        return change

    def _judge(self, t_s: float, tokens_per_s: float, *, binding: bool, limited: bool) -> bool | None:
        s = self.settings
        ref = self.reference
        full = len(self._recent) == s.recent
        median = statistics.median(x for x, _ in self._recent) if full else 0.0
        self.loss = max(0.0, 1 - float(median) / ref) if ref and full else 0.0
        # At a limit in every recent interval: vLLM alone touches an H200's power cap for a second now
        # and then while its tokens/s wander with the workload.
        held = full and all(lim for _, lim in self._recent)
        recovered = self._recovered(float(median)) if full else False
        self.at_threshold = False
        if (
            held
            and self.loss >= s.loss
            and not recovered
            and (self.harmful or (self._stepped(float(median)) and self._gpu_as_busy()))
        ):
            self.at_threshold = True
            began = not self.harmful
            if began:
                self.harmful, self._began = True, t_s
                self.episodes += 1
                self.cotenant_entries += self.cotenant
            self._note(t_s, tokens_per_s, binding=binding, quiet=False)
            return True if began else None
        if not self.harmful:
            return None
        quiet = not limited or self.loss < s.loss / 2 or recovered
        self._note(t_s, tokens_per_s, binding=binding, quiet=quiet)
        if not self._settled(t_s):
            return None
        if recovered:  # the old reference belongs to a workload that has moved on
            self._ref.clear()
            self._ref.extend(x for _, quiet, x in self._lately if quiet and x is not None)
            self._rebased = True
        self._end()
        return False

    def _note(self, t_s: float, tokens_per_s: float, *, binding: bool, quiet: bool) -> None:
        """One interval of the episode: its level (with a queue) and whether it was quiet."""
        if binding and not quiet:
            self._episode.append(tokens_per_s)
        self._lately.append((t_s, quiet, tokens_per_s if binding else None))
        while self._lately[0][0] < t_s - self.settings.leave_s:
            self._lately.popleft()

    def _settled(self, t_s: float) -> bool:
        """The episode is older than `leave_s` and most of its last `leave_s` were quiet."""
        assert self._began is not None
        if t_s - self._began <= self.settings.leave_s:
            return False
        quiet = sum(1 for _, q, _ in self._lately if q)
        return 2 * quiet > len(self._lately)

    def summary(self) -> dict[str, object]:
        """The judge's state; without a reference it says why, so a loss of 0 is never silent."""
        s = self.settings
        ref = self.reference
        out: dict[str, object] = {
            "harmful": self.harmful,
            "episodes": self.episodes,
            "loss": round(self.loss, 4),
            "reference_tps": None if ref is None else round(ref, 3),
            "reference_kind": self.reference_kind,
            "backlog_intervals": self.backlogs,
            "prefill_weight": s.prefill_weight,
            "cotenant_intervals": self.shared_intervals,
            "cotenant_entries": self.cotenant_entries,
        }
        if ref is None:
            out["reference_note"] = (
                f"no reference: never {s.min_reference} intervals with requests waiting "
                f"({self._binding_seen} seen) nor {s.min_reference} busy ones without"
                if self._binding_seen < s.min_reference
                else f"no reference: {len(self._ref)} of the {s.min_reference} intervals with requests "
                f"waiting it needs (the last {s.recent}, being judged, and those in throughput harm do not "
                "count)"
            )
        return out

    def _backlog(self, tokens_per_s: float, in_flight: int) -> bool:
        """The engine falls behind with no queue yet: requests in it up by half the loss's share over the
        `step` intervals before, tokens/s down by the whole loss. Arrivals outpace completions (Little's
        law), so tokens/s are no longer the offered load served in full but what the engine could do: on
        an H200 a shared load cut tokens/s by 80-90 % at once while the batch filled (30 -> 64 requests)
        for 3.5 s before anyone waited for admission. A trace's lull moves both down; a burst of
        arrivals raises tokens/s with the requests."""
        if len(self._flight) < self.settings.step:
            return False
        loss = self.settings.loss
        flight = statistics.median(f for f, _ in self._flight)
        level = statistics.median(x for _, x in self._flight)
        return flight > 0 and in_flight >= (1 + loss / 2) * flight and tokens_per_s <= (1 - loss) * level

    def _stepped(self, median: float) -> bool:
        """The recent median is the loss's share below the intervals just before (queue or not: without
        one, tokens/s are the offered load, which the engine served), and each recent interval at least
        half of it: a shared limit moves them all, an engine alone at the cap dips for a second or two."""
        s = self.settings
        before = [x for x, _, _ in list(self._history)[: -s.recent]]
        if len(before) < s.step:
            return False
        level = float(statistics.median(before))
        worst = max(x for x, _ in self._recent)
        return median <= (1 - s.loss) * level and worst <= (1 - s.loss / 2) * level

    def _gpu_as_busy(self) -> bool:
        """The GPU's power in the recent intervals is not down by half the loss's share or more against
        the `step` intervals just before (True when either is unknown). Tokens lost with the GPU as busy
        as before went to something else on it (another process, a lower clock); tokens lost with its
        power down as much are an engine that gave its GPU less work. On an H100 at its own power cap
        (no outside load) the engine's steps slowed from ~36 to 26 a second for 3 s while the GPU's
        power fell from 522 to 418 W (median) and its clock rose: 20 % fewer tokens, read as harm. Every
        shared load recorded on an H200 or H100 (25 arms) had raised the GPU's power by 26-59 % over the
        same window when the judge saw it.

        With another process newly on the GPU (`cotenant`) the gate does not apply: a newcomer's work
        need not raise the power (a memory-bound neighbour at low power still takes SM time), and one
        whose drop the gate let pass would not be judged again once the drop joined the reference. One
        there through the whole window is no newcomer: an idle notebook holding tensors, or the load
        process of every recorded arm, which sat on the GPU 18 s before it computed; with the gate
        lifted for any co-tenant, round 10's false episode came back."""
        s = self.settings
        if self.cotenant:
            return True
        powers = [p for _, p, _ in self._history]
        recent = [p for p in powers[-s.recent :] if p is not None]
        before = [p for p in powers[: -s.recent] if p is not None]
        if len(recent) < s.recent or len(before) < s.step:
            return True
        return statistics.median(recent) >= (1 - s.loss / 2) * statistics.median(before)

    @property
    def cotenant(self) -> bool:
        """A newcomer on the GPU: a process had a compute context in one of the recent intervals and not
        in some interval of the window judged (the recent ones and the `step` before them). By PID, so
        a second process beside one there all along is new too. An interval whose list is unknown says
        nothing: one there all along is not new for having been out of sight."""
        sets = [others for _, _, others in self._history]
        recent = frozenset().union(*(o for o in sets[-self.settings.recent :] if o is not None))
        return any(pid not in others for pid in recent for others in sets if others is not None)

    def _recovered(self, median: float) -> bool:
        """tokens/s back up by the loss's share over the episode's level (only during an episode)."""
        if not self.harmful or len(self._episode) < self.settings.recent:
            return False
        level = float(statistics.median(self._episode))
        return level > 0 and median >= level / (1 - self.settings.loss)

    def _end(self) -> None:
        self.harmful = False
        self._began = None
        self._episode.clear()
        self._lately.clear()
