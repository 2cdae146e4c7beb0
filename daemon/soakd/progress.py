"""The live progress bar of an interactive run: elapsed of planned time, requests done/failed, tokens/s.

While the bar is drawn, sys.stderr is a stream that lifts the bar off the terminal line before anything
else is written there (structlog's lines, the stdlib's through soakd's handler) and draws it again
after, so a log line never lands in the middle of the bar. The live tokens/s is the rate since the last
redraw ("now"); the bar's last figure is the run's average, the summary's own figure.
"""

from __future__ import annotations

import sys
from typing import Any, Never, TextIO

from tqdm import tqdm

from soakd.replay.runner import ReplayStats


def summary_requests(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary.json's request counts: the whole run's (across resumed processes), or, in summaries
    written before it had them, the replayer's."""
    req: dict[str, Any] = summary.get("requests") or summary["replay"]
    return req


def summary_tokens_per_s(summary: dict[str, Any]) -> float:
    """Output tokens per second of the whole run, as the closing summary prints it: the run's output
    tokens over its `ran_s`."""
    return float(summary_requests(summary)["output_tokens"]) / max(float(summary["ran_s"]), 1e-9)


class _BarClearing:
    """A text stream over `out` that clears `bar` before each whole line written and redraws it after.
    A line comes in pieces (print writes the text, then the newline): the pieces wait for their
    newline, or the bar would be drawn after the text and cleared, with it, by the next piece."""

    def __init__(self, out: TextIO, bar: tqdm[Never]) -> None:
        self._out = out
        self._bar = bar
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        cut = self._pending.rfind("\n") + 1
        if cut:
            lines, self._pending = self._pending[:cut], self._pending[cut:]
            self._bar.clear()
            self._out.write(lines)
            self._out.flush()
            self._bar.refresh()
        return len(text)

    def flush(self) -> None:
        # A partial line stays pending until its newline (or until the bar goes): see above.
        self._out.flush()

    def drain(self) -> None:
        """Write what is pending (the bar is gone or going)."""
        if self._pending:
            self._out.write(self._pending)
            self._pending = ""
        self._out.flush()

    def __getattr__(self, name: str) -> Any:
        # fileno, isatty, encoding, flush ...: the real stream's.
        return getattr(self._out, name)


class Progress:
    """A tqdm bar on stderr over the planned duration; does nothing when disabled (not a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self._bar: tqdm[Never] | None = None
        self._enabled = enabled
        self._last_tokens = 0
        self._last_elapsed = 0.0
        self._out: TextIO | None = None

    def update(self, elapsed: float, planned: float, stats: ReplayStats) -> None:
        if not self._enabled:
            return
        bar = self._bar
        if bar is None:
            self._out = sys.stderr
            bar = self._bar = tqdm(
                total=round(planned),
                unit="s",
                file=self._out,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}",
                dynamic_ncols=True,
            )
            sys.stderr = _BarClearing(self._out, bar)
        dt = elapsed - self._last_elapsed
        rate = (stats.output_tokens - self._last_tokens) / dt if dt > 0 else 0.0
        self._last_tokens, self._last_elapsed = stats.output_tokens, elapsed
        bar.n = min(elapsed, planned)
        bar.set_postfix_str(f"{self._counts(stats)} now {rate:.0f} tok/s", refresh=False)
        bar.refresh()

    @staticmethod
    def _counts(stats: ReplayStats) -> str:
        return (
            f"done {stats.completed} failed {stats.failed + stats.shed} "
            f"in-flight {stats.dispatched - stats.completed - stats.failed - stats.incomplete}"
            + (f" left {stats.incomplete}" if stats.incomplete else "")
        )

    def finish(self, summary: dict[str, Any]) -> None:
        """The bar's last state: the run's average tokens/s, the figure the summary prints, then closed."""
        if self._bar is not None:
            req = summary_requests(summary)
            counts = f"done {req['completed']} failed {req['failed'] + req['shed']}" + (
                f" left {req['incomplete']}" if req.get("incomplete") else ""
            )
            self._bar.set_postfix_str(
                f"{counts} run average {summary_tokens_per_s(summary):.1f} tok/s", refresh=False
            )
            self._bar.refresh()
        self.close()

    def close(self) -> None:
        if self._bar is None:
            return
        self._bar.close()
        if isinstance(sys.stderr, _BarClearing):
            sys.stderr.drain()
            sys.stderr = self._out
        self._bar = None
