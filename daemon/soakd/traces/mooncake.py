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

from soakd.traces.model import RequestSpec, RowReader, show_number

BLOCK_SIZE = 512
_FIELDS = ("timestamp", "input_length", "output_length")


def looks_like(row: dict[str, Any]) -> bool:
    """Whether a first JSON row has the Mooncake fields (auto-detection)."""
    return all(key in row for key in _FIELDS)


def parse(rows: Iterable[tuple[int, dict[str, Any]]], file: str) -> Iterator[RequestSpec]:
    """Specs from the (line, object) rows of a Mooncake file; raises TraceError on the first bad row."""
    first_ms = 0.0
    prev_ms = 0.0
    for index, (line, obj) in enumerate(rows):
        r = RowReader(obj, file, line)
        ms = r.number("timestamp")
        if index == 0:
            first_ms = ms
        elif ms < prev_ms:
            raise r.error(
                f"timestamp goes backwards ({show_number(ms)} < {show_number(prev_ms)})", "timestamp"
            )
        prev_ms = ms
        input_tokens = r.integer("input_length", minimum=1)
        yield RequestSpec(
            index=index,
            arrival_s=(ms - first_ms) / 1000.0,
            input_tokens=input_tokens,
            output_tokens=r.integer("output_length", minimum=1),
            block_size=BLOCK_SIZE,
            hash_ids=r.hash_ids(
                "hash_ids", input_tokens=input_tokens, input_key="input_length", block_size=BLOCK_SIZE
            ),
            line=line,
        )


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
