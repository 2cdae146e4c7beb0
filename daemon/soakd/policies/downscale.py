"""The batch policy: move the concurrency ceiling only where the move pays on a stated objective.

Field notes: on an edge GPU a large batch that throttles delivers less than a smaller one the device
sustains. On a datacenter GPU running at its power limit is normal operation, and a smaller batch only
gives up tokens. So the policy does not react to throttling as such; it acts on *harm* (a sustained clock
loss, see policies/throttle.HarmJudge), only while the ceiling binds (requests wait for admission: a
lower ceiling that does not bind changes nothing), and it verifies every downscale as an A-B-A trial:

1. harm held for `dwell_s`, the ceiling binding: the objective over the last `eval_s` at this level is A;
   lower the ceiling one step;
2. wait `settle_s` (running requests finish down to the new limit), measure the objective over `eval_s`
   at the lower level: B;
3. always go back to the level before (a `revert` whose reason says it is the A' leg, not a verdict),
   wait `settle_s`, measure it again over `eval_s`: A';
4. judge B against the bracket lo = min(A, A'), hi = max(A, A'), beyond a noise margin m: twice the
   standard error of the difference between B and the leg it is compared with (each leg's from its
   per-tick values, see objective_se):
   - gain: B - hi > m and >= hi x `min_gain`: re-apply the lower level (a `downscale`, "kept after A-B-A");
   - no gain: B + m <= lo x (1 + `min_gain`): the lower level cannot have gained `min_gain` on any
     counterfactual in the bracket (a clear loss included): stay, block it for `retry_s`; unless the A
     legs differ more than 4x (collapse, below);
   - otherwise inconclusive (the trend or the noise explains the difference): stay, block the lower level
     for 2 x (`dwell_s` + `settle_s` + `eval_s`), one fresh trial's worth of evidence, doubled for each
     inconclusive verdict in a row on that level up to `retry_s` (a neutral level is not tried all night).

Why A-B-A: a before/after on a drifting system measures the drift. On an H200 (Llama-3.1-8B shape, a
matmul process beside it) goodput went 736 -> 0 over a trial of 64 -> 48 while advice-only, which moved
nothing, went 648 -> 23 over the same windows: the growing queue, not the move, made the "after". Under
any monotonic trend the objective at the level before during B lies between A and A', so only a B outside
that bracket by more than the noise is the move's doing. Collapse: when one A leg is under a quarter of
the other (or both are 0), the objective swung through its floor for reasons outside the level (an
overloaded queue in which every request misses the TTFT limit from its due time gives no goodput at any
level); near that floor a lower level cannot show a loss: inconclusive, never a block for `retry_s`.
Noise: per-tick goodput under load is autocorrelated, so the per-tick standard error understates a
leg's; the bracket's max and min make up for it. Null trials cut from the recorded H200 advice-only runs
(tests/data/h200) came out a gain 2 % of the time on goodput, 0 % on tokens (the old before/after: 42 %
and 25 %).

A trial needs headroom in the queue. Lowering the ceiling admits nothing until the requests running
drain down to the new limit, and fewer are admitted per second after, so the head of the admission
queue waits longer; under goodput with a TTFT limit (as offered, from the due time) a queue whose head
crosses the limit loses every later request's goodput at any level. So with objective `goodput` and a
TTFT limit, no trial starts when the head's wait, projected over the trial's span (its trend in the
before-window over B and A') plus that stall (the excess over the new limit at the rate requests
finished), reaches the limit: the trial would measure the cliff, not the level, and leave a backlog the
level before cannot clear (`TrialSkipped`, once per harm episode). On an H200 (the shared-load arms of
tests/data/h200/matrix) a trial of 64 -> 48 admitted nothing for its first second and 33 requests in
its first 5 s against 53 in advice-only, which moved nothing; the head's wait went from 5.0 to 10.0 s
(advice-only: 4.5 to 6.2 s), and after the load 719 of 720 requests missed the 10 s TTFT limit against
283 of 813 in advice-only.

No trial starts while the harm is in its tail (the clock loss under the level that starts harm, not yet
under the level that ends it): its cause may be over. On an H200 a block that ran out 10 s after a shared
load ended started a trial as the clock came back; the harm ended 0.8 s later and the trial said nothing
(tests/data/h200/matrix3, payslong-control2). A throughput judge acted on that reads harm now makes the
tick no tail (the controller's `fading`): a clock loss sitting at its threshold under a shared load was
in its tail two seconds in three, and no trial started in 150 s (tests/data/h200/matrix4).

Harm that ends during the B leg makes the trial inconclusive and the upscale below comes in the same
tick, not after `recover_s`: the harm judge's own `leave` was the wait for its cause to end, and a level
whose harm returns right after an upscale is blocked anyway. On an H100 (tests/data/h100/matrix12,
longctx-control) a trial of 48 -> 36 began 5 s before a shared load ended; the way back after `settle_s`
held 36 for 11 s more, and control served 5.3 % fewer tokens than advice-only after the load (two
advice-only runs: 0.1 % apart). Harm that ends during the A' leg leaves the level before in force,
nothing blocked. A queue that stops binding during a leg leaves no evidence (the objective follows the
offered load): the level before, not blocked. Every verdict (ActionResult) says which comparison decided
it (`decided_by`) with A, B, A' and the noise margin.

When the harm has been gone for `recover_s`, the ceiling goes back in one step to the level in force
before the downscales (or the highest level under it that is not blocked; upscales are measured, not
verified): every level below it was kept for a harm that is over. On an H200 (tests/data/h200/matrix6)
the old way back, a level per `settle_s + eval_s`, held 36 and then 48 for 41-42 s after a shared load's
harm ended while a backlog waited, and control served 10-16 % fewer tokens than advice-only after the
load. A level that brought harm back within `recover_s + dwell_s` of an upscale is blocked for
`retry_s`, so the ceiling does not saw between two levels all night; under it, the next way back stops
at the highest level not blocked. In `dry_run` nothing is applied, so nothing can be verified: the
policy says once per harm episode what it would try, and every figure stays with the level actually in
force.

Objectives: `goodput` (output tokens/s of requests that met the TTFT and TPOT limits of [criteria],
DistServe's goodput in tokens), `tokens` (output tokens/s), `tokens_per_joule` (output tokens per joule of
GPU energy). No I/O and no clock of its own: every call carries its time.

Over 500 lines because the trial's three legs, its verdict, the revert and recovery steps are one state
machine over one objective window.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from soakd.config import BatchControlConfig

Direction = Literal["downscale", "upscale", "revert"]
DecidedBy = Literal["aba_bracket", "harm_ended", "not_binding", "no_objective", "measured"]
"""Which comparison decided a verdict: the A-B-A bracket, harm that ended during a leg, a queue that
stopped binding, an objective that could not be measured, or an upscale's measurement."""
Verdict = Literal["gain", "no_gain", "inconclusive", "no_evidence", "measured"]
Objective = Literal["goodput", "tokens", "tokens_per_joule"]
OBJECTIVES: tuple[Objective, ...] = ("goodput", "tokens", "tokens_per_joule")
OBJECTIVE_UNIT: dict[str, str] = {
    "goodput": "good tok/s",
    "tokens": "tok/s",
    "tokens_per_joule": "tok/J",
}


# One A leg under this share of the other: the objective collapsed (or came back) within the trial.
_COLLAPSE = 0.25

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
    """Each leg of a trial (A, B, A') and an upscale's measurement run this long."""
    min_gain: float = _CONFIG.min_gain
    """A downscale is kept only when B beat both A and A' by at least this share (and the noise)."""
    min_binding: float = _CONFIG.min_binding
    """Share of the before-window in which requests waited for admission (the ceiling bound)."""
    recover_s: float = _CONFIG.cooldown
    """No harm for this long before an upscale."""
    sustain_s: float = _CONFIG.sustain
    """A ceiling held this long without harm is the sustained operating point."""
    retry_s: float = _CONFIG.retry
    """A level that did not pay (or that brought harm back) is not tried again for this long; an
    inconclusive trial blocks it for 2 x (dwell_s + settle_s + eval_s), doubling, at most this."""
    dry_run: bool = False
    """Advise, do not act: nothing is verified, figures stay with the level in force (start)."""
    ttft_limit_s: float | None = None
    """The TTFT limit (as offered) goodput counts against; with objective goodput, a trial needs the
    queue's head to stay under it over the trial's span (None: no such limit, no such need)."""

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
        if self.ttft_limit_s is not None and not (math.isfinite(self.ttft_limit_s) and self.ttft_limit_s > 0):
            raise ValueError("ttft_limit_s must be finite and > 0")

    @classmethod
    def from_config(
        cls, b: BatchControlConfig, start: int, dry_run: bool = False, ttft_limit_s: float | None = None
    ) -> BatchSettings:
        """[control.batch] with the replay's ceiling as `start` (the floor never above it) and the
        criteria's TTFT limit."""
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
            ttft_limit_s=ttft_limit_s,
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
    harm_source: str = ""
    """Where the harm is ("GPU 1"), empty when unknown or none."""
    fading: bool = False
    """The harm is in its tail: the loss under the level that starts harm, not yet under the level that
    ends it. No trial starts then (it would measure the harm's end, not the level)."""
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
    wait_s: float = 0.0
    """How long the request at the head of the admission queue has waited, from its due time, at the
    end of the interval (0: none waiting)."""
    finished: int = 0
    """Requests that finished (met the SLO or not) in the interval."""


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
    """The verdict on an earlier action: the objective in each leg, which comparison decided, and whether
    the action's level is in force after it."""

    t_s: float
    action_t_s: float
    kind: Direction
    from_limit: int
    to_limit: int
    objective: str
    before: float | None
    """A: the objective at `from_limit` over `eval_s` before the action."""
    after: float | None
    """B: the objective at `to_limit` over `eval_s` after `settle_s`."""
    kept: bool
    reason: str
    decided_by: DecidedBy
    verdict: Verdict
    again: float | None = None
    """A': the objective at `from_limit` again, after the trial went back (downscales only)."""
    noise: float | None = None
    """The noise margin B was judged against (2 x the standard error of the difference)."""
    blocked_s: float = 0.0
    """How long `to_limit` is blocked by this verdict (0: not blocked)."""


@dataclass(frozen=True, slots=True)
class TrialSkipped:
    """A downscale the policy did not try: the queue had no headroom for its trial (module docstring)."""

    t_s: float
    from_limit: int
    to_limit: int
    reason: str
    evidence: dict[str, float | int | str] = field(default_factory=dict)


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
    """Downscales are verified (A-B-A); upscales are only measured."""
    a_ticks: list[Tick] = field(default_factory=list)
    """The A leg's ticks (for its noise)."""
    after: float | None = None
    b_ticks: list[Tick] = field(default_factory=list)
    back: BatchAction | None = None
    """The A' leg's revert to the level before (None: still in the B leg)."""


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


def objective_se(objective: str, ticks: Iterable[Tick]) -> float | None:
    """The standard error of objective_value over some ticks, from their per-tick values.

    objective_value is a ratio of sums R = sum(y) / sum(x), per tick y = good tokens or tokens and x = its
    seconds, or y = its tokens and x = its joules for tokens_per_joule (ticks without joules carry no
    value, as there). Its standard error is the ratio estimator's, sqrt(sum((y - R x)^2) / (n (n - 1)))
    / mean(x): with equal intervals, that of the mean of the per-tick rates. Goodput arrives in bursts
    (a request's tokens count in the tick it finishes), so its per-tick values scatter widely and the
    error is large: that is the noise. None with fewer than two values."""
    pairs: list[tuple[float, float]] = []
    for tk in ticks:
        if objective == "tokens_per_joule":
            if tk.joules is not None:
                pairs.append((tk.tokens, tk.joules))
        else:
            pairs.append((tk.good_tokens if objective == "goodput" else tk.tokens, tk.interval_s))
    n = len(pairs)
    sx = sum(x for _, x in pairs)
    if n < 2 or sx <= 0:
        return None
    r = sum(y for y, _ in pairs) / sx
    spread = sum((y - r * x) ** 2 for y, x in pairs)
    return math.sqrt(spread / (n * (n - 1))) / (sx / n)


def wait_reach(window: list[Tick], span_s: float, excess: int) -> float:
    """Where the head of the admission queue's wait would be at the end of a trial starting now: its wait
    at the window's end, plus its trend over the window (a least-squares slope, never below 0) over
    `span_s`, plus the stall of the lower ceiling (nothing is admitted until `excess` more requests have
    finished than were admitted, at the rate they finished in the window; inf when none did)."""
    seconds = sum(tk.interval_s for tk in window)
    rate = sum(tk.finished for tk in window) / seconds if seconds > 0 else 0.0
    if rate <= 0:
        return math.inf
    n = len(window)
    mt = sum(tk.t_s for tk in window) / n
    mw = sum(tk.wait_s for tk in window) / n
    var = sum((tk.t_s - mt) ** 2 for tk in window)
    slope = sum((tk.t_s - mt) * (tk.wait_s - mw) for tk in window) / var if var > 0 else 0.0
    return window[-1].wait_s + max(0.0, slope) * span_s + excess / rate


@dataclass(frozen=True, slots=True)
class Aba:
    """An A-B-A trial's verdict on the bracket (judge_aba)."""

    verdict: Literal["gain", "no_gain", "inconclusive"]
    why: str
    """What made it inconclusive: "drift" (the A legs differ beyond their noise), "noise", "collapse"."""
    noise: float | None
    """The margin B was compared with (None: a leg too short to tell its noise)."""


def judge_aba(
    objective: str, min_gain: float, a: list[Tick], b: list[Tick], a_again: list[Tick]
) -> Aba | None:
    """B against the bracket of A and A' (see the module's docstring); None when a leg has no value."""
    before, after, again = (objective_value(objective, leg) for leg in (a, b, a_again))
    if before is None or after is None or again is None:
        return None
    se_a, se_b, se_a2 = (objective_se(objective, leg) for leg in (a, b, a_again))
    lo, hi = min(before, again), max(before, again)
    m_hi = _margin(se_b, se_a if before >= again else se_a2)
    m_lo = _margin(se_b, se_a2 if before >= again else se_a)
    noise = m_hi if after >= hi else m_lo if after <= lo else max(m_hi, m_lo)
    shown = None if math.isinf(noise) else noise
    if after - hi > m_hi and after - hi >= hi * min_gain:
        return Aba("gain", "", shown)
    no_gain = after + m_lo <= lo * (1 + min_gain)
    # One A leg under a quarter of the other (or both 0): the objective swung through its floor within
    # the trial for reasons outside the level; near that floor no loss can show.
    if no_gain and lo > _COLLAPSE * hi:
        return Aba("no_gain", "", shown)
    drift = abs(before - again) > _margin(se_a, se_a2)
    return Aba("inconclusive", "collapse" if no_gain else "drift" if drift else "noise", shown)


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
        self._skip_said = False  # one TrialSkipped per harm episode
        self._quick_return = False  # the last trial ended with the harm: upscale at once
        self._level_since: float | None = None
        self._levels: dict[int, _Level] = {}
        self.sustained: dict[str, float | int] | None = None
        """The highest level held `sustain_s` without harm: {limit, since_s, tokens_per_s}."""
        self.actions = 0
        self.advice = 0
        self.kept = 0
        self.reverted = 0
        """Trials that showed no gain (the lower level blocked for `retry_s`)."""
        self.inconclusive = 0
        """Trials the bracket could not decide (the lower level blocked briefly)."""
        self.skipped = 0
        """Harm episodes in which a trial was due but the queue had no headroom for it."""
        self._inconclusive_runs: dict[int, int] = {}  # level -> inconclusive verdicts in a row on it
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

    def update(self, tick: Tick) -> list[BatchAction | ActionResult | TrialSkipped]:
        s = self.settings
        t = tick.t_s
        self._remember(tick)
        if self._level_since is None:
            self._level_since = t
        if tick.harm:
            self._quiet_since = None
            if self._harm_since is None:
                self._harm_since = t
                self._quick_return = False  # harm back before the way back: that takes `recover_s` again
                self._block_if_bounced(t)
        else:
            self._harm_since = None
            self._advised = False
            self._skip_said = False
            if self._quiet_since is None:
                self._quiet_since = t
        self._note_sustained(t)
        out: list[BatchAction | ActionResult | TrialSkipped] = []
        if self._trial is not None:
            out += self._judge_trial(tick)
            # A trial the harm's end cut short goes straight on to the way back, in this tick.
            if self.trial or not self._quick_return:
                return out
        since_action = math.inf if self._last_action_t is None else t - self._last_action_t
        if tick.harm and not tick.fading and self._harm_since is not None:
            held = t - self._harm_since
            if held >= s.dwell_s and since_action >= s.settle_s + s.eval_s and self.limit > s.floor:
                act = self._try_downscale(t, held, tick.harm_kind, tick.harm_source)
                if act is not None:
                    out.append(act)
        elif not tick.harm and self._quiet_since is not None and self.limit < s.start:
            quiet = t - self._quiet_since
            if self._quick_return or (quiet >= s.recover_s and since_action >= s.settle_s + s.eval_s):
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
    def _try_downscale(
        self, t: float, held: float, kind: str, source: str = ""
    ) -> BatchAction | TrialSkipped | None:
        s = self.settings
        since = max(t - s.eval_s, self._last_action_t or -math.inf)
        window = self._window(t, since)
        covered = sum(tk.interval_s for tk in window)
        # The A leg is harm now throughout: none of it in a tail (a trial after a tail measures the
        # harm's return against its ebb).
        if covered < 0.8 * s.eval_s or not all(tk.harm and not tk.fading for tk in window):
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
        if before is None:
            return None  # no objective to compare against (tokens_per_joule without energy readings)
        evidence: dict[str, Any] = {
            "harm_for_s": round(held, 3),
            "harm_kind": kind or "unknown",
            **({"harm_source": source} if source else {}),
            "binding_share": round(binding, 3),
            "objective": s.objective,
            "objective_before": round(before, 6),
        }
        what = (kind or "clock loss") + (f" on {source}" if source else "")
        if s.objective == "goodput" and s.ttft_limit_s is not None:
            reach = wait_reach(window, 2 * (s.settle_s + s.eval_s), self.limit - target)
            if reach >= s.ttft_limit_s:
                return self._skip(t, target, reach, window[-1].wait_s, evidence)
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
                f"harm ({what}) for {held:.0f} s with the ceiling binding: would try "
                f"{self.limit} -> {target} and keep it only if {s.objective} gains {s.min_gain:.0%}",
                {**evidence, "advice": 1},
            )
        reason = (
            f"harm ({what}) for {held:.0f} s with the ceiling binding: trying "
            f"{self.limit} -> {target}, kept only if {s.objective} gains {s.min_gain:.0%} over {self.limit} "
            "before and after it (A-B-A)"
        )
        action = self._act(t, "downscale", target, reason, evidence)
        self._path.append(action.from_limit)
        self._trial = _Trial(action, before, verify=True, a_ticks=window)
        return action

    def _skip(
        self, t: float, target: int, reach: float, wait: float, evidence: dict[str, Any]
    ) -> TrialSkipped | None:
        """No trial of `target`: the queue's head would cross the TTFT limit within it (once per episode)."""
        if self._skip_said:
            return None
        self._skip_said = True
        self.skipped += 1
        limit = self.settings.ttft_limit_s
        reach_text = (
            f"would reach {reach:.1f} s within the trial"
            if math.isfinite(reach)
            else "would not move again: no request finished in the before-window"
        )
        reason = (
            f"no trial of {self.limit} -> {target}: the head of the admission queue has waited {wait:.1f} s "
            f"and {reach_text} (its trend, and the stall while the running requests drain to {target}), "
            f"past the {limit:g} s TTFT limit: goodput would measure the queue, not the level"
        )
        evidence = {**evidence, "wait_s": round(wait, 3), "wait_reach_s": round(reach, 3)}
        return TrialSkipped(t, self.limit, target, reason, evidence)

    def _try_upscale(self, t: float, quiet: float) -> BatchAction | None:
        s = self.settings
        # Every level on the path was kept for a harm that is over now: back to the first of them (the
        # level before the downscales) at once, or the highest one below it that is not blocked.
        target = self._path[0] if self._path else min(s.start, self.limit + self._step(self.limit))
        while target > self.limit and self._blocked.get(target, -math.inf) > t:
            target -= 1
        if target <= self.limit:
            return None
        on_path = bool(self._path)
        skipped = [level for level in self._path if self.limit < level < target]
        self._path = [level for level in self._path if level > target]
        # After a cut-short trial the window before is the B leg, under the harm: no like-for-like figure.
        before = None if self._quick_return else self._objective(self._window(t, t - s.eval_s))
        evidence: dict[str, Any] = {"quiet_for_s": round(quiet, 3), "objective": s.objective}
        if before is not None:
            evidence["objective_before"] = round(before, 6)
        if skipped:
            evidence["levels_skipped"] = ",".join(str(level) for level in sorted(skipped))
        if self._quick_return:
            reason = f"the harm ended during the trial of {self.limit}: ceiling {self.limit} -> {target}"
        else:
            reason = f"no harm for {quiet:.0f} s (>= {s.recover_s:g} s): ceiling {self.limit} -> {target}"
        self._quick_return = False
        if self._path:
            reason += f" ({self._path[0]}, the level before the harm, is blocked)"
        elif on_path:
            reason += " (the level before the harm)"
        action = self._act(t, "upscale", target, reason, evidence)
        self._last_upscale = (t, target)
        self._trial = _Trial(action, before, verify=False)
        return action

    def _judge_trial(self, tick: Tick) -> list[BatchAction | ActionResult]:
        s = self.settings
        trial = self._trial
        assert trial is not None
        if trial.verify and not tick.harm:
            return [self._harm_ended(tick.t_s, trial)]
        t0 = (trial.back or trial.action).t_s + s.settle_s
        if tick.t_s <= t0:
            return []
        window = self._window(tick.t_s, t0)
        covered = sum(tk.interval_s for tk in window)
        if covered < s.eval_s:
            return []
        value = self._objective(window)
        if not trial.verify:
            return [
                self._close(tick.t_s, trial, "measured", "measured", kept=True, after=value, why="measured")
            ]
        if sum(tk.interval_s for tk in window if tk.binding) / covered < s.min_binding:
            return self._no_evidence(tick.t_s, trial, value)
        if trial.back is None:
            return [self._go_back(tick.t_s, trial, value, window)]
        return self._decide(tick.t_s, trial, value, window)

    def _harm_ended(self, t: float, trial: _Trial) -> ActionResult:
        a = trial.action
        if trial.back is None:
            # The harm ended under the new level: no like-for-like comparison is possible. It may have
            # ended because of the move (a device that throttles at the larger batch) or not (an outside
            # load that stopped). The level holds no evidence, and the harm judge's own `leave` was
            # the wait for the cause to be over: back up at once, not after `recover_s`; a level
            # whose harm returns right after it is blocked then, so waiting protects nothing.
            self._quick_return = True
            why = (
                f"harm ended during the trial: {a.to_limit} not judged, not blocked; "
                "the way back needs no cool-down"
            )
            return self._close(t, trial, "harm_ended", "inconclusive", why=why)
        # The A' leg runs at the level before: it stays in force; the lower level was not judged.
        why = f"harm ended during the A' leg: {a.from_limit} stays, {a.to_limit} not judged, not blocked"
        return self._close(t, trial, "harm_ended", "inconclusive", kept=False, after=trial.after, why=why)

    def _no_evidence(self, t: float, trial: _Trial, value: float | None) -> list[BatchAction | ActionResult]:
        # The queue emptied: the objective now follows the offered load, not the level, so there is no
        # evidence either way. The level before (free while nothing waits), not blocked.
        a = trial.action
        if trial.back is not None:  # the A' leg: already at the level before
            why = "the ceiling stopped binding during the A' leg: no evidence"
            return [
                self._close(t, trial, "not_binding", "no_evidence", after=trial.after, again=value, why=why)
            ]
        why = "the ceiling stopped binding: no evidence"
        result = self._close(t, trial, "not_binding", "no_evidence", after=value, why=why)
        if self._path and self._path[-1] == a.from_limit:
            self._path.pop()
        reason = (
            f"requests stopped waiting for admission during the trial of {a.to_limit}: back to {a.from_limit}"
        )
        return [result, self._act(t, "revert", a.from_limit, reason, {})]

    def _go_back(self, t: float, trial: _Trial, after: float | None, window: list[Tick]) -> BatchAction:
        """The B leg is measured: back to the level before for the A' leg (not a verdict)."""
        s = self.settings
        a = trial.action
        trial.after, trial.b_ticks = after, window
        if self._path and self._path[-1] == a.from_limit:
            self._path.pop()
        reason = (
            f"A' leg of the trial of {a.to_limit}, not a verdict: back to {a.from_limit} to measure it again "
            f"({s.objective} {_fmt(after)} at {a.to_limit} vs {_fmt(trial.before)} before)"
        )
        evidence: dict[str, Any] = {"objective": s.objective, "trial_leg": "A'"}
        if after is not None:
            evidence["objective_before"] = round(after, 6)
        trial.back = self._act(t, "revert", a.from_limit, reason, evidence)
        return trial.back

    def _decide(
        self, t: float, trial: _Trial, again: float | None, window: list[Tick]
    ) -> list[BatchAction | ActionResult]:
        """The A-B-A verdict (judge_aba) and what follows from it: re-apply, block, or block briefly."""
        s = self.settings
        a = trial.action
        lower, upper, before, after = a.to_limit, a.from_limit, trial.before, trial.after
        aba = judge_aba(s.objective, s.min_gain, trial.a_ticks, trial.b_ticks, window)
        if aba is None or before is None or after is None or again is None:
            why = f"{s.objective} not measured in every leg: no evidence"
            return [self._close(t, trial, "no_objective", "no_evidence", after=after, again=again, why=why)]
        figures = (
            f"{s.objective} {_fmt(after)} at {lower} vs {_fmt(before)} before and {_fmt(again)} after at "
            f"{upper} (noise ±{_fmt(aba.noise)})"
        )
        kw: dict[str, Any] = {"after": after, "again": again, "noise": aba.noise}
        if aba.verdict == "gain":
            self._inconclusive_runs.pop(lower, None)
            result = self._close(t, trial, "aba_bracket", "gain", kept=True, why=f"{figures}: gain", **kw)
            self._path.append(upper)
            evidence = {"objective": s.objective, "trial_leg": "kept", "objective_before": round(again, 6)}
            reapply = self._act(t, "downscale", lower, f"kept after A-B-A: {figures}", evidence)
            return [result, reapply]
        if aba.verdict == "no_gain":
            self._inconclusive_runs.pop(lower, None)
            self._blocked[lower] = t + s.retry_s
            self.reverted += 1
            why = f"{figures}: no gain of {s.min_gain:.0%}, {lower} blocked for {s.retry_s:g} s"
            return [self._close(t, trial, "aba_bracket", "no_gain", blocked_s=s.retry_s, why=why, **kw)]
        block = self._short_block(lower)
        self._blocked[lower] = t + block
        self.inconclusive += 1
        why = f"{figures}: inconclusive ({aba.why}), {lower} blocked for {block:g} s"
        return [self._close(t, trial, "aba_bracket", "inconclusive", blocked_s=block, why=why, **kw)]

    def _short_block(self, level: int) -> float:
        """An inconclusive verdict blocks the level for one fresh trial's worth of evidence, 2 x (dwell +
        settle + eval), doubled for each inconclusive verdict in a row on it, at most `retry_s`."""
        s = self.settings
        runs = self._inconclusive_runs.get(level, 0)
        self._inconclusive_runs[level] = runs + 1
        return min(s.retry_s, 2 * (s.dwell_s + s.settle_s + s.eval_s) * 2.0 ** min(runs, 30))

    def _close(
        self,
        t: float,
        trial: _Trial,
        decided_by: DecidedBy,
        verdict: Verdict,
        *,
        why: str,
        kept: bool = False,
        after: float | None = None,
        again: float | None = None,
        noise: float | None = None,
        blocked_s: float = 0.0,
    ) -> ActionResult:
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
            decided_by=decided_by,
            verdict=verdict,
            again=again,
            noise=noise,
            blocked_s=blocked_s,
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
                "again": again,
                "noise": noise,
                "kept": kept,
                "decided_by": decided_by,
                "verdict": verdict,
                "blocked_s": blocked_s,
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
        A trial in progress is not kept: its evidence is in memory only. During the B leg the lower level
        is in force, and the way back comes after `recover_s` as after any kept level; during the A' leg
        the level before is, with the lower level neither kept nor blocked: a restart there is a trial
        that never happened. Nor is a pending way back after a cut-short trial (every level above
        blocked): after a restart it waits `recover_s`."""

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
            "inconclusive": self.inconclusive,
            "inconclusive_runs": {str(k): v for k, v in self._inconclusive_runs.items()},
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
        p.inconclusive = int(state.get("inconclusive", 0))
        p._inconclusive_runs = {int(k): int(v) for k, v in (state.get("inconclusive_runs") or {}).items()}
        p.results = [r for r in state.get("results") or [] if isinstance(r, dict)]
        for k, values in (state.get("levels") or {}).items():
            tokens, seconds, harm = (float(x) for x in values[:3])
            good = float(values[3]) if len(values) > 3 else 0.0
            p._levels[int(k)] = _Level(tokens, good, seconds, harm)
        return p


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _margin(se_x: float | None, se_y: float | None) -> float:
    """Twice the standard error of a difference of two independent legs (inf: a leg without one)."""
    return math.inf if se_x is None or se_y is None else 2 * math.hypot(se_x, se_y)
