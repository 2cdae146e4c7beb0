"""The batch policy: move the concurrency ceiling only where the move pays on a stated objective.

Field notes: on an edge GPU a large batch that throttles delivers less than a smaller one the device
sustains. On a datacenter GPU running at its power limit is normal operation, and a smaller batch only
gives up tokens. So the policy does not react to throttling as such; it acts on *harm* (a sustained clock
loss, see policies/throttle.HarmJudge), only while the ceiling binds (requests wait for admission: a
lower ceiling that does not bind changes nothing), and it verifies every downscale as an experiment:

1. harm held for `dwell_s`, the ceiling binding: the objective over the last `eval_s` at this level under
   harm is the *before*; lower the ceiling one step (a trial);
2. wait `settle_s` (running requests finish down to the new limit), then measure the objective for
   `eval_s` at the new level under the same harm: the *after*;
3. keep the level when after >= before x (1 + `min_gain`); otherwise revert to the level before and block
   the lower level for `retry_s`. Harm that ends during the settle or the evaluation makes the trial
   inconclusive: the level is kept and the upscale below needs only `settle_s` of quiet. A queue that
   empties during the evaluation leaves no evidence (the objective follows the offered load): back to
   the level before, not blocked.

When the harm has been gone for `recover_s`, the ceiling goes back up the way it came, a level per
`settle_s + eval_s`. A level that brought harm back within `recover_s + dwell_s` of an upscale is blocked
for `retry_s`, so the ceiling does not saw between two levels all night. Every action and every verdict
on one carries the objective before and after. In `dry_run` nothing is applied, so nothing can be
verified: the policy says once per harm episode what it would try, and every figure stays with the level
actually in force.

Objectives: `goodput` (output tokens/s of requests that met the TTFT and TPOT limits of [criteria],
DistServe's goodput in tokens), `tokens` (output tokens/s), `tokens_per_joule` (output tokens per joule of
GPU energy). No I/O and no clock of its own: every call carries its time.

Over 500 lines because the trial, verification, revert and recovery steps are one state machine over one
objective window.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from soakd.config import BatchControlConfig

Direction = Literal["downscale", "upscale", "revert"]
Objective = Literal["goodput", "tokens", "tokens_per_joule"]
OBJECTIVES: tuple[Objective, ...] = ("goodput", "tokens", "tokens_per_joule")
OBJECTIVE_UNIT: dict[str, str] = {
    "goodput": "good tok/s",
    "tokens": "tok/s",
    "tokens_per_joule": "tok/J",
}


# Defaults are written once, in the config's [control.batch]; the policy takes them from there.
_CONFIG = BatchControlConfig()


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """Thresholds of the batch policy; times in seconds of the callers' clock."""

    start: int
    """The configured ceiling (replay.max_concurrency): never exceeded."""
    floor: int = _CONFIG.floor
    """Never below this."""
    step: float = _CONFIG.step
    """Each action moves the ceiling by this fraction of the current one (at least one sequence)."""
    objective: Objective = _CONFIG.objective
    dwell_s: float = _CONFIG.dwell
    """Harm held this long without a break before a downscale is tried."""
    settle_s: float = _CONFIG.settle
    """After an action, this long before the objective is measured (running requests finish)."""
    eval_s: float = _CONFIG.eval
    """The objective is measured over this long before and after an action."""
    min_gain: float = _CONFIG.min_gain
    """A downscale is kept only when the objective gained at least this share."""
    min_binding: float = _CONFIG.min_binding
    """Share of the before-window in which requests waited for admission (the ceiling bound)."""
    recover_s: float = _CONFIG.cooldown
    """No harm for this long before an upscale."""
    sustain_s: float = _CONFIG.sustain
    """A ceiling held this long without harm is the sustained operating point."""
    retry_s: float = _CONFIG.retry
    """A level that did not pay (or that brought harm back) is not tried again for this long."""
    dry_run: bool = False
    """Advise, do not act: nothing is verified, figures stay with the level in force (start)."""

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.start:
            raise ValueError(f"need 1 <= floor ({self.floor}) <= start ({self.start})")
        if not 0 < self.step < 1:
            raise ValueError("step must be a fraction in (0, 1)")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}")
        times = (self.dwell_s, self.settle_s, self.eval_s, self.recover_s, self.sustain_s, self.retry_s)
        if not all(math.isfinite(x) and x >= 0 for x in times) or self.eval_s <= 0:
            raise ValueError("times must be finite and >= 0, eval_s > 0")
        if not (0 <= self.min_gain < 10 and 0 <= self.min_binding <= 1):
            raise ValueError("need 0 <= min_gain < 10 and 0 <= min_binding <= 1")

    @classmethod
    def from_config(cls, b: BatchControlConfig, start: int, dry_run: bool = False) -> BatchSettings:
        """[control.batch] with the replay's ceiling as `start` (the floor never above it)."""
        return cls(
            start=start,
            floor=min(b.floor, start),
            step=b.step,
            objective=b.objective,
            dwell_s=b.dwell,
            settle_s=b.settle,
            eval_s=b.eval,
            min_gain=b.min_gain,
            min_binding=b.min_binding,
            recover_s=b.cooldown,
            sustain_s=b.sustain,
            retry_s=b.retry,
            dry_run=dry_run,
        )


@dataclass(frozen=True, slots=True)
class Tick:
    """One control interval's evidence."""

    t_s: float
    interval_s: float
    harm: bool
    """A sustained clock loss (HarmJudge) on the devices in scope."""
    harm_kind: str = ""
    """"thermal" or "power" (the reason class of the harm), empty when none."""
    throttled: bool = False
    """The throttle episode state (recorded; the policy acts on harm, not on this)."""
    binding: bool = False
    """Requests waited for admission at the end of the interval (the ceiling limits)."""
    tokens: float = 0.0
    """Output tokens generated in the interval."""
    good_tokens: float = 0.0
    """Output tokens of the requests that finished in the interval within the SLO."""
    joules: float | None = None
    """GPU energy in the interval (None: unknown)."""


@dataclass(frozen=True, slots=True)
class BatchAction:
    """One change of the concurrency ceiling, with why and on what evidence."""

    t_s: float
    kind: Direction
    from_limit: int
    to_limit: int
    reason: str
    evidence: dict[str, float | int | str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ActionResult:
    """The verdict on an earlier action: the objective before and after, and whether it was kept."""

    t_s: float
    action_t_s: float
    kind: Direction
    from_limit: int
    to_limit: int
    objective: str
    before: float | None
    after: float | None
    kept: bool
    reason: str


@dataclass(slots=True)
class _Level:
    """What happened at one ceiling (the level in force): seconds, harm, tokens, good tokens."""

    tokens: float = 0.0
    good_tokens: float = 0.0
    seconds: float = 0.0
    harm_s: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass(slots=True)
class _Trial:
    action: BatchAction
    before: float | None
    verify: bool
    """Downscales are verified (kept or reverted); upscales are only measured."""


def objective_value(objective: str, ticks: Iterable[Tick]) -> float | None:
    """The objective over some ticks: a ratio of sums (never a mean of per-tick ratios)."""
    seconds = tokens = good = joules = 0.0
    metered = 0.0
    for tk in ticks:
        seconds += tk.interval_s
        tokens += tk.tokens
        good += tk.good_tokens
        if tk.joules is not None:
            joules += tk.joules
            metered += tk.tokens
    if objective == "tokens_per_joule":
        return metered / joules if joules > 0 else None
    if seconds <= 0:
        return None
    return (good if objective == "goodput" else tokens) / seconds


class BatchPolicy:
    """Feed `update(tick)` in time order; it returns actions to apply and verdicts to record."""

    def __init__(self, settings: BatchSettings) -> None:
        self.settings = settings
        self.limit = settings.start
        """The ceiling the policy holds (in dry run: the one it would hold; always start)."""
        self._history: deque[Tick] = deque()
        self._harm_since: float | None = None
        self._quiet_since: float | None = None
        self._last_action_t: float | None = None
        self._last_upscale: tuple[float, int] | None = None  # (time, level reached)
        self._blocked: dict[int, float] = {}  # level -> blocked until
        self._path: list[int] = []  # levels the downscales came from, to go back up the same way
        self._trial: _Trial | None = None
        self._advised = False  # dry run: one advice per harm episode
        self._quick_return = False  # the last trial ended with the harm: upscale after settle_s
        self._level_since: float | None = None
        self._levels: dict[int, _Level] = {}
        self.sustained: dict[str, float | int] | None = None
        """The highest level held `sustain_s` without harm: {limit, since_s, tokens_per_s}."""
        self.actions = 0
        self.advice = 0
        self.kept = 0
        self.reverted = 0
        self.results: list[dict[str, Any]] = []
        """Every verdict, for the summary (bounded: the last 200)."""

    def _step(self, limit: int) -> int:
        return max(1, math.floor(limit * self.settings.step))

    @property
    def in_force(self) -> int:
        """The ceiling actually applied: the policy's, or the start in dry run."""
        return self.settings.start if self.settings.dry_run else self.limit

    @property
    def trial(self) -> bool:
        return self._trial is not None

    def update(self, tick: Tick) -> list[BatchAction | ActionResult]:
        s = self.settings
        t = tick.t_s
        self._remember(tick)
        if self._level_since is None:
            self._level_since = t
        if tick.harm:
            self._quiet_since = None
            if self._harm_since is None:
                self._harm_since = t
                self._block_if_bounced(t)
        else:
            self._harm_since = None
            self._advised = False
            if self._quiet_since is None:
                self._quiet_since = t
        self._note_sustained(t)
        out: list[BatchAction | ActionResult] = []
        if self._trial is not None:
            out += self._judge_trial(tick)
            return out
        since_action = math.inf if self._last_action_t is None else t - self._last_action_t
        if tick.harm and self._harm_since is not None:
            held = t - self._harm_since
            if held >= s.dwell_s and since_action >= s.settle_s + s.eval_s and self.limit > s.floor:
                act = self._try_downscale(t, held, tick.harm_kind)
                if act is not None:
                    out.append(act)
        elif not tick.harm and self._quiet_since is not None and self.limit < s.start:
            quiet = t - self._quiet_since
            need = s.settle_s if self._quick_return else s.recover_s
            if quiet >= need and since_action >= (
                s.settle_s if self._quick_return else s.settle_s + s.eval_s
            ):
                act = self._try_upscale(t, quiet)
                if act is not None:
                    out.append(act)
        return out

    # --- evidence ---------------------------------------------------------------------------------
    def _remember(self, tick: Tick) -> None:
        s = self.settings
        self._history.append(tick)
        horizon = 4 * (s.dwell_s + s.settle_s + s.eval_s) + 60.0
        while self._history and self._history[0].t_s < tick.t_s - horizon:
            self._history.popleft()
        level = self._levels.setdefault(self.in_force, _Level())
        level.tokens += tick.tokens
        level.good_tokens += tick.good_tokens
        level.seconds += tick.interval_s
        if tick.harm:
            level.harm_s += tick.interval_s

    def _window(self, t_s: float, since: float) -> list[Tick]:
        return [tk for tk in self._history if since < tk.t_s <= t_s]

    def _objective(self, ticks: list[Tick]) -> float | None:
        return objective_value(self.settings.objective, ticks)

    # --- actions ----------------------------------------------------------------------------------
    def _try_downscale(self, t: float, held: float, kind: str) -> BatchAction | None:
        s = self.settings
        since = max(t - s.eval_s, self._last_action_t or -math.inf)
        window = self._window(t, since)
        covered = sum(tk.interval_s for tk in window)
        if covered < 0.8 * s.eval_s or not all(tk.harm for tk in window):
            return None
        binding = sum(tk.interval_s for tk in window if tk.binding) / covered
        if binding < s.min_binding:
            return None  # the ceiling does not limit: lowering it cannot change anything
        if 2 * sum(1 for tk in window if tk.tokens > 0) < len(window):
            return None  # the engine served little of the window (a rebuild, a restart): nothing to compare
        target = max(s.floor, self.limit - self._step(self.limit))
        if self._blocked.get(target, -math.inf) > t:
            return None
        before = self._objective(window)
        evidence: dict[str, Any] = {
            "harm_for_s": round(held, 3),
            "harm_kind": kind or "unknown",
            "binding_share": round(binding, 3),
            "objective": s.objective,
        }
        if before is not None:
            evidence["objective_before"] = round(before, 6)
        if s.dry_run:
            if self._advised:
                return None
            self._advised = True
            self.advice += 1
            return BatchAction(
                t,
                "downscale",
                self.limit,
                target,
                f"harm ({kind or 'clock loss'}) for {held:.0f} s with the ceiling binding: would try "
                f"{self.limit} -> {target} and keep it only if {s.objective} gains {s.min_gain:.0%}",
                {**evidence, "advice": 1},
            )
        reason = (
            f"harm ({kind or 'clock loss'}) for {held:.0f} s with the ceiling binding: trying "
            f"{self.limit} -> {target}, kept only if {s.objective} gains {s.min_gain:.0%}"
        )
        action = self._act(t, "downscale", target, reason, evidence)
        self._path.append(action.from_limit)
        self._trial = _Trial(action, before, verify=True)
        return action

    def _try_upscale(self, t: float, quiet: float) -> BatchAction | None:
        s = self.settings
        target = self._path[-1] if self._path else min(s.start, self.limit + self._step(self.limit))
        while target > self.limit and self._blocked.get(target, -math.inf) > t:
            target -= 1
        if target <= self.limit:
            return None
        if self._path and target == self._path[-1]:
            self._path.pop()
        before = self._objective(self._window(t, t - s.eval_s))
        evidence: dict[str, Any] = {"quiet_for_s": round(quiet, 3), "objective": s.objective}
        if before is not None:
            evidence["objective_before"] = round(before, 6)
        need = s.settle_s if self._quick_return else s.recover_s
        self._quick_return = False
        reason = f"no harm for {quiet:.0f} s (>= {need:g} s): ceiling {self.limit} -> {target}"
        action = self._act(t, "upscale", target, reason, evidence)
        self._last_upscale = (t, target)
        self._trial = _Trial(action, before, verify=False)
        return action

    def _judge_trial(self, tick: Tick) -> list[BatchAction | ActionResult]:
        s = self.settings
        trial = self._trial
        assert trial is not None
        t0 = trial.action.t_s + s.settle_s
        if trial.verify and not tick.harm:
            # The harm ended under the new level: no like-for-like comparison is possible. It may have
            # ended because of the move (a device that throttles at the larger batch) or not (an outside
            # load that stopped): keep the level, and let the upscale come after `settle_s` of quiet
            # instead of `recover_s`; a level whose harm returns right after it is blocked then.
            self._quick_return = True
            return [self._close(tick.t_s, trial, None, True, "harm ended during the trial")]
        if tick.t_s <= t0:
            return []
        window = self._window(tick.t_s, t0)
        if sum(tk.interval_s for tk in window) < s.eval_s:
            return []
        after = self._objective(window)
        if not trial.verify:
            return [self._close(tick.t_s, trial, after, True, "measured")]
        binding = sum(tk.interval_s for tk in window if tk.binding) / sum(tk.interval_s for tk in window)
        if binding < s.min_binding:
            # The queue emptied: the objective now follows the offered load, not the level, so there is
            # no evidence either way. Back to the level before (free while nothing waits), not blocked.
            result = self._close(tick.t_s, trial, after, False, "the ceiling stopped binding: no evidence")
            if self._path and self._path[-1] == trial.action.from_limit:
                self._path.pop()
            reason = (
                f"requests stopped waiting for admission during the trial of {trial.action.to_limit}: "
                f"back to {trial.action.from_limit}"
            )
            return [result, self._act(tick.t_s, "revert", trial.action.from_limit, reason, {})]
        before = trial.before
        paid = before is not None and after is not None and after >= before * (1 + s.min_gain)
        if before is not None and after is not None and before <= 0 < after:
            paid = True
        if paid:
            return [self._close(tick.t_s, trial, after, True, f"{s.objective} gained")]
        result = self._close(
            tick.t_s, trial, after, False, f"{s.objective} did not gain {s.min_gain:.0%}: reverted"
        )
        lower = trial.action.to_limit
        self._blocked[lower] = tick.t_s + s.retry_s
        if self._path and self._path[-1] == trial.action.from_limit:
            self._path.pop()
        gain = None if not before or after is None else after / before - 1
        reason = (
            f"{s.objective} {_fmt(after)} at {lower} vs {_fmt(before)} at {trial.action.from_limit}"
            + ("" if gain is None else f" ({gain:+.1%})")
            + f": back to {trial.action.from_limit}, {lower} blocked for {s.retry_s:g} s"
        )
        evidence: dict[str, Any] = {"objective": s.objective, "blocked_level": lower}
        if after is not None:
            evidence["objective_before"] = round(after, 6)
        revert = self._act(tick.t_s, "revert", trial.action.from_limit, reason, evidence)
        self.reverted += 1
        return [result, revert]

    def _close(self, t: float, trial: _Trial, after: float | None, kept: bool, why: str) -> ActionResult:
        self._trial = None
        a = trial.action
        if trial.verify and kept:
            self.kept += 1
        result = ActionResult(
            t_s=t,
            action_t_s=a.t_s,
            kind=a.kind,
            from_limit=a.from_limit,
            to_limit=a.to_limit,
            objective=self.settings.objective,
            before=trial.before,
            after=after,
            kept=kept,
            reason=why,
        )
        self.results.append(
            {
                "t_s": round(t, 3),
                "action_t_s": round(a.t_s, 3),
                "kind": a.kind,
                "from": a.from_limit,
                "to": a.to_limit,
                "before": trial.before,
                "after": after,
                "kept": kept,
                "reason": why,
            }
        )
        del self.results[:-200]
        return result

    def _block_if_bounced(self, t_s: float) -> None:
        # Harm came back soon after an upscale: that level is more than the device holds.
        if self._last_upscale is None:
            return
        at, reached = self._last_upscale
        s = self.settings
        if reached == self.limit and t_s - at <= s.recover_s + s.dwell_s + s.settle_s + s.eval_s:
            self._blocked[reached] = t_s + s.retry_s

    def _note_sustained(self, t_s: float) -> None:
        s = self.settings
        if self._quiet_since is None or self._level_since is None:
            return
        since = max(self._quiet_since, self._level_since)
        if t_s - since < s.sustain_s:
            return
        level = self.in_force
        if self.sustained is None or int(self.sustained["limit"]) <= level:
            if self.sustained is None or int(self.sustained["limit"]) != level:
                self.sustained = {"limit": level, "since_s": round(since, 3)}
            tps = self._levels[level].tokens_per_s
            if tps is not None:
                self.sustained["tokens_per_s"] = round(tps, 3)

    def _act(
        self, t_s: float, kind: Direction, target: int, reason: str, evidence: dict[str, Any]
    ) -> BatchAction:
        before = self._levels.get(self.limit, _Level())
        evidence = {**evidence, "level_s": round(before.seconds, 3), "level_harm_s": round(before.harm_s, 3)}
        blocked = sorted(level for level, until in self._blocked.items() if until > t_s)
        if blocked:
            evidence["blocked_levels"] = ",".join(map(str, blocked))
        action = BatchAction(t_s, kind, self.limit, target, reason, evidence)
        self.limit = target
        self._last_action_t = t_s
        self._level_since = t_s
        self.actions += 1
        return action

    # --- views ------------------------------------------------------------------------------------
    def tokens_per_s(self, limit: int) -> float | None:
        level = self._levels.get(limit)
        return None if level is None else level.tokens_per_s

    def levels(self) -> dict[str, dict[str, float | None]]:
        """Per ceiling actually in force: seconds, harmful seconds, tokens/s, goodput (tok/s)."""
        return {
            str(k): {
                "seconds": round(v.seconds, 3),
                "harm_s": round(v.harm_s, 3),
                "tokens_per_s": v.tokens_per_s,
                "goodput_tps": v.good_tokens / v.seconds if v.seconds > 0 else None,
            }
            for k, v in sorted(self._levels.items())
        }

    # --- state that survives a daemon restart -----------------------------------------------------
    def to_state(self, now_s: float) -> dict[str, Any]:
        """JSON-able state; times as ages (seconds before `now_s`), so another clock can read them back.
        A trial in progress is not kept: its evidence is in memory only."""

        def age(t: float | None) -> float | None:
            return None if t is None else now_s - t

        return {
            "limit": self.limit,
            "last_action_age_s": age(self._last_action_t),
            "last_upscale": None
            if self._last_upscale is None
            else [now_s - self._last_upscale[0], self._last_upscale[1]],
            "blocked": {str(k): until - now_s for k, until in self._blocked.items() if until > now_s},
            "path": list(self._path),
            "sustained": self.sustained,
            "actions": self.actions,
            "advice": self.advice,
            "kept": self.kept,
            "reverted": self.reverted,
            "results": self.results[-50:],
            "levels": {
                str(k): [v.tokens, v.seconds, v.harm_s, v.good_tokens] for k, v in self._levels.items()
            },
        }

    @classmethod
    def from_state(cls, settings: BatchSettings, state: dict[str, Any], now_s: float) -> BatchPolicy:
        p = cls(settings)
        p.limit = min(settings.start, max(settings.floor, int(state.get("limit", settings.start))))
        if settings.dry_run:
            p.limit = settings.start
        age = state.get("last_action_age_s")
        p._last_action_t = None if age is None else now_s - float(age)
        up = state.get("last_upscale")
        p._last_upscale = None if up is None else (now_s - float(up[0]), int(up[1]))
        p._blocked = {int(k): now_s + float(v) for k, v in (state.get("blocked") or {}).items()}
        p._path = [int(x) for x in state.get("path") or [] if settings.floor <= int(x) <= settings.start]
        p.sustained = state.get("sustained")
        p.actions = int(state.get("actions", 0))
        p.advice = int(state.get("advice", 0))
        p.kept = int(state.get("kept", 0))
        p.reverted = int(state.get("reverted", 0))
        p.results = [r for r in state.get("results") or [] if isinstance(r, dict)]
        for k, values in (state.get("levels") or {}).items():
            tokens, seconds, harm = (float(x) for x in values[:3])
            good = float(values[3]) if len(values) > 3 else 0.0
            p._levels[int(k)] = _Level(tokens, good, seconds, harm)
        return p


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"
