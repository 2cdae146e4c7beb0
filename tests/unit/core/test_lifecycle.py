"""The Stack: start in order, stop in reverse, a failed start unwinds, every stop runs and is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import structlog

from soakd.lifecycle import Part, Stack


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def part(
        self,
        name: str,
        *,
        fail_start: bool = False,
        fail_stop: bool = False,
        hang_stop: bool = False,
        timeout: float = 5.0,
        summary: Mapping[str, Any] | None = None,
    ) -> Part:
        async def start() -> None:
            self.calls.append(f"start {name}")
            if fail_start:
                raise RuntimeError(f"{name} refused")

        async def stop() -> None:
            self.calls.append(f"stop {name}")
            if fail_stop:
                raise OSError(f"{name} disk full")
            if hang_stop:
                await asyncio.sleep(3600)

        return Part(
            name, start=start, stop=stop, summary=(lambda: summary) if summary is not None else None,
            stop_timeout_s=timeout,
        )  # fmt: skip


async def test_starts_in_order_and_stops_in_reverse() -> None:
    rec = Recorder()
    stack = Stack("run", [rec.part("a"), rec.part("b"), rec.part("c")])
    async with stack:
        assert stack.started == ["a", "b", "c"]
        rec.calls.append("body")
    assert rec.calls == ["start a", "start b", "start c", "body", "stop c", "stop b", "stop a"]
    assert stack.started == []


async def test_a_failed_start_stops_what_started_and_raises() -> None:
    rec = Recorder()
    stack = Stack("run", [rec.part("a"), rec.part("b"), rec.part("c", fail_start=True), rec.part("d")])
    with pytest.raises(RuntimeError, match="c refused"):
        async with stack:
            rec.calls.append("body")
    # c's start ran and failed: c is not stopped (it never started), d never starts, the body never runs.
    assert rec.calls == ["start a", "start b", "start c", "stop b", "stop a"]


async def test_every_stop_runs_whatever_one_raises_or_how_long_it_hangs() -> None:
    rec = Recorder()
    stack = Stack(
        "run",
        [
            rec.part("a"),
            rec.part("b", fail_stop=True),
            rec.part("c", hang_stop=True, timeout=0.05),
            rec.part("d"),
        ],
    )
    with structlog.testing.capture_logs() as logs:
        async with stack:
            pass
    assert rec.calls[-4:] == ["stop d", "stop c", "stop b", "stop a"]
    assert set(stack.stop_failures) == {"b", "c"}
    assert "disk full" in stack.stop_failures["b"]
    assert "0.05" in stack.stop_failures["c"]
    failed = [e for e in logs if e["event"] == "part_stop_failed"]
    assert [e["part"] for e in failed] == ["c", "b"]


async def test_the_body_raising_still_stops_everything() -> None:
    rec = Recorder()
    with pytest.raises(ValueError, match="bug"):
        async with Stack("run", [rec.part("a"), rec.part("b")]):
            raise ValueError("bug")
    assert rec.calls[-2:] == ["stop b", "stop a"]


async def test_summaries_merge_and_a_failing_summary_is_left_out() -> None:
    def broken() -> Mapping[str, Any]:
        raise KeyError("gone")

    parts = [
        Part("spool", summary=lambda: {"spool": {"lines": 3}}),
        Part("engine", summary=lambda: {"engine_steps": 7, "spec_decode": None}),
        Part("broken", summary=broken),
    ]
    stack = Stack("run", parts)
    async with stack:
        pass
    assert stack.summaries() == {"spool": {"lines": 3}, "engine_steps": 7, "spec_decode": None}


async def test_repeated_names_and_repeated_summary_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="repeat"):
        Stack("run", [Part("a"), Part("a")])
    stack = Stack("run", [Part("a", summary=lambda: {"x": 1}), Part("b", summary=lambda: {"x": 2})])
    with pytest.raises(ValueError, match="repeats summary keys"):
        stack.summaries()


async def test_sync_callables_are_parts_too() -> None:
    seen: list[str] = []
    async with Stack("run", [Part("s", start=lambda: seen.append("up"), stop=lambda: seen.append("down"))]):
        assert seen == ["up"]
    assert seen == ["up", "down"]
