"""What a trace is once read: the request and summary types, and the field checks every reader shares.

Each trace format reader turns its rows into `Row`s (or a `TraceError` / `Skip` for a row it cannot
use); the loader turns rows into `RequestSpec`s. The checks here make every format fail the same way,
with a `TraceError` naming file, 1-based line and field.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any, AnyStr

from soakd.errors import TraceError

# The most tokens a trace may give one prompt or answer. The longest context any model offers is 10M
# tokens (Llama 4 Scout); 2**25 (~33.5M) leaves room to grow while bounding what one row can make the
# loader build: a session turn without block ids gets ceil(tokens / block_size) made-up block ids, so
# a count like 1e300 or 1e10 in a 20-byte row would otherwise overflow or exhaust memory.
MAX_TOKENS = 1 << 25
MAX_ROW_BYTES = 16 << 20
"""The longest row (line) a trace may have: a native row's `hash_ids` for a 10M-token prompt in blocks of
16 is ~6 MB. A longer line (a gzip bomb of zeros, a file without newlines) is refused on its line number
before it is held whole."""

_TOO_LONG = f"line longer than {MAX_ROW_BYTES >> 20} MiB: not a trace row"


def bounded_lines(fh: IO[AnyStr], file: str) -> Iterator[AnyStr]:
    """The lines of a stream (binary, or text for the CSV readers), each read with a bounded buffer; a
    line over MAX_ROW_BYTES (bytes or characters) is a TraceError naming its line."""
    number = 0
    while True:
        line = fh.readline(MAX_ROW_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_ROW_BYTES and line[-1:] not in ("\n", b"\n"):
            raise TraceError(_TOO_LONG, file=file, line=number)
        yield line


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
    images: int = 0  # images attached to the request (metadata: replay sends text tokens only)
    # Sampling parameters recorded with the request (name, value), e.g. (("temperature", 0.7),).
    sampling: tuple[tuple[str, float], ...] = ()
    copy: int = 0  # > 0: an extra copy made by rate scaling (its prompts are salted apart)


@dataclass(slots=True)
class Row:
    """One request as a format reader saw it, before the loader times, chains and numbers it."""

    line: int  # 1-based source line (0 when the format has no lines)
    t_s: float  # arrival in the file's own clock, seconds (any origin; the loader subtracts the first)
    input_tokens: int
    output_tokens: int
    block_size: int
    hash_ids: tuple[int, ...] = ()
    session: str = ""
    turn: int = 0
    images: int = 0
    sampling: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Skip:
    """A row the format itself says to leave out (e.g. a BurstGPT failure with 0 response tokens)."""

    line: int
    reason: str


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
    sessions: int = 0  # sessions with more than one request
    turns_max: int = 0  # most requests seen in one session
    bad_rows: int = 0  # rows left out by skip_bad_rows
    skipped_rows: dict[str, int] = field(default_factory=dict)  # rows the format leaves out, by reason
    sorted_on_read: bool = False  # the file's timestamps went backwards and were sorted on request
    token_counts: str = "recorded"  # "recorded", or how they were derived (estimated, tokenizer)
    transforms: dict[str, float] = field(default_factory=dict)  # window, rate scale (speed is replay's)


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

    def tokens(self, key: str, *, minimum: int = 1) -> int:
        """A token count: an integer from `minimum` to MAX_TOKENS."""
        value = self.integer(key, minimum=minimum)
        if value > MAX_TOKENS:
            raise self.error(too_many_tokens(value), key)
        return value

    def number(self, key: str, *, minimum: float | None = None) -> float:
        value = self._get(key, required=True)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"expected a number, got {_json_type(value)}", key)
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float range
            raise self.error(f"expected a finite number, got {str(value)[:40]}...", key) from None
        # Python's json accepts NaN and Infinity, which would break every ordering check downstream.
        if not math.isfinite(number):
            raise self.error(f"expected a finite number, got {value}", key)
        if minimum is not None and number < minimum:
            raise self.error(f"must be >= {minimum:g}, got {value}", key)
        return number

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


def too_many_tokens(got: object) -> str:
    """The reason a token count above MAX_TOKENS is refused, for every format alike."""
    shown = str(got)
    if len(shown) > 24:
        shown = f"{shown[:20]}..."
    return f"must be <= {MAX_TOKENS} (more tokens than any model's context), got {shown}"


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


class CsvRow:
    """Typed access to the cells of one CSV row by column name; failures are TraceErrors like RowReader's."""

    __slots__ = ("cells", "columns", "file", "line")

    def __init__(self, cells: list[str], columns: dict[str, int], file: str, line: int) -> None:
        self.cells = cells
        self.columns = columns
        self.file = file
        self.line = line

    def error(self, reason: str, key: str | None = None) -> TraceError:
        return TraceError(reason, file=self.file, line=self.line, key=key)

    def text(self, key: str) -> str:
        index = self.columns[key]
        if index >= len(self.cells):
            raise self.error(f"missing (the row has {len(self.cells)} columns)", key)
        return self.cells[index].strip()

    def optional(self, key: str) -> str:
        """The cell of an optional column ("" when the file has no such column)."""
        return self.text(key) if key in self.columns else ""

    def integer(self, key: str, *, minimum: int | None = None) -> int:
        raw = self.text(key)
        try:
            value = int(raw)
        except ValueError:
            # Some exports write counts as floats ("52.0"); a whole float is still a count.
            try:
                as_float = float(raw)
            except ValueError:
                raise self.error(f"expected an integer, got {raw[:40]!r}", key) from None
            if not as_float.is_integer():
                raise self.error(f"expected an integer, got {raw[:40]!r}", key) from None
            value = int(as_float)
        if minimum is not None and value < minimum:
            raise self.error(f"must be >= {minimum}, got {value}", key)
        return value

    def tokens(self, key: str, *, minimum: int = 1) -> int:
        """A token count: an integer from `minimum` to MAX_TOKENS."""
        value = self.integer(key, minimum=minimum)
        if value > MAX_TOKENS:
            raise self.error(too_many_tokens(self.text(key)), key)  # as written: 1e300, not 301 digits
        return value

    def number(self, key: str, *, minimum: float | None = None) -> float:
        raw = self.text(key)
        try:
            value = float(raw)
        except ValueError:
            raise self.error(f"expected a number, got {raw[:40]!r}", key) from None
        if not math.isfinite(value):
            raise self.error(f"expected a finite number, got {raw[:40]!r}", key)
        if minimum is not None and value < minimum:
            raise self.error(f"must be >= {minimum:g}, got {value:g}", key)
        return value


def csv_rows(
    text: IO[str], file: str, required: tuple[str, ...], layout: str
) -> tuple[dict[str, int], Iterator[tuple[int, CsvRow]]]:
    """Column positions from a CSV's header row, and (line, row) for each non-blank data row.

    A header missing a `required` column is raised as a TraceError on line 1 naming the `layout`
    expected. A file with no header at all has no rows.
    """
    reader = csv.reader(bounded_lines(text, file))
    header = next(reader, None)
    if header is None:
        return {}, iter(())
    columns = {name.strip(): i for i, name in enumerate(header)}
    missing = [name for name in required if name not in columns]
    if missing:
        raise TraceError(f"header lacks {', '.join(missing)} (expected {layout})", file=file, line=1)

    def rows() -> Iterator[tuple[int, CsvRow]]:
        for cells in reader:
            if not cells or (len(cells) == 1 and not cells[0].strip()):
                continue
            yield reader.line_num, CsvRow(cells, columns, file, reader.line_num)

    return columns, rows()


def json_lines(fh: IO[bytes], file: str) -> Iterator[tuple[int, dict[str, Any] | TraceError]]:
    """(1-based line, object) for each non-blank line, or the TraceError of a line that is not a JSON
    object (the caller decides whether that ends the read)."""
    for line, raw in enumerate(bounded_lines(fh, file), start=1):
        if not raw.strip():
            continue
        try:
            # utf-8-sig on the first line: editors on Windows like to start files with a BOM.
            text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
        except UnicodeDecodeError:
            yield line, TraceError("not UTF-8 text", file=file, line=line)
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            yield line, TraceError(f"not JSON: {err.msg} at column {err.colno}", file=file, line=line)
            continue
        except (ValueError, RecursionError) as err:  # a 4300+ digit integer; nesting too deep
            yield line, TraceError(f"not usable JSON: {str(err)[:80]}", file=file, line=line)
            continue
        if not isinstance(obj, dict):
            yield line, TraceError(f"expected a JSON object, got {type(obj).__name__}", file=file, line=line)
            continue
        yield line, obj
