"""The engine's lifecycle during a soak: rebuild it with a changed configuration, restart it when it dies.

The supervisor is the Engine the replay drives. It owns the current engine and swaps it:
- **rebuild** (a scheduled change, later the control loop): new requests wait; requests in flight are
  drained (finish normally) or aborted (recorded as failed with the reason); the old engine stops,
  one with the changed configuration starts, waiting requests go on. If the new configuration does
  not start, the previous one is started again and the failure is an event.
- **death** (a process gone, the engine core failed, the server refusing connections): requests in
  flight fail with the reason, new ones wait, the engine is started again, up to `max_restarts`.
Every request is counted exactly once by the replay: a waiting request is sent to the new engine, an
in-flight one ends as completed, failed (engine died) or aborted (rebuild). Each swap is an event with
its reason and its downtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from soakd.config import EngineChange, EngineConfig
from soakd.engine.base import Engine, EngineInfo, GenerationRequest
from soakd.errors import EngineError
from soakd.metric import FieldValue

log = structlog.get_logger(__name__)

_DIED = "engine died: "

EngineFactory = Callable[[EngineConfig], Engine]
EventFn = Callable[..., None]
StartedFn = Callable[[EngineInfo], None]


class RequestAborted(Exception):
    """A request in flight was aborted on purpose (a rebuild in abort mode); the replay records it."""


class RequestLost(Exception):
    """A request in flight when the engine died; the engine is being restarted."""


def apply_change(cfg: EngineConfig, change: EngineChange) -> EngineConfig:
    """The engine configuration after a change (pure)."""
    update: dict[str, Any] = {}
    if change.max_num_seqs is not None:
        update["max_num_seqs"] = change.max_num_seqs
    spec = cfg.speculative
    if change.num_speculative_tokens is not None:
        spec = spec.model_copy(update={"num_speculative_tokens": change.num_speculative_tokens})
    if change.speculative_enabled is not None:
        spec = spec.model_copy(update={"enabled": change.speculative_enabled})
    update["speculative"] = spec
    extra = dict(cfg.extra_args)
    extra.update(change.extra_args)
    if change.cudagraph_capture_sizes is not None:
        comp = dict(extra.get("compilation_config") or {})
        comp["cudagraph_capture_sizes"] = sorted(set(change.cudagraph_capture_sizes))
        extra["compilation_config"] = comp
    update["extra_args"] = extra
    return cfg.model_copy(update=update)


@dataclass(slots=True)
class LifecycleStats:
    rebuilds: int = 0
    rebuild_failures: int = 0
    restarts: int = 0
    drained: int = 0
    """Requests in flight at a rebuild that finished normally before the swap."""
    aborted: int = 0
    """Requests aborted by a rebuild (abort mode, or still running at the drain timeout)."""
    lost: int = 0
    """Requests in flight when the engine died."""
    downtime_s: float = 0.0
    """Total time no engine was taking requests, over all rebuilds and restarts."""


class EngineSupervisor:
    """An Engine that delegates to the current engine and swaps it on rebuild or death."""

    def __init__(
        self,
        factory: EngineFactory,
        cfg: EngineConfig,
        *,
        on_event: EventFn,
        on_started: StartedFn | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = factory
        self.cfg = cfg
        self._on_event = on_event
        self._on_started = on_started
        self._now = monotonic
        self._engine: Engine | None = None
        self._generation = 0
        self._ready = asyncio.Event()
        self._swap_lock = asyncio.Lock()
        self._inflight: dict[str, asyncio.Task[Any]] = {}
        self._aborting: dict[str, str] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._failed = ""
        self._restart_task: asyncio.Task[None] | None = None
        self._lost_mark = 0
        self._retired: list[dict[str, object]] = []
        self._stopped: list[Engine] = []
        self._draining = False
        self._drained_now = 0
        self.stats = LifecycleStats()
        self.configs: list[dict[str, object]] = []
        """Each engine configuration the run used, with when it started (for the run metadata)."""

    # -- the Engine protocol -------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        if self._engine is None:
            raise EngineError("engine not started")
        return self._engine.info

    @property
    def current(self) -> Engine | None:
        return self._engine

    async def start(self) -> None:
        self._install(await self._start_engine(self.cfg))

    def _install(self, engine: Engine) -> None:
        self._engine = engine
        self._generation += 1
        info = engine.info
        self.configs.append({"config_id": info.config_id, "start_s": info.start_s, "wall_s": time.time()})
        if self._on_started is not None:
            try:
                self._on_started(info)
            # The engine runs; bookkeeping that fails (a full disk for the metadata) must not
            # leave requests waiting for an engine that is there.
            except Exception as err:  # noqa: BLE001
                log.error("engine_started_hook_failed", error=f"{type(err).__name__}: {err}"[:200])
        self._ready.set()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        # Requests that arrive while the engine is being swapped wait here (their admission slot held),
        # so the swap's downtime shows in their TTFT, as a user would see it.
        await self._ready.wait()
        if self._failed:
            raise EngineError(self._failed)
        engine = self._engine
        assert engine is not None
        generation = self._generation
        task = asyncio.current_task()
        assert task is not None
        rid = request.request_id
        self._inflight[rid] = task
        self._idle.clear()
        try:
            async for n in engine.generate(request):
                yield n
            if self._draining:
                self._drained_now += 1
        except asyncio.CancelledError:
            reason = self._aborting.pop(rid, None)
            if reason is None:
                raise
            task.uncancel()
            if reason.startswith(_DIED):
                self.stats.lost += 1
                raise RequestLost(reason) from None
            raise RequestAborted(reason) from None
        except EngineError as err:
            if not self.cfg.restart.enabled:
                raise
            self.stats.lost += 1
            self._died(generation, str(err), counted=1)
            raise RequestLost(f"{_DIED}{err}"[:200]) from err
        finally:
            self._aborting.pop(rid, None)
            self._inflight.pop(rid, None)
            if not self._inflight:
                self._idle.set()

    def process_ids(self) -> list[int]:
        return self._engine.process_ids() if self._engine is not None else []

    def alive(self) -> bool:
        return not self._failed

    @property
    def ready(self) -> bool:
        """An engine is up and serving (not starting, rebuilding or restarting)."""
        return self._engine is not None and self._ready.is_set() and not self._failed

    async def memory_stats(self) -> list[Any]:
        if self._engine is None or not self._ready.is_set():
            raise EngineError("engine is being restarted")
        return await self._engine.memory_stats()

    async def metrics_text(self) -> str:
        if self._engine is None or not self._ready.is_set():
            raise EngineError("engine is being restarted")
        return await self._engine.metrics_text()

    async def prepare_replay(self, concurrency: int) -> None:
        if self._engine is None or not self._ready.is_set():
            return
        # An engine's preparation is an optimisation; one that raises anyway does not end the soak.
        try:
            await self._engine.prepare_replay(concurrency)
        except Exception as err:  # noqa: BLE001
            log.warning("prepare_replay_failed", error=f"{type(err).__name__}: {err}"[:200])

    def telemetry_summary(self) -> dict[str, object]:
        """Each engine's own summary (one per start, oldest first) and the lifecycle counts."""
        engines = list(self._retired)
        if self._engine is not None:
            engines.append(self._engine.telemetry_summary())
        return {"engines": engines, "lifecycle": {**_asdict(self.stats), "configs": self.configs}}

    async def _stop_engine(self, engine: Engine) -> None:
        """Stop an engine, keeping its telemetry summary (taken before it goes). A failure is logged:
        stopping a dead engine may raise anything, and the swap must go on."""
        if any(e is engine for e in self._stopped):
            return
        self._stopped.append(engine)
        if self._engine is engine:
            self._engine = None
        try:
            self._retired.append(engine.telemetry_summary())
            await engine.stop()
        except Exception as err:  # noqa: BLE001
            log.warning("engine_stop_failed", error=f"{type(err).__name__}: {err}"[:200])

    async def stop(self) -> None:
        if self._restart_task is not None and not self._restart_task.done():
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
        if self._engine is not None:
            await self._stop_engine(self._engine)

    async def _start_engine(self, cfg: EngineConfig) -> Engine:
        """Build and start an engine; whatever ends the start early (an error, a cancellation) stops
        what was started, so no engine process outlives a failed or cut-short swap."""
        engine = self._factory(cfg)
        try:
            await engine.start()
        except BaseException:
            await self._stop_engine(engine)
            raise
        return engine

    # -- death ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Called periodically: notices an engine that died while no request was reading from it."""
        engine = self._engine
        if engine is not None and self._ready.is_set() and not self._failed and not engine.alive():
            if self.cfg.restart.enabled:
                self._died(self._generation, "engine process gone")
            else:
                self._failed = "engine process gone"

    def _died(self, generation: int, reason: str, counted: int = 0) -> None:
        """Start one restart per dead engine (many requests fail at once; the first one triggers it)."""
        if generation != self._generation or (
            self._restart_task is not None and not self._restart_task.done()
        ):
            return
        self._lost_mark = self.stats.lost - counted
        self._ready.clear()
        self._restart_task = asyncio.create_task(self._restart(reason, generation))

    async def _restart(self, reason: str, generation: int) -> None:
        t0 = self._now()
        try:
            await self._restart_locked(reason, t0, generation)
        except asyncio.CancelledError:
            # The run ended while the engine was coming back: still an event, with the time it took.
            self._event(
                "engine_restart",
                f"engine died ({reason}); the run ended before it was back",
                reason=reason[:200],
                downtime_s=self._now() - t0,
                restarts=self.stats.restarts,
                ok=0,
            )
            raise
        # Whatever else goes wrong while restarting ends the run cleanly, never a silent stall.
        except Exception as err:  # noqa: BLE001
            self._fail(f"engine died ({reason}) and restarting it failed: {type(err).__name__}: {err}"[:300])

    async def _restart_locked(self, reason: str, t0: float, generation: int) -> None:
        async with self._swap_lock:
            if generation != self._generation:
                # A rebuild swapped the engine while this restart waited for the lock: the engine
                # that died is gone already, and the new one must not be restarted.
                log.info("engine_restart_not_needed", reason=reason)
                self._ready.set()
                return
            log.error("engine_died", reason=reason, in_flight=len(self._inflight))
            # Requests still reading from the dead engine fail now, with the reason (a dead engine
            # core may leave a stream open forever).
            self._abort_all(f"{_DIED}{reason}")
            await self._wait_idle(10.0)
            lost = self.stats.lost - self._lost_mark
            old = self._engine
            if old is not None:
                await self._stop_engine(old)
            attempt = 0
            while True:
                if self.stats.restarts >= self.cfg.restart.max_restarts:
                    self._fail(f"engine died ({reason}) and {self.stats.restarts} restarts are used up")
                    return
                if attempt:
                    # The dead engine's processes may still hold the GPU or the port for a moment:
                    # back off (2, 4, 8 ... 30 s) instead of spending every restart at once.
                    await asyncio.sleep(min(30.0, 2.0**attempt))
                attempt += 1
                self.stats.restarts += 1
                try:
                    engine = await self._start_engine(self.cfg)
                except EngineError as err:
                    log.error("engine_restart_failed", error=str(err), attempt=self.stats.restarts)
                    continue
                break
            downtime = self._now() - t0
            self.stats.downtime_s += downtime
            self._install(engine)
            self._event(
                "engine_restart",
                f"engine died ({reason}); restarted in {downtime:.1f} s, {lost} requests in flight failed",
                reason=reason[:200],
                downtime_s=downtime,
                lost=lost,
                restarts=self.stats.restarts,
                config=engine.info.config_id,
                ok=1,
            )

    def _fail(self, reason: str) -> None:
        self._failed = reason
        self._ready.set()  # waiting requests go on and fail with the reason; the replay ends
        self._event("engine_failed", reason)

    # -- rebuild -------------------------------------------------------------------------------
    async def rebuild(self, change: EngineChange) -> bool:
        """Swap the engine for one with `change` applied; True when the new configuration runs."""
        async with self._swap_lock:
            if self._failed or self._engine is None:
                return False
            t0 = self._now()
            self._ready.clear()
            old_id = self._engine.info.config_id
            drained = 0
            if change.mode == "drain":
                self._draining, self._drained_now = True, 0
                try:
                    await self._wait_idle(self.cfg.drain_timeout)
                finally:
                    self._draining = False
                drained = self._drained_now  # finished normally; a failure meanwhile is not "drained"
            aborted = len(self._inflight)
            if aborted:
                self._abort_all(f"engine rebuild: {change.reason}")
                await self._wait_idle(30.0)
            self.stats.drained += drained
            self.stats.aborted += aborted
            new_cfg = apply_change(self.cfg, change)
            await self._stop_engine(self._engine)
            ok = True
            try:
                engine = await self._start_engine(new_cfg)
                self.cfg = new_cfg
            # Any failure to start the new configuration falls back to the one that ran.
            except Exception as err:  # noqa: BLE001
                ok = False
                self.stats.rebuild_failures += 1
                log.error("engine_rebuild_failed", error=f"{type(err).__name__}: {err}"[:200])
                try:
                    engine = await self._start_engine(self.cfg)
                except Exception as err2:  # noqa: BLE001
                    self._fail(
                        f"engine rebuild failed ({err}) and the previous configuration "
                        f"did not restart ({err2})"
                    )
                    return False
            downtime = self._now() - t0
            self.stats.downtime_s += downtime
            self.stats.rebuilds += 1
            self._install(engine)
            fields: dict[str, FieldValue] = {
                "reason": change.reason[:200],
                "mode": change.mode,
                "downtime_s": downtime,
                "drained": drained,
                "aborted": aborted,
                "config_from": old_id,
                "config_to": engine.info.config_id,
                "ok": int(ok),
            }
            what = "rebuilt" if ok else "rebuild failed, previous configuration restored"
            self._event(
                "engine_rebuild",
                f"engine {what} ({change.reason}) in {downtime:.1f} s: {drained} drained, {aborted} aborted",
                **fields,
            )
            return ok

    def _abort_all(self, reason: str) -> None:
        for rid, task in list(self._inflight.items()):
            self._aborting[rid] = reason
            task.cancel()

    async def _wait_idle(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    def _event(self, kind: str, message: str, **fields: FieldValue) -> None:
        self._on_event(kind, message, **fields)


def _asdict(stats: LifecycleStats) -> dict[str, object]:
    return {name: getattr(stats, name) for name in stats.__dataclass_fields__}
