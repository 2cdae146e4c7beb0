"""The live progress bar of an interactive run: elapsed of planned time, requests done/failed, tokens/s."""

from __future__ import annotations

import sys
from typing import Never

from tqdm import tqdm

from soakd.replay.runner import ReplayStats


class Progress:
    """A tqdm bar on stderr over the planned duration; does nothing when disabled (not a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self._bar: tqdm[Never] | None = None
        self._enabled = enabled
        self._last_tokens = 0
        self._last_elapsed = 0.0

    def update(self, elapsed: float, planned: float, stats: ReplayStats) -> None:
        if not self._enabled:
            return
        bar = self._bar
        if bar is None:
            bar = self._bar = tqdm(
                total=round(planned),
                unit="s",
                file=sys.stderr,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}",
                dynamic_ncols=True,
            )
        dt = elapsed - self._last_elapsed
        rate = (stats.output_tokens - self._last_tokens) / dt if dt > 0 else 0.0
        self._last_tokens, self._last_elapsed = stats.output_tokens, elapsed
        bar.n = min(elapsed, planned)
        bar.set_postfix_str(
            f"done {stats.completed} failed {stats.failed + stats.shed} "
            f"in-flight {stats.dispatched - stats.completed - stats.failed} {rate:.0f} tok/s",
            refresh=False,
        )
        bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
