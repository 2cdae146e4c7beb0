"""Batch downscaling and upscaling on throttling: a pure state machine over (time, throttle state, tokens/s).

Field notes: a large batch that throttles delivers less than a smaller one the device sustains. So
when the device has been throttled for `dwell_s`, lower the concurrency ceiling by a step (never
below the floor); give the clocks `settle_s` to answer before lowering again; after `cooldown_s`
with no throttling, raise it a step (never above the configured start). A level that throttled again
within the cool-down after an upscale is blocked for `retry_s`, so the ceiling does not saw between two
levels all night. A level held for `sustain_s` without throttling is the sustained operating point,
recorded with its throughput: the answer the soak engineer takes to production.

No I/O and no clock of its own: every call carries its time; the actuator applies the actions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

Direction = Literal["downscale", "upscale"]


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """Thresholds of the batch policy; times in seconds of the callers' clock."""

    start: int
    """The configured ceiling (replay.max_concurrency): never exceeded."""
    floor: int = 1
    """Never below this."""
    step: float = 0.25
    """Each action moves the ceiling by this fraction of the current one (at least one sequence)."""
    dwell_s: float = 30.0
    """Throttled this long without a break before a downscale."""
    settle_s: float = 60.0
    """After any action, this long before the next downscale: the clocks need time to answer."""
    cooldown_s: float = 300.0
    """No throttling for this long (and this long after the last action) before an upscale."""
    sustain_s: float = 600.0
    """A ceiling held this long without throttling is the sustained operating point."""
    retry_s: float = 3600.0
    """A level that throttled again within the cool-down after an upscale is not tried again for this long."""

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.start:
            raise ValueError(f"need 1 <= floor ({self.floor}) <= start ({self.start})")
        if not 0 < self.step < 1:
            raise ValueError("step must be a fraction in (0, 1)")
        if min(self.dwell_s, self.settle_s, self.cooldown_s, self.sustain_s, self.retry_s) < 0:
            raise ValueError("times must be >= 0")


@dataclass(frozen=True, slots=True)
class BatchAction:
    """One change of the concurrency ceiling, with why and on what evidence."""

    t_s: float
    kind: Direction
    from_limit: int
    to_limit: int
    reason: str
    evidence: dict[str, float | int | str] = field(default_factory=dict)


@dataclass(slots=True)
class _Level:
    """Throughput seen at one ceiling (for the before/after of each action and the sustained point)."""

    tokens: float = 0.0
    seconds: float = 0.0
    throttled_s: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


class BatchPolicy:
    """Feed `update(t, throttled, tokens, interval_s)` in time order; it returns the actions to take."""

    def __init__(self, settings: BatchSettings) -> None:
        self.settings = settings
        self.limit = settings.start
        self._throttled_since: float | None = None
        self._quiet_since: float | None = None
        self._last_action_t: float | None = None
        self._last_upscale: tuple[float, int] | None = None  # (time, level reached)
        self._blocked: dict[int, float] = {}  # level -> blocked until
        self._level_since: float | None = None
        self._levels: dict[int, _Level] = {}
        self.sustained: dict[str, float | int] | None = None
        """The highest level held `sustain_s` without throttling: {limit, since_s, tokens_per_s}."""
        self.actions = 0

    def _step(self, limit: int) -> int:
        return max(1, math.floor(limit * self.settings.step))

    def update(
        self, t_s: float, throttled: bool, tokens: float = 0.0, interval_s: float = 0.0
    ) -> list[BatchAction]:
        """One reading: whether the device is throttled now, and the tokens generated in the
        `interval_s` before `t_s` (for the throughput per level)."""
        s = self.settings
        if self._level_since is None:
            self._level_since = t_s
        level = self._levels.setdefault(self.limit, _Level())
        level.tokens += tokens
        level.seconds += interval_s
        if throttled:
            level.throttled_s += interval_s
            self._quiet_since = None
            if self._throttled_since is None:
                self._throttled_since = t_s
        else:
            self._throttled_since = None
            if self._quiet_since is None:
                self._quiet_since = t_s
        self._note_sustained(t_s)
        since_action = math.inf if self._last_action_t is None else t_s - self._last_action_t
        out: list[BatchAction] = []
        if throttled and self._throttled_since is not None:
            held = t_s - self._throttled_since
            if held >= s.dwell_s and since_action >= s.settle_s and self.limit > s.floor:
                self._block_if_bounced(t_s)
                target = max(s.floor, self.limit - self._step(self.limit))
                out.append(
                    self._act(
                        t_s,
                        "downscale",
                        target,
                        f"throttled for {held:.0f} s (>= {s.dwell_s:g} s): ceiling {self.limit} -> {target}",
                        {"throttled_for_s": round(held, 3)},
                    )
                )
        elif not throttled and self._quiet_since is not None and self.limit < s.start:
            quiet = t_s - self._quiet_since
            if quiet >= s.cooldown_s and since_action >= s.cooldown_s:
                target = min(s.start, self.limit + self._step(self.limit))
                while target > self.limit and self._blocked.get(target, -math.inf) > t_s:
                    target -= 1
                if target > self.limit:
                    out.append(
                        self._act(
                            t_s,
                            "upscale",
                            target,
                            f"no throttling for {quiet:.0f} s (>= {s.cooldown_s:g} s): "
                            f"ceiling {self.limit} -> {target}",
                            {"quiet_for_s": round(quiet, 3)},
                        )
                    )
        return out

    def _block_if_bounced(self, t_s: float) -> None:
        # Throttled again soon after an upscale: that level is more than the device holds.
        if self._last_upscale is None:
            return
        at, reached = self._last_upscale
        if reached == self.limit and t_s - at <= self.settings.cooldown_s + self.settings.dwell_s:
            self._blocked[reached] = t_s + self.settings.retry_s

    def _note_sustained(self, t_s: float) -> None:
        s = self.settings
        if self._quiet_since is None or self._level_since is None:
            return
        held = t_s - max(self._quiet_since, self._level_since)
        if held < s.sustain_s:
            return
        if self.sustained is None or int(self.sustained["limit"]) <= self.limit:
            tps = self._levels[self.limit].tokens_per_s
            if self.sustained is None or int(self.sustained["limit"]) != self.limit:
                self.sustained = {
                    "limit": self.limit,
                    "since_s": round(max(self._quiet_since, self._level_since), 3),
                }
            if tps is not None:
                self.sustained["tokens_per_s"] = round(tps, 3)

    def _act(
        self, t_s: float, kind: Direction, target: int, reason: str, extra: dict[str, Any]
    ) -> BatchAction:
        before = self._levels.get(self.limit, _Level())
        evidence: dict[str, float | int | str] = {
            **extra,
            "level_s": round(before.seconds, 3),
            "level_throttled_s": round(before.throttled_s, 3),
        }
        if before.tokens_per_s is not None:
            evidence["tokens_per_s_before"] = round(before.tokens_per_s, 3)
        blocked = sorted(level for level, until in self._blocked.items() if until > t_s)
        if blocked:
            evidence["blocked_levels"] = ",".join(map(str, blocked))
        action = BatchAction(t_s, kind, self.limit, target, reason, evidence)
        if kind == "upscale":
            self._last_upscale = (t_s, target)
        self.limit = target
        self._last_action_t = t_s
        self._level_since = t_s
        self._throttled_since = None if kind == "downscale" else self._throttled_since
        self.actions += 1
        return action

    def tokens_per_s(self, limit: int) -> float | None:
        level = self._levels.get(limit)
        return None if level is None else level.tokens_per_s

    def levels(self) -> dict[str, dict[str, float | None]]:
        """Per ceiling: seconds at it, throttled seconds, tokens/s (for the summary)."""
        return {
            str(k): {
                "seconds": round(v.seconds, 3),
                "throttled_s": round(v.throttled_s, 3),
                "tokens_per_s": v.tokens_per_s,
            }
            for k, v in sorted(self._levels.items())
        }

    # --- state that survives a daemon restart -----------------------------------------------------
    def to_state(self, now_s: float) -> dict[str, Any]:
        """JSON-able state; times as ages (seconds before `now_s`), so another clock can read them back."""

        def age(t: float | None) -> float | None:
            return None if t is None else now_s - t

        return {
            "limit": self.limit,
            "last_action_age_s": age(self._last_action_t),
            "last_upscale": None
            if self._last_upscale is None
            else [now_s - self._last_upscale[0], self._last_upscale[1]],
            "blocked": {str(k): until - now_s for k, until in self._blocked.items() if until > now_s},
            "sustained": self.sustained,
            "actions": self.actions,
            "levels": {str(k): [v.tokens, v.seconds, v.throttled_s] for k, v in self._levels.items()},
        }

    @classmethod
    def from_state(cls, settings: BatchSettings, state: dict[str, Any], now_s: float) -> BatchPolicy:
        p = cls(settings)
        p.limit = min(settings.start, max(settings.floor, int(state.get("limit", settings.start))))
        age = state.get("last_action_age_s")
        p._last_action_t = None if age is None else now_s - float(age)
        up = state.get("last_upscale")
        p._last_upscale = None if up is None else (now_s - float(up[0]), int(up[1]))
        p._blocked = {int(k): now_s + float(v) for k, v in (state.get("blocked") or {}).items()}
        p.sustained = state.get("sustained")
        p.actions = int(state.get("actions", 0))
        for k, (tokens, seconds, throttled) in (state.get("levels") or {}).items():
            p._levels[int(k)] = _Level(float(tokens), float(seconds), float(throttled))
        return p
