"""The control loop: each `control.interval`, read the telemetry the policies need, run them, hand their
actions to the actuator, keep the controller's state in the run directory, and write a `control` point.

Inputs come in as callables (harm and throttle state, output tokens, requests in flight and waiting,
GPU energy, the run's tokens-per-step histogram, the acceptance-drift state), so the loop is tested with
plain functions and the app wires the real collectors. Finished requests come in through
`observe_request`, which counts the goodput (tokens of requests within the [criteria] TTFT/TPOT limits).
Times are wall-clock seconds, so the saved state means the same to a daemon restarted on the same run.

Over 500 lines because the loop wires every policy's inputs and actions and writes the control point; the
policies themselves are in soakd.policies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from soakd.config import ControlConfig
from soakd.engine.base import EngineInfo
from soakd.files import read_json_no_follow, write_private
from soakd.metric import FieldValue, Sample
from soakd.policies.actuator import Actuator
from soakd.policies.downscale import (
    OBJECTIVE_UNIT,
    ActionResult,
    BatchAction,
    BatchPolicy,
    BatchSettings,
    Tick,
    TrialSkipped,
)
from soakd.policies.recapture import RecapturePolicy, RecaptureSettings, padding_stats
from soakd.policies.throttle import ThroughputJudge, ThroughputSettings, worst_harm
from soakd.replay.admission import AdmissionGate
from soakd.rundir import CONTROL_STATE_FILE

log = structlog.get_logger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class ControlInputs:
    """What the policies read; each a callable so the app can hand in live views."""

    throttled: Callable[[], bool]
    """Whether the device(s) in `control.scope` are in a throttle episode now (recorded, not acted on)."""
    output_tokens: Callable[[], int]
    """Output tokens received so far in the run (a running total)."""
    in_flight: Callable[[], int]
    """Requests in the engine now."""
    tokens_per_step: Callable[[], Mapping[int, int]]
    """The run's tokens-per-step histogram so far (a running total)."""
    engine: Callable[[], EngineInfo | None]
    """The running engine's facts (capture sizes, graphs, the live admission lever)."""
    drifting: Callable[[], bool] = lambda: False
    """Whether speculative acceptance is below its baseline by the drift threshold now."""
    harm: Callable[[], str] = lambda: ""
    """The harm the batch policy acts on: "thermal", "power" or "" (policies.throttle.HarmJudge)."""
    harm_fading: Callable[[], bool] = lambda: False
    """Whether the harm acted on is in its tail: the loss under the level that starts it, not yet under
    the level that ends it, on every source that has it (GpuThrottleWatch.harm_fading; a host's CPU
    throttling is never a tail)."""
    harm_source: Callable[[str], str] = lambda _kind: ""
    """Where harm of this kind is ("GPU 1"): an action's evidence names the GPU that held the engine back."""
    waiting: Callable[[], int] = lambda: 0
    """Requests waiting for admission now (the ceiling binds when > 0)."""
    head_wait: Callable[[], float] = lambda: 0.0
    """How long the request at the head of the admission queue has waited, from its due time (0: none)."""
    energy_j: Callable[[], float | None] = lambda: None
    """GPU energy so far (J, a running total), None when unknown."""
    energy_s: Callable[[], float | None] = lambda: None
    """The time the energy total covers (s; None: unknown, the control interval stands in): the GPU's
    power is the energy's growth over this one's."""
    limited: Callable[[], bool] = lambda: False
    """Whether a device in scope shows a throttle reason in most recent samples (at a limit)."""
    prompt_tokens_computed: Callable[[], int | None] = lambda: None
    """Prompt tokens the engine computed so far, prefix-cache hits left out (a running total); None when
    the engine reports no steps that count their cache hits. The throughput judge counts them at
    `prefill_weight`."""
    shared: Callable[[], frozenset[str] | None] = lambda: None
    """The PIDs of other processes with a compute context on the engine's GPUs (None: unknown); the
    throughput judge's power gate does not apply while one of them is new (GpuThrottleWatch.shared)."""
    draining: Callable[[], bool] = lambda: False
    """Whether the replay has stopped dispatching (the trace or the duration is over): the backlog that
    drains then is no traffic to tune for, so the ceiling no longer counts as binding."""


@dataclass(frozen=True, slots=True)
class Slo:
    """The per-request limits goodput counts against ([criteria] ttft_p99_ms / tpot_p99_ms; None: none).
    TTFT here is what the user saw: TTFT as offered, from the request's due time (admission wait and
    lateness included)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_offered_s: float | None, tpot_s: float | None) -> bool:
        if self.ttft_s is not None and (ttft_offered_s is None or ttft_offered_s > self.ttft_s):
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


class Controller:
    """Collector `control` and the policy job. `tick()` is awaited every `control.interval`."""

    name = "control"

    def __init__(
        self,
        cfg: ControlConfig,
        start_limit: int,
        inputs: ControlInputs,
        actuator: Actuator,
        run_dir: Path,
        wall: Callable[[], float] = time.time,
        slo: Slo | None = None,
    ) -> None:
        self.cfg = cfg
        self.inputs = inputs
        self.actuator = actuator
        self._wall = wall
        self.slo = slo or Slo()
        self.state_path = run_dir / CONTROL_STATE_FILE
        settings = BatchSettings.from_config(
            cfg.batch, start_limit, dry_run=cfg.dry_run, ttft_limit_s=self.slo.ttft_s
        )
        self.batch = BatchPolicy(settings)
        self._good_tokens = 0.0
        self._finished = 0
        self._last_energy: float | None = None
        self._last_energy_s: float | None = None
        self.throughput = ThroughputJudge(ThroughputSettings.from_config(cfg.harm))
        self.recapture_settings = RecaptureSettings.from_config(cfg.recapture)
        self.recapture: RecapturePolicy | None = None
        self.recapture_note = ""
        self._hist_seen: Counter[int] = Counter()
        self._last_tokens: int | None = None
        self._last_prefill: int | None = None
        self._last_t: float | None = None
        self._idle_since: float | None = None
        self._drift_since: float | None = None
        self._advised = False
        self.spec_off_since: float | None = None
        self._workload_at_off: tuple[float, float] | None = None
        self._workload = [0.0, 0.0, 0]  # input tokens, output tokens, requests (since the last check)
        self.ticks = 0
        self.recaptures = 0
        self.restored = False
        self._rebuilding: asyncio.Task[None] | None = None
        self._load_state()

    # -- state ---------------------------------------------------------------------------------
    def _load_state(self) -> None:
        if not self.state_path.is_file():
            return
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
            now = self._wall()
            self.batch = BatchPolicy.from_state(self.batch.settings, state["batch"], now)
            if state.get("recapture"):
                self.recapture = RecapturePolicy.from_state(state["recapture"], self.recapture_settings)
            self.spec_off_since = state.get("spec_off_since")
            self.recaptures = int(state.get("recaptures", 0))
            self.restored = True
            log.info("control_state_restored", limit=self.batch.limit, sustained=self.batch.sustained)
        except (OSError, ValueError, KeyError, TypeError) as err:
            # A torn or foreign file must not stop the soak: start afresh and say so.
            log.warning("control_state_unreadable", path=str(self.state_path), error=str(err)[:200])

    def save_state(self) -> None:
        now = self._wall()
        state = {
            "saved_at": now,
            "batch": self.batch.to_state(now),
            "recapture": None if self.recapture is None else self.recapture.to_state(),
            "spec_off_since": self.spec_off_since,
            "recaptures": self.recaptures,
        }
        write_private(self.state_path, json.dumps(state, sort_keys=True).encode())

    # -- the loop --------------------------------------------------------------------------------
    async def start(self, gate: AdmissionGate) -> None:
        """The replay begins with `gate`: the ceiling the controller holds (restored, or the start) takes
        effect, through the actuator as every move."""
        await self.actuator.hold(gate, self.batch.limit, self.batch.settings.start)

    def observe_request(
        self,
        input_tokens: int,
        output_tokens: int,
        *,
        ok: bool = True,
        ttft_offered_s: float | None = None,
        tpot_s: float | None = None,
    ) -> None:
        """A finished request: its tokens count as goodput when it met the SLO; its lengths are the
        workload signature for turning speculation back on."""
        self._workload[0] += input_tokens
        self._workload[1] += output_tokens
        self._workload[2] += 1
        self._finished += 1
        if ok and output_tokens > 0 and self.slo.met(ttft_offered_s, tpot_s):
            self._good_tokens += output_tokens

    async def tick(self) -> None:
        cfg = self.cfg
        now = self._wall()
        self.ticks += 1
        tokens = self.inputs.output_tokens()
        interval = 0.0 if self._last_t is None else now - self._last_t
        delta = 0 if self._last_tokens is None else max(0, tokens - self._last_tokens)
        prefill_total = self.inputs.prompt_tokens_computed()
        prefill = None
        if prefill_total is not None and self._last_t is not None:
            # The collector counts from activation: a first total is all of the interval's.
            prefill = max(0, prefill_total - (self._last_prefill or 0))
        self._last_tokens, self._last_prefill, self._last_t = tokens, prefill_total, now
        changed = False
        good, self._good_tokens = self._good_tokens, 0.0
        finished, self._finished = self._finished, 0
        energy = self.inputs.energy_j()
        covered = self.inputs.energy_s()
        joules = power = None
        if energy is not None and self._last_energy is not None and energy >= self._last_energy:
            joules = energy - self._last_energy
            # Over the time the samples covered: a tick holds 9 or 11 samples of 10 Hz as often as 10.
            # No new sample (a stalled tier): the power is unknown, not zero.
            span: float | None = interval
            if covered is not None and self._last_energy_s is not None:
                span = covered - self._last_energy_s if covered > self._last_energy_s else None
            power = joules / span if span else None
        self._last_energy, self._last_energy_s = energy, covered
        binding = self.inputs.waiting() > 0 and not self.inputs.draining()
        self._judge_throughput(now, delta, interval, binding, prefill, power)
        if cfg.batch.enabled:
            harm = self.inputs.harm()
            if not harm and self.throughput.harmful and cfg.harm.act_on_throughput:
                harm = "throughput"
            # A clock harm in its tail is no tail while the throughput judge (when acted on) reads harm
            # now: its cause is present. On an H200 a shared load held the clock loss at 7-14 % against
            # the 10 % threshold for 150 s, a tail every few seconds, while tokens/s stayed 36-64 % down:
            # no trial could start.
            throughput_now = cfg.harm.act_on_throughput and self.throughput.at_threshold
            tick = Tick(
                t_s=now,
                interval_s=interval,
                harm=bool(harm),
                harm_kind=harm,
                harm_source=self.inputs.harm_source(harm) if harm and harm != "throughput" else "",
                fading=bool(harm)
                and harm != "throughput"
                and not throughput_now
                and self.inputs.harm_fading(),
                throttled=self.inputs.throttled(),
                binding=binding,
                tokens=float(delta),
                good_tokens=good,
                joules=joules,
                wait_s=self.inputs.head_wait(),
                finished=finished,
            )
            for out in self.batch.update(tick):
                if isinstance(out, BatchAction):
                    await self.actuator.set_ceiling(out)
                elif isinstance(out, TrialSkipped):
                    self.actuator.say_skipped(out)
                else:
                    self._result(out)
                changed = True
        # One rebuild at a time; the batch policy above is never held up by one.
        if cfg.recapture.enabled and not self.rebuilding:
            changed |= await self._recapture(now, produced=delta > 0)
        if cfg.mtp.enabled and not self.rebuilding:
            changed |= await self._mtp(now)
        if changed or self.ticks % 60 == 1:
            self.save_state()

    def _judge_throughput(
        self,
        now: float,
        delta: int,
        interval: float,
        binding: bool,
        prefill: int | None,
        power_w: float | None,
    ) -> None:
        if interval <= 0:
            return
        tp = self.throughput
        flight = None if self.inputs.draining() else self.inputs.in_flight()
        change = tp.update(
            now,
            delta / interval,
            binding=binding,
            limited=self.inputs.limited(),
            in_flight=flight,
            prefill_per_s=None if prefill is None else prefill / interval,
            power_w=power_w,
            shared=self.inputs.shared(),
        )
        if change is None:
            return
        ref = tp.reference or 0.0
        acts = self.cfg.harm.act_on_throughput
        # With the engine's prompt tokens known the figures count them at the weight, and say so.
        unit = f"tok/s (prompt tokens at {tp.settings.prefill_weight:g})" if prefill is not None else "tok/s"
        if change:
            message = (
                f"throughput {tp.loss:.0%} below {ref:,.0f} {unit} while the GPU is at a limit "
                f"and requests wait{' (another process computes on the GPU)' if tp.cotenant else ''}"
                f"{'' if acts else ' (recorded; control.harm.act_on_throughput is off)'}"
            )
        else:
            message = "throughput back while at a limit, or the limit gone: the harm is over"
        self.actuator.advise(
            "harm_enter" if change else "harm_leave",
            message,
            harm_kind="throughput",
            throughput_loss=round(tp.loss, 4),
            reference_tps=round(ref, 3),
            acted_on=acts,
            **({"cotenant": tp.cotenant} if change else {}),
        )

    def _result(self, r: ActionResult) -> None:
        unit = OBJECTIVE_UNIT.get(r.objective, "")

        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.4g} {unit}"

        head = f"{r.kind} {r.from_limit} -> {r.to_limit} at +{r.t_s - r.action_t_s:.0f} s"
        if r.decided_by == "aba_bracket":
            # The reason carries the three legs, the noise margin, the verdict and any block.
            message = f"{head}, judged A-B-A ({r.objective} in {unit}): {r.reason}"
        else:
            legs = f"{fmt(r.before)} before, {fmt(r.after)} after"
            if r.again is not None:
                legs += f", {fmt(r.again)} at {r.from_limit} again"
            if r.kept:
                verdict = "kept"
            elif r.decided_by == "harm_ended":
                verdict = "not judged"  # the reason says what follows (the way back, or the level before)
            else:
                verdict = f"{r.from_limit} in force"
            message = f"{head}: {r.objective} {legs}: {verdict} ({r.reason})"
        fields: dict[str, FieldValue] = {
            "action": r.kind,
            "from_limit": r.from_limit,
            "to_limit": r.to_limit,
            "objective": r.objective,
            "kept": r.kept,
            "decided_by": r.decided_by,
            "verdict": r.verdict,
            "reason": r.reason,
            "action_age_s": round(r.t_s - r.action_t_s, 3),
            "blocked_s": r.blocked_s,
        }
        for name, value in (("before", r.before), ("after", r.after), ("again", r.again)):
            if value is not None:
                fields[f"objective_{name}"] = value
        if r.noise is not None:
            fields["noise_margin"] = r.noise
        self.actuator.advise("action_result", message, **fields)

    async def _recapture(self, now: float, produced: bool) -> bool:
        info = self.inputs.engine()
        if info is None:
            return False
        if self.recapture is None:
            if not info.cudagraphs and not self.cfg.recapture.without_graphs:
                self.recapture_note = "the engine runs without CUDA graphs: nothing to re-capture"
                return False
            self.recapture = RecapturePolicy(self.recapture_settings, info.capture_sizes)
        hist = self.inputs.tokens_per_step()
        delta = {k: v - self._hist_seen.get(k, 0) for k, v in hist.items() if v > self._hist_seen.get(k, 0)}
        self._hist_seen = Counter(hist)
        if delta:
            self.recapture.observe_steps(delta)
        # Idle: nothing in flight and no token produced since the last tick (light traffic finishes
        # between two ticks, so an empty queue alone is not idle); or, when allowed, a few running.
        below = self.cfg.recapture.idle_below_running
        running = self.inputs.in_flight()
        idle = running <= below if below > 0 else running == 0 and not produced
        if idle:
            if self._idle_since is None:
                self._idle_since = now
        else:
            self._idle_since = None
        idle_for = 0.0 if self._idle_since is None else now - self._idle_since
        action = self.recapture.decide(now, idle_for)
        if action is None:
            return False
        policy = self.recapture

        async def apply() -> None:
            ok = await self.actuator.recapture(action)
            if ok:
                policy.applied(self._wall(), action.sizes)
                self.recaptures += 1
            else:
                policy.failed(self._wall())

        await self._background(apply())
        return True

    async def _mtp(self, now: float) -> bool:
        m = self.cfg.mtp
        info = self.inputs.engine()
        if self.spec_off_since is not None:
            return await self._maybe_spec_on(now, info)
        if info is None or not info.speculative_tokens or not self.inputs.drifting():
            self._drift_since = None
            self._advised = False
            return False
        if self._drift_since is None:
            self._drift_since = now
        held = now - self._drift_since
        if held < m.hold or self._advised:
            return False
        self._advised = True
        message = f"speculative acceptance below its baseline for {held:.0f} s (>= {m.hold:g} s)"
        self.actuator.advise("mtp_advisory", message, drifting_for_s=round(held, 3), spec_off=m.spec_off)
        if m.spec_off:

            async def apply() -> None:
                if await self.actuator.speculation(False, message):
                    self.spec_off_since = self._wall()
                    self._workload_at_off = self._signature()

            await self._background(apply())
        return True

    def _signature(self) -> tuple[float, float] | None:
        inp, out, n = self._workload
        self._workload = [0.0, 0.0, 0]
        return None if n == 0 else (inp / n, out / n)

    async def _maybe_spec_on(self, now: float, info: EngineInfo | None) -> bool:
        m = self.cfg.mtp
        assert self.spec_off_since is not None
        off_for = now - self.spec_off_since
        reason = ""
        if off_for >= m.retry:
            reason = f"speculation off for {off_for:.0f} s (>= {m.retry:g} s): trying it again"
        elif self._workload[2] >= 50 and self._workload_at_off is not None:
            sig = self._signature()
            base = self._workload_at_off
            if sig is not None:
                moved = max(abs(s - b) / b if b else 0.0 for s, b in zip(sig, base, strict=True))
                if moved >= m.workload_change:
                    reason = (
                        f"workload changed by {moved:.0%} (mean prompt/output length) "
                        "since speculation went off"
                    )
        if not reason:
            return False

        async def apply() -> None:
            if await self.actuator.speculation(True, reason):
                self.spec_off_since = None
                self._drift_since = None
                self._advised = False

        await self._background(apply())
        return True

    async def _background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a rebuild (minutes on a GPU) beside the loop: the batch policy keeps reacting to
        throttling meanwhile; re-capture and speculation wait for it to finish."""

        async def run() -> None:
            try:
                await work
            finally:
                self.save_state()

        self._rebuilding = asyncio.create_task(run(), name="soakd-control-rebuild")
        await asyncio.sleep(0)  # let it start now (a quick one finishes within this tick)

    @property
    def rebuilding(self) -> bool:
        return self._rebuilding is not None and not self._rebuilding.done()

    async def finish(self) -> None:
        """At the end of the run: wait for a rebuild in progress (cancelling one would leave the engine
        half started), then save the state."""
        if self._rebuilding is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._rebuilding)
        self.save_state()

    # -- points ----------------------------------------------------------------------------------
    def collect(self, now_ns: int) -> Sequence[Sample]:
        gate = self.actuator.gate
        fields: dict[str, FieldValue] = {
            "policy_limit": self.batch.limit,
            "throttled": int(self.inputs.throttled()),
            "harm": int(bool(self.inputs.harm())),
            "throughput_harm": int(self.throughput.harmful),
            "throughput_loss": self.throughput.loss,
            "trial": int(self.batch.trial),
            "waiting": self.inputs.waiting(),
            "head_wait_s": self.inputs.head_wait(),
            "actions": self.batch.actions + self.recaptures,
            "dry_run": self.actuator.dry_run,
        }
        if self.throughput.reference is not None:  # absent: no reference, so the loss of 0 judges nothing
            fields["throughput_reference"] = self.throughput.reference
        if gate is not None:
            fields["ceiling"] = gate.limit
        if self.actuator.engine_limit is not None:
            fields["engine_limit"] = self.actuator.engine_limit
        applied = self.actuator.engine_applied()
        if applied is not None:
            fields["engine_applied"] = applied
        if self.batch.sustained is not None:
            fields["sustained_limit"] = int(self.batch.sustained["limit"])
            tps = self.batch.sustained.get("tokens_per_s")
            if tps is not None:
                fields["sustained_tokens_per_s"] = float(tps)
        if self._idle_since is not None:
            fields["idle_s"] = self._wall() - self._idle_since
        if self.spec_off_since is not None:
            fields["spec_off"] = True
        info = self.inputs.engine()
        tags = {"config": info.config_id} if info is not None else {}
        return [Sample("control", fields, now_ns, tags=tags)]

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {
            "dry_run": self.actuator.dry_run,
            "lever": self.actuator.lever.kind,
            "ceiling": self.batch.in_force,
            "start": self.batch.settings.start,
            "objective": self.batch.settings.objective,
            "sustained": self.batch.sustained,
            "batch_actions": 0 if self.actuator.dry_run else self.batch.actions,
            "advice": self.batch.advice,
            "kept": self.batch.kept,
            "reverted": self.batch.reverted,
            "trials_skipped": self.batch.skipped,
            "throughput_harm_episodes": self.throughput.episodes,
            # reference_tps (and reference_note when there is none); the prompt tokens it counted (None:
            # no step counted its cache hits, so output tokens alone were judged).
            "throughput": {**self.throughput.summary(), "prompt_tokens_computed": self._last_prefill},
            "results": self.batch.results[-50:],
            # Only levels that were in force: advice never applied has no throughput of its own.
            "levels": self.batch.levels(),
            "recaptures": self.recaptures,
            "restored": self.restored,
            "applied": self.actuator.applied,
            "failed": self.actuator.failed,
        }
        if self.actuator.lever.note:
            out["lever_note"] = self.actuator.lever.note  # why the configured lever is not the one used
        if self.recapture is not None:
            sizes = self.recapture.current_sizes
            out["capture_sizes"] = list(sizes)
            window = self.recapture.window()
            if window and sizes:
                cov = padding_stats(window, sizes)
                out["graph_coverage_since_capture"] = {
                    "hit_rate": cov.hit_rate,
                    "padding_waste": cov.padding_waste,
                }
        elif self.recapture_note:
            out["recapture"] = self.recapture_note
        return out

    def close(self) -> None:
        return None


def _in_scope(scope: str, gpu: T | None, host: T | None) -> list[T]:
    """The sources a scope reads: the GPUs', the host's, or both ("any")."""
    return [f for name, f in (("gpu", gpu), ("host", host)) if f is not None and scope in ("any", name)]


def input_throttled(
    scope: str, gpu: Callable[[], bool] | None, host: Callable[[], bool] | None
) -> Callable[[], bool]:
    """The `throttled` input for a scope: any GPU detector, the host's, or either."""
    sources = _in_scope(scope, gpu, host)
    return lambda: any(f() for f in sources)


def input_harm(
    scope: str, gpu: Callable[[], str] | None, host: Callable[[], str] | None
) -> Callable[[], str]:
    """The `harm` input for a scope: "thermal" when any source says so, else "power", else ""."""
    sources = _in_scope(scope, gpu, host)

    return lambda: worst_harm(f() for f in sources)


def state_of(path: Path) -> dict[str, Any] | None:
    """The saved controller state of a run directory, or None."""
    try:
        # Never through a symlink, never a FIFO or device (files.open_no_follow): a refusal reads as none.
        data = read_json_no_follow(path / CONTROL_STATE_FILE)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
