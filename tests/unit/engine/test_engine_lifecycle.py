"""The engine supervisor: rebuild with drain or abort, restart on death, exact accounting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from soakd.config import EngineChange, EngineConfig
from soakd.engine.base import EngineInfo, GenerationRequest
from soakd.engine.supervisor import EngineSupervisor, RequestAborted, RequestLost, apply_change
from soakd.errors import EngineError


class Slow:
    """Streams one token every `tick` seconds; can be made to die. A request whose id is in `gates` waits
    for its gate instead, then streams every token at once (no timer: the test, not the machine's speed,
    says when it ends)."""

    def __init__(self, cfg: EngineConfig, tick: float = 0.01, fail_start: bool = False) -> None:
        self.cfg = cfg
        self.tick = tick
        self.fail_start = fail_start
        self.dead = False
        self.stopped = False
        self.gates: dict[str, asyncio.Event] = {}

    @property
    def info(self) -> EngineInfo:
        return EngineInfo("fake", "1", "m", f"seqs{self.cfg.max_num_seqs}", vocab_size=100)

    async def start(self) -> None:
        if self.fail_start:
            raise EngineError("does not fit")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        gate = self.gates.get(request.request_id)
        if gate is not None:
            await gate.wait()
        for _ in range(request.max_tokens):
            if gate is None:
                await asyncio.sleep(self.tick)
            if self.dead:
                raise EngineError("engine core died")
            yield 1

    def process_ids(self) -> list[int]:
        return []

    def alive(self) -> bool:
        return not self.dead

    async def memory_stats(self) -> list[Any]:
        return [{"rss": 1}]

    async def metrics_text(self) -> str:
        return ""

    def telemetry_summary(self) -> dict[str, object]:
        return {"max_num_seqs": self.cfg.max_num_seqs}

    async def prepare_replay(self, concurrency: int) -> None:
        return None

    async def stop(self) -> None:
        self.stopped = True


def req(i: int, tokens: int = 20) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2], max_tokens=tokens)


async def consume(sup: EngineSupervisor, r: GenerationRequest) -> str:
    n = 0
    try:
        async for k in sup.generate(r):
            n += k
    except RequestAborted as err:
        return f"aborted: {err}"
    except RequestLost as err:
        return str(err)
    return f"ok {n}"


def supervisor(engines: list[Slow], events: list[tuple[str, dict[str, Any]]], **cfg: Any) -> EngineSupervisor:
    def factory(c: EngineConfig) -> Slow:
        engines.append(Slow(c, fail_start=c.max_num_seqs == 999))
        return engines[-1]

    def on_event(kind: str, message: str, **fields: Any) -> None:
        events.append((kind, fields))

    return EngineSupervisor(factory, EngineConfig(**cfg), on_event=on_event)


def on_drain_start(sup: EngineSupervisor, fn: Callable[[], None]) -> None:
    """Call `fn` as a drain begins, before its timeout starts: what it lets finish is queued on the loop
    ahead of the timeout, however late the loop runs."""
    wait_idle = sup._wait_idle

    async def hooked(timeout_s: float) -> None:
        if sup._draining:
            fn()
        await wait_idle(timeout_s)

    sup._wait_idle = hooked  # type: ignore[method-assign]


def test_apply_change_touches_only_what_it_names() -> None:
    base = EngineConfig(extra_args={"compilation_config": {"mode": 3}, "x": 1})
    new = apply_change(
        base,
        EngineChange(at=1, max_num_seqs=4, cudagraph_capture_sizes=[8, 1, 2, 2], num_speculative_tokens=2),
    )
    assert new.max_num_seqs == 4 and new.speculative.num_speculative_tokens == 2
    assert new.extra_args == {"compilation_config": {"mode": 3, "cudagraph_capture_sizes": [1, 2, 8]}, "x": 1}
    assert base.extra_args["compilation_config"] == {"mode": 3}  # the old config is not changed
    off = apply_change(base, EngineChange(at=1, speculative_enabled=False))
    assert not off.speculative.enabled and off.max_num_seqs == base.max_num_seqs


async def test_drain_rebuild_lets_requests_in_flight_finish_and_holds_new_ones() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []
    sup = supervisor(engines, events)
    await sup.start()
    first = [asyncio.create_task(consume(sup, req(i))) for i in range(3)]
    await asyncio.sleep(0.03)
    rebuild = asyncio.create_task(sup.rebuild(EngineChange(at=1, mode="drain", max_num_seqs=4)))
    await asyncio.sleep(0.01)
    late = asyncio.create_task(consume(sup, req(9, 2)))  # arrives during the swap: waits, then runs
    assert await rebuild is True
    results = await asyncio.gather(*first, late)
    assert results == ["ok 20"] * 3 + ["ok 2"]
    assert engines[0].stopped and sup.info.config_id == "seqs4"
    ((kind, fields),) = events
    assert kind == "engine_rebuild" and fields["drained"] == 3 and fields["aborted"] == 0
    assert fields["config_from"] == "seqs16" and fields["config_to"] == "seqs4"
    await sup.stop()


async def test_abort_rebuild_fails_requests_in_flight_with_the_reason() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []
    sup = supervisor(engines, events)
    await sup.start()
    tasks = [asyncio.create_task(consume(sup, req(i, 500))) for i in range(4)]
    await asyncio.sleep(0.03)
    assert await sup.rebuild(EngineChange(at=1, mode="abort", reason="fewer seqs", max_num_seqs=2))
    results = await asyncio.gather(*tasks)
    assert results == ["aborted: engine rebuild: fewer seqs"] * 4
    assert events[0][1]["aborted"] == 4 and sup.stats.aborted == 4
    await sup.stop()


async def test_a_drain_that_takes_too_long_aborts_the_rest() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []
    sup = supervisor(engines, events, drain_timeout=0.05)
    await sup.start()
    # The quick request ends as the drain begins; the slow one never would: the timeout ends it.
    quick_gate, never = asyncio.Event(), asyncio.Event()
    engines[0].gates = {"r0": quick_gate, "r1": never}
    on_drain_start(sup, quick_gate.set)
    quick = asyncio.create_task(consume(sup, req(0, 2)))
    slow = asyncio.create_task(consume(sup, req(1, 1000)))
    await asyncio.sleep(0)  # one loop turn: both start and reach their gates
    assert len(sup._inflight) == 2  # both in flight before the rebuild
    await asyncio.wait_for(sup.rebuild(EngineChange(at=1, mode="drain")), 60)  # a hang guard only
    assert await quick == "ok 2" and (await slow).startswith("aborted")
    assert (events[0][1]["drained"], events[0][1]["aborted"]) == (1, 1)
    await sup.stop()


async def test_a_configuration_that_does_not_start_falls_back_to_the_previous_one() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []
    sup = supervisor(engines, events)
    await sup.start()
    assert await sup.rebuild(EngineChange(at=1, max_num_seqs=999)) is False
    assert sup.info.config_id == "seqs16" and sup.cfg.max_num_seqs == 16
    assert events[0][1]["ok"] == 0 and sup.stats.rebuild_failures == 1
    assert await consume(sup, req(1, 3)) == "ok 3"
    await sup.stop()


async def test_death_fails_requests_in_flight_and_restarts_once() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []
    sup = supervisor(engines, events)
    await sup.start()
    tasks = [asyncio.create_task(consume(sup, req(i, 1000))) for i in range(5)]
    await asyncio.sleep(0.03)
    engines[0].dead = True
    results = await asyncio.gather(*tasks)
    assert all(r.startswith("engine died") for r in results)
    assert await consume(sup, req(7, 3)) == "ok 3"  # waits for the restart, then runs
    assert len(engines) == 2 and sup.stats.restarts == 1 and sup.stats.lost == 5
    kinds = [k for k, _ in events]
    assert kinds == ["engine_restart"] and events[0][1]["lost"] == 5
    await sup.stop()


async def test_death_noticed_while_idle_and_restarts_run_out() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []
    sup = supervisor(engines, events, restart={"max_restarts": 1})
    await sup.start()
    engines[0].dead = True
    sup.check()
    assert await consume(sup, req(1, 2)) == "ok 2"
    engines[1].dead = True
    sup.check()
    with pytest.raises(EngineError, match="restarts are used up"):
        await consume(sup, req(2, 2))
    assert not sup.alive() and [k for k, _ in events] == ["engine_restart", "engine_failed"]
    await sup.stop()


async def test_restart_disabled_lets_the_engine_error_through() -> None:
    engines: list[Slow] = []
    sup = supervisor(engines, [], restart={"enabled": False})
    await sup.start()
    task = asyncio.create_task(consume(sup, req(1, 1000)))
    await asyncio.sleep(0.02)
    engines[0].dead = True
    with pytest.raises(EngineError):
        await task
    await sup.stop()
    summary = sup.telemetry_summary()
    assert summary["engines"] == [{"max_num_seqs": 16}]


async def test_an_unexpected_start_error_during_a_restart_fails_the_run_instead_of_stalling() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []

    def factory(c: EngineConfig) -> Slow:
        engine = Slow(c)
        if engines:

            async def broken() -> None:
                raise OSError("disk full")

            engine.start = broken  # type: ignore[method-assign]
        engines.append(engine)
        return engine

    def on_event(kind: str, message: str, **fields: Any) -> None:
        events.append((kind, fields))

    sup = EngineSupervisor(factory, EngineConfig(), on_event=on_event)
    await sup.start()
    engines[0].dead = True
    sup.check()
    with pytest.raises(EngineError, match="disk full"):
        await asyncio.wait_for(consume(sup, req(1, 2)), 5)
    assert not sup.alive() and [k for k, _ in events] == ["engine_failed"]
    assert engines[1].stopped  # the half-started engine was stopped
    await sup.stop()
    assert len(sup.telemetry_summary()["engines"]) == 2  # each engine once


async def test_a_restart_queued_behind_a_rebuild_leaves_the_rebuilt_engine_alone() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []
    sup = supervisor(engines, events, drain_timeout=0.05)
    await sup.start()
    slow = asyncio.create_task(consume(sup, req(1, 1000)))
    await asyncio.sleep(0.02)
    rebuild = asyncio.create_task(sup.rebuild(EngineChange(at=1, mode="drain", max_num_seqs=4)))
    await asyncio.sleep(0.01)
    engines[0].dead = True  # the old engine dies while the rebuild drains it
    assert await rebuild is True
    assert (await slow).startswith(("engine died", "aborted"))
    if sup._restart_task is not None:
        await sup._restart_task  # a queued restart has run, if one was queued
    assert sup.info.config_id == "seqs4" and not engines[-1].stopped
    assert sup.stats.restarts == 0 and await consume(sup, req(2, 2)) == "ok 2"
    await sup.stop()


async def test_drained_counts_only_requests_that_finished_normally() -> None:
    engines: list[Slow] = []
    events: list[tuple[str, dict[str, Any]]] = []
    sup = supervisor(engines, events, drain_timeout=60.0)  # a hang guard: the drain ends on its own
    await sup.start()
    ok_gate, doomed_gate = asyncio.Event(), asyncio.Event()
    engines[0].gates = {"r0": ok_gate, "r1": doomed_gate}
    on_drain_start(sup, ok_gate.set)  # the short request finishes normally during the drain
    ok = asyncio.create_task(consume(sup, req(0, 3)))
    doomed = asyncio.create_task(consume(sup, req(1, 1000)))
    await asyncio.sleep(0)  # one loop turn: both start and reach their gates
    assert len(sup._inflight) == 2  # both in flight before the rebuild
    rebuild = asyncio.create_task(sup.rebuild(EngineChange(at=1, mode="drain")))
    await asyncio.wait({ok, rebuild}, return_when=asyncio.FIRST_COMPLETED)
    assert ok.done() and not rebuild.done()  # the drain still waits for the long request
    engines[0].dead = True  # the long request fails during the drain: not "drained"
    doomed_gate.set()
    await rebuild
    assert await ok == "ok 3" and (await doomed).startswith("engine died")
    assert events[-1][0] == "engine_rebuild" and events[-1][1]["drained"] == 1
    await sup.stop()
