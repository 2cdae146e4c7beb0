"""Whose code held soakd's event loop while it was stalled: soakd's own, the in-process engine's, or
neither (the interpreter, the OS).

The loop watch says how late the loop ran; with `engine.kind = "vllm-local"` vLLM's front end shares
that loop, and a lag alone cannot say whether soakd or the engine is to blame (a busy 2-core machine
logged 6.5-7.2 s stalls in a 100-minute soak). A watchdog thread looks at the loop's heartbeat every
`sample_s`; while the heartbeat is late it samples the loop thread's Python stack
(`sys._current_frames`) and charges the time since its last look to the owner of the innermost frame
that belongs to anyone: vLLM and the libraries it runs on (torch, zmq, transformers, triton,
tokenizers) are the engine, soakd's package is soakd, a stack of neither (the loop waiting for the
interpreter lock, or not scheduled at all) is "other". Between stalls it only compares two clocks.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

OWNERS = ("soakd", "engine", "other")
_ENGINE = re.compile(r"[/\\](vllm|torch|zmq|transformers|triton|tokenizers)[/\\]")
_SOAKD = str(Path(__file__).resolve().parent)


def owner_of(frame: FrameType | None, soakd_dir: str = _SOAKD) -> str:
    """The owner of the innermost frame of `frame`'s stack that belongs to anyone (see the module)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if _ENGINE.search(name):
            return "engine"
        if name.startswith(soakd_dir):
            return "soakd"
        frame = frame.f_back
    return "other"


class StallBlame:
    """Charges a loop thread's stalls to their owners; `beat()` is called on the loop at least every
    `beat_s` while `beating()` says so, and a beat later than `beat_s + limit_s` is a stall (a stopped
    heartbeat is none)."""

    def __init__(
        self,
        beat_s: float,
        *,
        beating: Callable[[], bool] = lambda: True,
        limit_s: float = 0.1,
        sample_s: float = 0.05,
    ) -> None:
        self._beat_s = beat_s
        self._beating = beating
        self._late_after = beat_s + limit_s
        self._sample_s = sample_s
        self._beat: float | None = None
        self._loop_thread: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.total_s = dict.fromkeys(OWNERS, 0.0)
        self._since_take = dict.fromkeys(OWNERS, 0.0)

    def beat(self) -> None:
        """On the loop: it ran. The first beat starts the watchdog."""
        self._beat = time.monotonic()
        if self._thread is None:
            self._loop_thread = threading.get_ident()
            self._thread = threading.Thread(target=self._watch, name="soakd-loop-blame", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self._sample_s):
            now = time.monotonic()
            beat = self._beat
            if beat is not None and now - beat > self._late_after and self._beating():
                # Late from when the next beat was due (the lag's own origin), charged once per look.
                frame = sys._current_frames().get(self._loop_thread or 0)
                self.charge(owner_of(frame), now - max(last, beat + self._beat_s))
            last = now

    def charge(self, owner: str, seconds: float) -> None:
        with self._lock:
            self.total_s[owner] += seconds
            self._since_take[owner] += seconds

    def take(self) -> dict[str, float]:
        """Stall seconds by owner since the last take."""
        with self._lock:
            out, self._since_take = self._since_take, dict.fromkeys(OWNERS, 0.0)
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
