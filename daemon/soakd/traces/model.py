"""What a trace is once read: the request and summary types, and the field checks every reader shares.

Each trace format (native, Mooncake, synthetic) turns its rows into `RequestSpec`s; the checks here make
every format fail the same way, with a `TraceError` naming file, 1-based line and field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from soakd.errors import TraceError


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a trace: when it arrives, how long its prompt and answer are, what prefix it shares."""

    index: int  # 0-based position in the trace file (row order)
    arrival_s: float  # seconds from the trace's first request (first request = 0.0)
    input_tokens: int  # >= 1
    output_tokens: int  # >= 1
    block_size: int  # tokens per prefix block in hash_ids
    # Prefix block ids; equal ids across requests = shared prefix. Empty: content unique to the request.
    hash_ids: tuple[int, ...] = ()
    session: str = ""  # multi-turn session id ("" = none)
    turn: int = 0
    line: int = 0  # 1-based source line, for messages


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """What a whole trace holds, computed in the validating pass before a run starts."""

    path: str
    format: str
    sha256: str  # of the file bytes; for a synthetic trace, of its native serialization
    requests: int
    span_s: float  # arrival of the last request
    input_tokens: int  # total
    output_tokens: int  # total
    block_size: int
    unique_blocks: int
    block_reuse_ratio: float  # 1 - unique_blocks / total_blocks (0 when no blocks)


def show_number(x: float) -> str:
    """A number as written in the file: 3600000 rather than 3.6e+06, 1.25 as 1.25."""
    return str(int(x)) if x.is_integer() else repr(x)


def blocks_needed(input_tokens: int, block_size: int) -> int:
    """How many prefix blocks a prompt of `input_tokens` spans (the last one may be partial)."""
    return -(-input_tokens // block_size)


class RowReader:
    """Typed access to the fields of one JSON row; each failure is a TraceError naming file, line and key."""

    __slots__ = ("file", "line", "row")

    def __init__(self, row: dict[str, Any], file: str, line: int) -> None:
        self.row = row
        self.file = file
        self.line = line

    def error(self, reason: str, key: str | None = None) -> TraceError:
        return TraceError(reason, file=self.file, line=self.line, key=key)

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.row:
            if required:
                raise self.error("missing field", key)
            return None
        return self.row[key]

    def integer(self, key: str, *, minimum: int | None = None, default: int | None = None) -> int:
        if key not in self.row:
            if default is None:
                raise self.error("missing field", key)
            return default
        value = self.row[key]
        # bool is an int subclass in Python; `true` is never a token count.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"expected an integer, got {_json_type(value)}", key)
        if minimum is not None and value < minimum:
            raise self.error(f"must be >= {minimum}, got {value}", key)
        return value

    def number(self, key: str, *, minimum: float | None = None) -> float:
        value = self._get(key, required=True)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"expected a number, got {_json_type(value)}", key)
        # Python's json accepts NaN and Infinity, which would break every ordering check downstream.
        if not math.isfinite(value):
            raise self.error(f"expected a finite number, got {value}", key)
        if minimum is not None and value < minimum:
            raise self.error(f"must be >= {minimum:g}, got {value}", key)
        return float(value)

    def string(self, key: str, *, default: str) -> str:
        value = self._get(key, required=False)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(f"expected a string, got {_json_type(value)}", key)
        return value

    def hash_ids(self, key: str, *, input_tokens: int, input_key: str, block_size: int) -> tuple[int, ...]:
        """Block ids covering the prompt exactly; absent or [] means the prompt shares nothing."""
        value = self._get(key, required=False)
        if value is None:
            return ()
        if not isinstance(value, list):
            raise self.error(f"expected a list of integers, got {_json_type(value)}", key)
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                raise self.error(f"expected a list of integers, found {_json_type(item)}", key)
            if item < 0:
                raise self.error(f"block ids must be >= 0, found {item}", key)
        if value:
            needed = blocks_needed(input_tokens, block_size)
            if len(value) != needed:
                raise self.error(
                    f"has {len(value)} block ids but {input_key}={input_tokens} needs "
                    f"ceil({input_tokens}/{block_size}) = {needed}",
                    key,
                )
        return tuple(value)


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return f"number {value!r}"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
