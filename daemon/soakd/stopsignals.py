"""One stop-signal policy for the whole of `soakd run`, from its first line to its exit.

SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) all mean the same: stop promptly, write the
verdict of the work done (with the phase the signal came in), exit 4. One process-level handler is
installed before the config is read and stays until `soakd run` returns, so there is no moment at
which one of them is the default action (a death with no verdict) or a KeyboardInterrupt:

- before the run's event loop (the config, the trace, the run's setup): the signal is kept; the run then
  begins stopped, and its verdict says `stopped_in: "setup"`;
- while the loop runs: handed to the run (`Soak._on_signal`) on the loop, at once;
- after the loop (the verdict is written): kept, and the report, if one is being written, is cut short
  (KeyboardInterrupt inside `reporting()`); the exit code stays the one verdict.json records.

The handler is not asyncio's `add_signal_handler`: that one puts the default action back when the loop
closes, which left a window between the run's end and the report in which a SIGTERM killed soakd.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """The stop signals of one `soakd run`: `install()` first, `restore()` last."""

    def __init__(self) -> None:
        self.received: list[str] = []
        """Every stop signal's name, in order of arrival."""
        self._old: dict[signal.Signals, Any] = {}
        self._target: tuple[asyncio.AbstractEventLoop, Callable[[str], None], contextvars.Context] | None = (
            None
        )
        self._raise = False
        self._detached = False
        self.late: list[str] = []
        """The signals that came after the run's loop was detached (its verdict written)."""

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()

    def attach(self, loop: asyncio.AbstractEventLoop, on_signal: Callable[[str], None]) -> None:
        """Hand each later signal to `on_signal`, on `loop` (the run's), in the caller's context: a signal
        lands in whatever context the main thread is in (the loop's idle one, mostly), and the run's log
        keys (run_id: journald's RUN_ID) are bound in the run's."""
        self._target = (loop, on_signal, contextvars.copy_context())

    def detach(self) -> None:
        self._target = None
        self._detached = True

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """While the report is written: a stop signal raises KeyboardInterrupt in it."""
        self._raise = True
        try:
            yield
        finally:
            self._raise = False

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        target = self._target
        if target is not None:
            loop, on_signal, context = target
            try:
                # A Python-level handler runs in the main thread, the loop's, between two bytecodes:
                # scheduled, not called, so the run's state is never changed under the loop's feet.
                loop.call_soon_threadsafe(on_signal, name, context=context)
                return
            except RuntimeError:  # the loop is closed: the run is over
                self.detach()
        if self._detached:
            self.late.append(name)
        if self._raise:
            raise KeyboardInterrupt
