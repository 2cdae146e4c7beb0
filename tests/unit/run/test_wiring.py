"""The collector registry and the engine_started hook: what `telemetry.collectors` turns on is what runs,
and a (re)started engine retags and re-judges the collectors that depend on its configuration."""

from __future__ import annotations

import asyncio
import typing
from pathlib import Path

import pytest

from soakd.clock import SystemClock
from soakd.collectors.base import EngineListener
from soakd.collectors.engine import EngineCollector
from soakd.collectors.host import HostCollector
from soakd.collectors.host_throttle import HostThrottleWatch
from soakd.collectors.registry import REGISTRY, Build, build_collectors, find
from soakd.collectors.spec import AcceptanceDrift, DriftSettings, SpecProfile
from soakd.config import CollectorName, Config
from soakd.engine.base import EngineInfo
from soakd.engine.supervisor import EngineSupervisor
from soakd.live import LiveRun
from soakd.policies.lever import Lever, choose_lever
from soakd.sinks.spool import Spool
from soakd.sinks.writer import SampleWriter


def _info(config_id: str, spec: int = 0, signals: tuple[str, ...] = ()) -> EngineInfo:
    return EngineInfo(
        "stub", "1", "m", config_id, 1000, speculative_tokens=spec, cudagraphs=True, signals=signals
    )


def _build(tmp_path: Path, collectors: list[str]) -> Build:
    cfg = Config.model_validate({"telemetry": {"collectors": collectors}})
    writer = SampleWriter(Spool(tmp_path / "spool", 1 << 20, 1.0), {})
    drift = AcceptanceDrift(DriftSettings(60.0, 60.0, 0.1, 100))

    def build_engine(_: object) -> typing.Any:
        raise AssertionError("not started here")

    return Build(
        cfg,
        tmp_path,
        writer,
        EngineSupervisor(build_engine, cfg.engine, on_event=lambda *a, **k: None),
        LiveRun(SystemClock(), 60.0),
        EngineCollector(active=False, drift=drift),
        SpecProfile(),
        None,
    )


def test_every_configurable_collector_name_has_a_factory_and_no_factory_is_unreachable() -> None:
    names = set(typing.get_args(CollectorName))
    assert {entry.name for entry in REGISTRY} == names


def test_only_the_listed_collectors_are_built(tmp_path: Path) -> None:
    b = _build(tmp_path, ["host"])
    built = build_collectors(b, "start")
    assert [type(c) for c in built] == [HostCollector, HostThrottleWatch]
    assert find(built, HostThrottleWatch) is built[1]
    assert find(built, EngineCollector) is None
    b = _build(tmp_path / "2", ["engine"])
    assert build_collectors(b, "start") == [b.engine_collector]


def test_engine_time_collectors_need_their_signal(tmp_path: Path) -> None:
    b = _build(tmp_path, ["engine", "allocator", "metrics"])
    b.info = _info("c1", signals=("metrics",))
    names = [c.name for c in build_collectors(b, "engine")]
    # The profile comes with `engine`; /metrics is offered; the allocator RPC is not: not built.
    assert names == ["spec_profile", "vllm_metrics"]


def test_a_rebuilt_engine_retags_and_a_new_draft_setting_restarts_drift() -> None:
    drift = AcceptanceDrift(DriftSettings(1.0, 1.0, 0.1, 1))
    collector = EngineCollector(active=True, drift=drift)
    profile = SpecProfile()
    resets: list[bool] = []
    drift.reset = lambda: resets.append(True)  # type: ignore[method-assign]
    for listener in (collector, profile):
        assert isinstance(listener, EngineListener)
    collector.engine_started(_info("a", spec=3))
    profile.engine_started(_info("a", spec=3))
    assert (collector.config_id, profile.config_id, collector.cudagraphs, resets) == ("a", "a", True, [])
    collector.engine_started(_info("b", spec=3))  # same draft setting: the same baseline holds
    assert (collector.config_id, resets) == ("b", [])
    collector.engine_started(_info("c", spec=1))
    assert (collector.config_id, resets) == ("c", [True])


def test_the_controller_sees_no_engine_between_engines_instead_of_an_error(tmp_path: Path) -> None:
    # Measured on an H200: while an engine restarted, every control tick raised "engine not started".
    from soakd.wiring import make_controller

    b = _build(tmp_path, ["engine"])
    cfg = Config.model_validate({"control": {"enabled": True}, "telemetry": {"collectors": ["engine"]}})
    drift = AcceptanceDrift(DriftSettings(60.0, 60.0, 0.1, 100))
    lever = choose_lever(cfg, tmp_path)
    controller = make_controller(
        cfg, tmp_path, lever, b.engine, [], b.engine_collector, drift, b.live, b.writer
    )
    assert controller is not None
    assert b.engine.alive() and controller.inputs.engine() is None  # supervised, no engine yet


def test_no_gpu_is_written_down_for_meta_json(tmp_path: Path, monkeypatch: typing.Any) -> None:
    from soakd.collectors import registry
    from soakd.collectors.gpu import GpuProbe

    monkeypatch.setattr(registry, "probe_nvml", lambda: GpuProbe(0, reason="NVML Shared Library Not Found"))
    b = _build(tmp_path, ["gpu"])
    assert build_collectors(b, "start") == []
    # The report then says what is true of this run, not "runs before soakd wrote them".
    assert b.gpu_meta == {"source": "none", "reason": "NVML Shared Library Not Found", "devices": []}


def test_advice_only_runs_the_scheduler_class_control_would_run(tmp_path: Path) -> None:
    from soakd.engine.vllm_local import SCHEDULER_CLS
    from soakd.wiring import engine_config

    def chosen(control: dict[str, typing.Any], **engine: typing.Any) -> tuple[Lever, str]:
        cfg = Config.model_validate({"engine": {"kind": "vllm-local", **engine}, "control": control})
        lever = choose_lever(cfg, tmp_path)
        return lever, engine_config(cfg, lever, 0.0).scheduler_cls

    # The A/B of control against advice-only compares policies on one engine: both arms run the class.
    for control in ({"enabled": True, "dry_run": True}, {"enabled": True}):
        lever, cls = chosen(control)
        assert cls == SCHEDULER_CLS and lever.kind == "scheduler"
        assert lever.limit_file == tmp_path / "active-seqs"
    # Without control, or with a lever that never moves vLLM's limit, vLLM's own scheduler.
    assert chosen({"enabled": False}) == (Lever("scheduler"), "")
    assert chosen({"enabled": True, "batch": {"lever": "admission"}}) == (Lever("admission"), "")
    assert chosen({"enabled": True, "batch": {"lever": "rebuild"}}) == (Lever("rebuild"), "")


def test_the_scheduler_lever_degrades_to_the_gate_where_the_engine_cannot_run_the_class(
    tmp_path: Path,
) -> None:
    from soakd.engine.vllm_local import SCHEDULER_CLS
    from soakd.wiring import engine_config

    def chosen(**engine: typing.Any) -> tuple[Lever, str]:
        cfg = Config.model_validate({"engine": engine, "control": {"enabled": True}})
        lever = choose_lever(cfg, tmp_path)
        return lever, engine_config(cfg, lever, 0.0).scheduler_cls

    # A server soakd attaches to, or a scheduler class of the config's own: the admission gate alone,
    # the reason kept (the controller's summary gives it), the engine's class left as configured.
    lever, cls = chosen(kind="openai", url="http://127.0.0.1:1")
    assert (lever.kind, lever.limit_file, cls) == ("admission", None, "")
    assert "OpenAI-compatible server" in lever.note
    lever, cls = chosen(scheduler_cls="my.Scheduler")
    assert (lever.kind, lever.limit_file, cls) == ("admission", None, "my.Scheduler")
    assert "my.Scheduler" in lever.note
    # Naming soakd's own class is no reason to lose its live limit.
    lever, cls = chosen(scheduler_cls=SCHEDULER_CLS)
    assert (lever.kind, lever.limit_file, cls) == ("scheduler", tmp_path / "active-seqs", SCHEDULER_CLS)


async def test_the_engine_starts_beside_the_later_parts_and_a_start_nobody_awaited_is_cut_short(
    tmp_path: Path,
) -> None:
    """The engine's start (minutes on a GPU) runs while the parts after it start (the scheduler, whose
    watchdog must keep pinging meanwhile); when the stack stops before the start was awaited (a later
    part failed), the start is cancelled, and no engine is left to stop."""
    from soakd.collectors.runner import CollectorRunner
    from soakd.lifecycle import Part, Stack
    from soakd.parts import EnginePart
    from soakd.testing import StubEngine

    started, cancelled = asyncio.Event(), asyncio.Event()

    class SlowStart(StubEngine):
        async def start(self) -> None:
            started.set()
            try:
                await asyncio.Event().wait()  # an engine that would take for ever to load
            except asyncio.CancelledError:
                cancelled.set()
                raise

    b = _build(tmp_path, [])
    drift = AcceptanceDrift(DriftSettings(60.0, 60.0, 0.1, 100))
    b.engine = EngineSupervisor(
        lambda _: SlowStart(b.engine_collector), b.cfg.engine, on_event=lambda *a, **k: None
    )
    part = EnginePart(b.engine, b, drift, CollectorRunner([], b.writer))

    async def later_start() -> None:
        await asyncio.wait_for(started.wait(), 10)  # the engine's start is under way meanwhile
        raise RuntimeError("a later part failed to start")

    stack = Stack("run", [part, Part("later", start=later_start)])
    with pytest.raises(RuntimeError, match="a later part"):
        await stack.start()
    assert b.live.phase == "engine_start" and cancelled.is_set()
    assert not part.started and not b.live.engine_started and stack.stop_failures == {}


async def test_a_failed_engine_start_is_recorded_in_the_live_run_not_raised(tmp_path: Path) -> None:
    from soakd.collectors.runner import CollectorRunner
    from soakd.errors import EngineError
    from soakd.parts import EnginePart
    from soakd.testing import StubEngine

    class NoMemory(StubEngine):
        async def start(self) -> None:
            raise EngineError("no GPU memory left")

    b = _build(tmp_path, [])
    drift = AcceptanceDrift(DriftSettings(60.0, 60.0, 0.1, 100))
    events: list[str] = []
    b.engine = EngineSupervisor(
        lambda _: NoMemory(b.engine_collector),
        b.cfg.engine,
        on_event=lambda kind, *a, **k: events.append(kind),
    )
    part = EnginePart(b.engine, b, drift, CollectorRunner([], b.writer))
    await part.start()
    assert await part.ready() is None
    assert b.live.error.startswith("engine did not start: ") and "no GPU memory left" in b.live.error
    assert not part.started
    await part.stop()  # nothing started: nothing to stop
