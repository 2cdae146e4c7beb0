"""Split a server-sent-events byte stream into events, as OpenAI-compatible servers stream responses."""

from __future__ import annotations

import re
from dataclasses import dataclass

# An event ends at a blank line; servers end lines with \n or \r\n.
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_DATA = b"data:"


@dataclass(frozen=True, slots=True)
class Event:
    """One event: its bytes as received (to pass on unchanged) and its `data` payload."""

    raw: bytes
    """The event including its terminating blank line."""
    data: bytes | None
    """The `data:` lines joined with newlines; None when the event has none (a comment, a keep-alive)."""


class EventSplitter:
    """Feed it the body in chunks of any size; it hands back each event once it is complete."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Event]:
        self._buf += chunk
        events: list[Event] = []
        start = 0
        while True:
            match = _EVENT_END.search(self._buf, start)
            if match is None:
                break
            events.append(_event(self._buf[start : match.end()]))
            start = match.end()
        self._buf = self._buf[start:]
        return events

    def close(self) -> list[Event]:
        """The unterminated rest, if any, as a last event (a server that closed without a blank line)."""
        rest, self._buf = self._buf, b""
        return [_event(rest)] if rest.strip() else []


def _event(raw: bytes) -> Event:
    parts: list[bytes] = []
    for line in raw.splitlines():
        if line.startswith(_DATA):
            value = line[len(_DATA) :]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return Event(raw=raw, data=b"\n".join(parts) if parts else None)


def event_data(raw: bytes) -> bytes | None:
    """The stripped `data` payload of one whole event (its bytes as sent); None when it has none."""
    data = _event(raw).data
    return data.strip() if data is not None else None


class DataSplitter:
    """The `data` payloads of a stream's events, stripped, without keeping the events' bytes (a reader
    that only needs what the events say: the completion client's per-delta path). Events without data
    (comments, keep-alives) and empty payloads are skipped."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        # The common case, one whole event per network chunk, skips the search loop's bookkeeping.
        end = buf.find(b"\n\n")
        if end == len(buf) - 2 and b"\r" not in buf and buf.startswith(_DATA) and b"\n" not in buf[:end]:
            self._buf = b""
            only = buf[len(_DATA) : end].strip()
            return [only] if only else []
        out: list[bytes] = []
        start = 0
        while (match := _EVENT_END.search(buf, start)) is not None:
            data = _event(buf[start : match.end()]).data
            if data is not None and data.strip():
                out.append(data.strip())
            start = match.end()
        self._buf = buf[start:]
        return out
