"""Whose code held soakd's event loop while it was stalled: soakd's own, the in-process engine's, or
neither (the interpreter, the OS).

The loop watch says how late the loop ran; with `engine.kind = "vllm-local"` vLLM's front end shares
that loop, and a lag alone cannot say whether soakd or the engine is to blame (a busy 2-core machine
logged 6.5-7.2 s stalls in a 100-minute soak). A watchdog thread looks at the loop's heartbeat every
`sample_s`; while the heartbeat is late it samples the loop thread's Python stack
(`sys._current_frames`) and charges the time since its last look to the owner of the innermost frame
that belongs to anyone: vLLM and the libraries it runs on (torch, zmq, transformers, triton,
tokenizers) are the engine, soakd's package is soakd, a stack of neither (the loop waiting for the
interpreter lock, or not scheduled at all) is "other". The same look names the function that frame
is in (`places`: "soakd replay/runner.py:_send" seconds), so a stall charged to soakd says which of
its calls to mend. Between stalls it only compares two clocks.
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
    return culprit(frame, soakd_dir)[0]


def culprit(frame: FrameType | None, soakd_dir: str = _SOAKD) -> tuple[str, str]:
    """(owner, place) of the innermost owned frame of `frame`'s stack; the place is the file (under
    soakd's package, or from the engine library's folder on) and the function, "" for "other"."""
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if (hit := _ENGINE.search(name)) is not None:
            return "engine", f"{name[hit.start() + 1 :]}:{code.co_name}"
        if name.startswith(soakd_dir):
            return "soakd", f"{name[len(soakd_dir) + 1 :]}:{code.co_name}"
        frame = frame.f_back
    return "other", ""


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
        self.places: dict[str, float] = {}
        """Stall seconds by "owner place" (soakd's and the engine's functions), over the run."""
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
                owner, place = culprit(frame)
                self.charge(owner, now - max(last, beat + self._beat_s), place)
            last = now

    def charge(self, owner: str, seconds: float, place: str = "") -> None:
        with self._lock:
            self.total_s[owner] += seconds
            self._since_take[owner] += seconds
            if place:
                key = f"{owner} {place}"
                self.places[key] = self.places.get(key, 0.0) + seconds

    def top(self, n: int = 5) -> dict[str, float]:
        """The `n` places that held the loop longest, with their seconds (rounded to ms)."""
        with self._lock:
            ranked = sorted(self.places.items(), key=lambda kv: -kv[1])[:n]
        return {place: round(seconds, 3) for place, seconds in ranked}

    def take(self) -> dict[str, float]:
        """Stall seconds by owner since the last take."""
        with self._lock:
            out, self._since_take = self._since_take, dict.fromkeys(OWNERS, 0.0)
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
