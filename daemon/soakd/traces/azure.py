"""Read the Azure LLM/LMM inference traces (Azure/AzurePublicDataset): 2023, 2024 and 2025 layouts.

Format: CSV with a header row; columns are found by name, so their order does not matter:

    TIMESTAMP,ContextTokens,GeneratedTokens                 (LLM 2023 and 2024)
    TIMESTAMP,NumImages,ContextTokens,GeneratedTokens       (LMM 2025)

- `TIMESTAMP`: a date and time, read as UTC when it carries no offset. All three releases' spellings:
  `2023-11-16 18:17:03.9799600` (naive, 7 fractional digits), `2024-05-10 00:00:00.009930+00:00`
  (offset, fraction of varying length or none), `2025-03-01T00:00:00.123Z` (ISO with Z).
- `ContextTokens` (>= 1): prompt tokens; `GeneratedTokens`: output tokens. A row with 0 generated tokens
  cannot be replayed as a fixed-length generation; it is counted and left out.
- `NumImages` (>= 0, LMM): kept as request metadata (`images`); the replayed prompt is text tokens only.

The 2024 files hold tens of millions of rows: the reader streams and keeps nothing per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO

from soakd.errors import TraceError
from soakd.traces.model import Row, Skip, csv_rows

NAME = "azure"
TIME_KEY = "TIMESTAMP"
_REQUIRED = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def looks_like(header: list[str]) -> bool:
    """Whether a CSV header row is an Azure trace's (auto-detection)."""
    names = {h.strip() for h in header}
    return all(name in names for name in _REQUIRED)


class TimestampParser:
    """Seconds since the epoch from the Azure timestamp spellings, fast for sorted rows.

    The date-time part to whole seconds is cached: consecutive rows mostly share it.
    """

    __slots__ = ("_last_epoch", "_last_head")

    def __init__(self) -> None:
        self._last_head = ""
        self._last_epoch = 0

    def __call__(self, text: str) -> float:
        if len(text) < 19 or text[10] not in " T":
            raise ValueError
        head = text[:19]
        if head != self._last_head:
            # fromisoformat takes "T" or " "; the tail (fraction, offset) is parsed below.
            self._last_epoch = int(datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp())
            self._last_head = head
        rest = text[19:]
        fraction = 0.0
        if rest.startswith("."):
            end = 1
            while end < len(rest) and rest[end].isdigit():
                end += 1
            if end == 1:
                raise ValueError
            fraction = float("0" + rest[:end])
            rest = rest[end:]
        return self._last_epoch + fraction - _offset_s(rest)


def _offset_s(text: str) -> int:
    """The UTC offset of a timestamp's tail ("", "Z", "+00:00", "-0530") in seconds."""
    if text in ("", "Z", "z"):
        return 0
    if text[0] not in "+-":
        raise ValueError
    digits = text[1:].replace(":", "")
    if len(digits) != 4 or not digits.isdigit() or int(digits[:2]) > 23 or int(digits[2:]) > 59:
        raise ValueError  # ISO 8601 offsets stop at 23:59 (real ones at 14:00)
    offset = int(digits[:2]) * 3600 + int(digits[2:]) * 60
    return offset if text[0] == "+" else -offset


def read(text: IO[str], file: str) -> Iterator[Row | TraceError | Skip]:
    """A Row per data row of an Azure CSV, or the TraceError of a bad row; a bad header is raised."""
    columns, rows = csv_rows(text, file, _REQUIRED, "TIMESTAMP,ContextTokens,GeneratedTokens[,NumImages]")
    parse_time = TimestampParser()
    has_images = "NumImages" in columns
    for line, r in rows:
        try:
            raw_time = r.text("TIMESTAMP")
            try:
                t = parse_time(raw_time)
            except ValueError:
                raise r.error(
                    f"not a date and time: {raw_time[:40]!r} "
                    "(expected YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM|Z])",
                    "TIMESTAMP",
                ) from None
            input_tokens = r.tokens("ContextTokens")
            output_tokens = r.tokens("GeneratedTokens", minimum=0)
            images = r.integer("NumImages", minimum=0) if has_images else 0
        except TraceError as err:
            yield err
            continue
        if output_tokens == 0:
            yield Skip(line, "0 generated tokens")
            continue
        yield Row(line, t, input_tokens, output_tokens, 0, images=images)
