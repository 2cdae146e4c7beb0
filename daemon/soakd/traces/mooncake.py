"""Read traces in the Mooncake format (FAST'25, kvcache-ai/Mooncake FAST25-release/traces).

Format: JSONL, one request per line, in arrival order:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

- `timestamp` (number, milliseconds from the start of the trace; never decreasing).
- `input_length`, `output_length` (integers >= 1).
- `hash_ids` (integers >= 0): one id per 512-token block of the prompt, so its length is exactly
  ceil(input_length / 512); the last block is partial. Equal ids across requests = shared prefix.
  soakd also accepts a row without it (or with []): that prompt shares nothing.

A request arrives (timestamp - first timestamp) / 1000 seconds after the first one. Other keys are
ignored: this is someone else's format, and its files carry extra columns in some releases.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from soakd.errors import TraceError
from soakd.traces.model import RequestSpec, Row, RowReader, Skip

NAME = "mooncake"
BLOCK_SIZE = 512
TIME_KEY = "timestamp"
TIME_SCALE = 1000.0  # file units per second
_FIELDS = ("timestamp", "input_length", "output_length")


def looks_like(row: dict[str, Any]) -> bool:
    """Whether a first JSON row has the Mooncake fields (auto-detection)."""
    return all(key in row for key in _FIELDS) and "chat_id" not in row


def read(rows: Iterable[tuple[int, dict[str, Any]]], file: str) -> Iterator[Row | TraceError | Skip]:
    """A Row per (line, object) of a Mooncake file, or the TraceError of a bad row."""
    for line, obj in rows:
        r = RowReader(obj, file, line)
        try:
            ms = r.number("timestamp")
            input_tokens = r.tokens("input_length")
            output_tokens = r.tokens("output_length")
            hash_ids = r.hash_ids(
                "hash_ids", input_tokens=input_tokens, input_key="input_length", block_size=BLOCK_SIZE
            )
        except TraceError as err:
            yield err
            continue
        yield Row(line, ms / TIME_SCALE, input_tokens, output_tokens, BLOCK_SIZE, hash_ids)


def record(spec: RequestSpec) -> dict[str, Any]:
    """The Mooncake row of a spec (timestamp rounded to whole milliseconds)."""
    if spec.hash_ids and spec.block_size != BLOCK_SIZE:
        raise ValueError(
            f"request {spec.index}: Mooncake blocks are {BLOCK_SIZE} tokens, not {spec.block_size}"
        )
    return {
        "timestamp": round(spec.arrival_s * 1000.0),
        "input_length": spec.input_tokens,
        "output_length": spec.output_tokens,
        "hash_ids": list(spec.hash_ids),
    }
