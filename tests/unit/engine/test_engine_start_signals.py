"""The in-process engine's construction thread: the terminal's signals blocked in it (so in every process
vLLM starts from it), and a start given up mid-way leaves no engine running, whichever side sees it built
second."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

import pytest

from soakd.engine import vllm_local
from soakd.engine.vllm_local import TERMINAL_SIGNALS, _construct


class Built:
    def __init__(self) -> None:
        self.shut = threading.Event()
        self.mask: set[signal.Signals] = set()

    def shutdown(self) -> None:
        self.shut.set()


async def test_the_build_runs_with_the_terminals_signals_blocked() -> None:
    built = Built()

    def build() -> Built:
        built.mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return built

    assert await _construct(build, 10.0, set()) is built
    assert built.mask >= TERMINAL_SIGNALS
    assert not TERMINAL_SIGNALS & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # this thread keeps them


async def test_an_engine_built_after_its_start_was_given_up_is_shut_down_by_its_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stop came while the build was still in soakd's own process (config, tokenizer): no engine
    # process to kill yet; the build finishes after the start has been given up and the run has moved on.
    monkeypatch.setattr(vllm_local, "_KILL_WAIT_S", 0.05)
    built, release, entered = Built(), threading.Event(), threading.Event()

    def build() -> Built:
        entered.set()
        release.wait(10)
        return built

    task = asyncio.ensure_future(_construct(build, 60.0, set()))
    await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not built.shut.is_set()
    release.set()  # only now does the engine come up: its own thread shuts it down
    assert await asyncio.to_thread(built.shut.wait, 10)


async def test_an_engine_built_before_the_give_up_is_shut_down_once() -> None:
    calls: list[Any] = []

    class Once(Built):
        def shutdown(self) -> None:
            calls.append(1)
            super().shutdown()

    built = Once()
    task = asyncio.ensure_future(_construct(lambda: built, 60.0, set()))
    # Built at once; give up before the coroutine has seen it.
    await asyncio.to_thread(lambda: None)
    task.cancel()
    try:
        value = await task
    except asyncio.CancelledError:
        assert calls == [1]  # given up after it was built: shut down by the coroutine, once
    else:
        assert value is built and calls == []  # seen before the cancel: it is the caller's engine
