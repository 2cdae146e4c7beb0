"""Read and write soakd's own trace format (soakd-trace, version 1).

Format: JSONL, UTF-8, one JSON object per line; blank lines are skipped. The first line is a header:

    {"format": "soakd-trace", "version": 1, "block_size": 512}

- `format` (string, required): always "soakd-trace".
- `version` (integer, required): 1.
- `block_size` (integer >= 1, required): tokens per prefix block in the records' `hash_ids`.

Every following line is one request, in arrival order:

    {"t": 0.25, "input_tokens": 700, "output_tokens": 64, "hash_ids": [0, 17], "session": "c1", "turn": 2}

- `t` (number >= 0, required): arrival, in seconds from the start of the trace. It must never decrease
  from one record to the next; replay times requests from the first one's `t`, so the first request
  is sent at once whatever its `t`.
- `input_tokens` (integer >= 1, required): prompt length; at most 2**25 (MAX_TOKENS), as every token count.
- `output_tokens` (integer >= 1, required): tokens to generate (at most 2**25).
- `hash_ids` (array of integers >= 0, optional): one id per `block_size` tokens of the prompt, so its
  length is exactly ceil(input_tokens / block_size); the last block may be partial. Requests with equal
  ids at the same position share that block's content, hence a prefix the engine can cache. Left out
  (or []): the prompt shares nothing with other requests.
- `session` (string, optional, default ""): multi-turn conversation id.
- `turn` (integer >= 0, optional, default 0): turn within the session.
- `images` (integer >= 0, optional): images attached to the request; kept as metadata.
- `sampling` (object of numbers or booleans, optional): the request's recorded sampling parameters,
  e.g. {"temperature": 0.7, "top_p": 0.9}; replay uses temperature and top_p when present. Those vLLM
  knows are bounded as vLLM takes them (SAMPLING_BOUNDS: temperature in [0, 2], top_p in (0, 1], ...).
- `api` (string, optional): "completions" or "chat", as recorded; metadata.
- `prompt` (string or array, optional): the recorded prompt text (only with `trace record
  --record-prompts`); metadata, never replayed or logged.

Any other key in a record or in the header is an error naming the key, so a typo never passes silently.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from soakd.config import MAX_BLOCK_SIZE
from soakd.errors import TraceError
from soakd.traces.model import MAX_TOKENS, RequestSpec, Row, RowReader, Skip, blocks_needed

FORMAT_NAME = "soakd-trace"
VERSION = 1

_HEADER_KEYS = frozenset({"format", "version", "block_size"})
_RECORD_KEYS = frozenset(
    {
        "t",
        "input_tokens",
        "output_tokens",
        "hash_ids",
        "session",
        "turn",
        "images",
        "sampling",
        "api",
        "prompt",
    }
)
NAME = "native"
TIME_KEY = "t"


def is_header(row: dict[str, Any]) -> bool:
    """Whether a first JSON row claims to be a native header (auto-detection)."""
    return "format" in row


def read(rows: Iterable[tuple[int, dict[str, Any]]], file: str) -> Iterator[Row | TraceError | Skip]:
    """A Row per record of a native file, or the TraceError of a bad record; a bad header is raised."""
    it = iter(rows)
    first = next(it, None)
    if first is None:
        return
    block_size = _parse_header(RowReader(first[1], file, first[0]))
    for line, obj in it:
        r = RowReader(obj, file, line)
        try:
            yield _row(r, obj, block_size)
        except TraceError as err:
            yield err


def _row(r: RowReader, obj: dict[str, Any], block_size: int) -> Row:
    for key in obj:
        if key not in _RECORD_KEYS:
            raise r.error(f"unknown field (expected {', '.join(sorted(_RECORD_KEYS))})", key)
    if "prompt" in obj and not isinstance(obj["prompt"], str | list):
        raise r.error("expected a string or an array", "prompt")
    r.string("api", default="")
    input_tokens = r.tokens("input_tokens")
    return Row(
        line=r.line,
        t_s=r.number("t", minimum=0),
        input_tokens=input_tokens,
        output_tokens=r.tokens("output_tokens"),
        block_size=block_size,
        hash_ids=r.hash_ids(
            "hash_ids", input_tokens=input_tokens, input_key="input_tokens", block_size=block_size
        ),
        session=r.string("session", default=""),
        turn=r.integer("turn", minimum=0, default=0),
        images=r.integer("images", minimum=0, default=0),
        sampling=_sampling(r),
    )


def _sampling(r: RowReader) -> tuple[tuple[str, float], ...]:
    value = r.row.get("sampling")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise r.error("expected an object of sampling parameters", "sampling")
    out: list[tuple[str, float]] = []
    for name, v in value.items():
        if not isinstance(v, int | float) or (isinstance(v, float) and not math.isfinite(v)):
            raise r.error(f"expected a number or boolean, got {v!r:.40}", f"sampling.{name}")
        try:
            number = float(v)
        except OverflowError:  # an integer beyond float range
            raise r.error(f"expected a finite number, got {str(v)[:40]}...", f"sampling.{name}") from None
        bounds = SAMPLING_BOUNDS.get(name)
        if bounds is not None:
            _check_sampling(r, name, v, number, bounds)
        out.append((str(name), number))
    return tuple(out)


# The sampling parameters vLLM knows, bounded as its SamplingParams accepts them (_verify_args): a
# recorded value vLLM would refuse (temperature -5, top_p 1e308) is a trace error naming the row, not a
# request failing at replay. (low, low inclusive, high, high inclusive, integer); None: unbounded.
_Bounds = tuple[float | None, bool, float | None, bool, bool]
SAMPLING_BOUNDS: dict[str, _Bounds] = {
    "temperature": (0.0, True, 2.0, True, False),
    "top_p": (0.0, False, 1.0, True, False),
    "top_k": (-1.0, True, None, True, True),  # -1 (and 0): every token
    "min_p": (0.0, True, 1.0, True, False),
    "presence_penalty": (-2.0, True, 2.0, True, False),
    "frequency_penalty": (-2.0, True, 2.0, True, False),
    "repetition_penalty": (0.0, False, None, True, False),
    "max_tokens": (1.0, True, MAX_TOKENS, True, True),
    "min_tokens": (0.0, True, MAX_TOKENS, True, True),
    "seed": (None, True, None, True, True),
    "n": (1.0, True, None, True, True),
}


def _check_sampling(r: RowReader, name: str, raw: object, value: float, bounds: _Bounds) -> None:
    low, low_in, high, high_in, integer = bounds
    key = f"sampling.{name}"
    if isinstance(raw, bool):
        raise r.error(f"expected a number, got {raw!r}", key)
    if integer and not float(value).is_integer():
        raise r.error(f"expected an integer, got {value:g}", key)
    below = low is not None and (value < low if low_in else value <= low)
    above = high is not None and (value > high if high_in else value >= high)
    if below or above:
        lo = "" if low is None else ("[" if low_in else "(") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + ("]" if high_in else ")")
        where = f"{lo}, {hi}" if low is not None and high is not None else f">{'=' if low_in else ''} {low:g}"
        raise r.error(f"{value:g} is out of range (vLLM takes {where})", key)


def _parse_header(r: RowReader) -> int:
    """The block size from a header row, after checking it is a soakd-trace version 1 header."""
    if "format" not in r.row:
        raise r.error(
            f'expected the header {{"format": "{FORMAT_NAME}", "version": {VERSION}, ...}}', "format"
        )
    if r.row["format"] != FORMAT_NAME:
        raise r.error(f"expected {FORMAT_NAME!r}, got {r.row['format']!r}", "format")
    for key in r.row:
        if key not in _HEADER_KEYS:
            raise r.error("unknown header field (expected format, version, block_size)", key)
    version = r.integer("version")
    if version != VERSION:
        raise r.error(f"unsupported version {version} (this soakd reads version {VERSION})", "version")
    block_size = r.integer("block_size", minimum=1)
    if block_size > MAX_BLOCK_SIZE:
        raise r.error(f"must be <= {MAX_BLOCK_SIZE}, got {block_size}", "block_size")
    return block_size


def record(spec: RequestSpec) -> dict[str, Any]:
    """The native record of one spec; optional fields left at their defaults are left out."""
    row: dict[str, Any] = {
        "t": spec.arrival_s,
        "input_tokens": spec.input_tokens,
        "output_tokens": spec.output_tokens,
    }
    if spec.hash_ids:
        row["hash_ids"] = list(spec.hash_ids)
    if spec.session:
        row["session"] = spec.session
    if spec.turn:
        row["turn"] = spec.turn
    if spec.images:
        row["images"] = spec.images
    if spec.sampling:
        row["sampling"] = dict(spec.sampling)
    return row


def lines(specs: Iterable[RequestSpec], block_size: int) -> Iterator[str]:
    """The native serialization, line by line (each with its newline).

    Raises ValueError for specs the reader would reject (hash_ids not covering the prompt at
    `block_size`, arrivals going backwards), so a written file always reads back.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    yield _dumps({"format": FORMAT_NAME, "version": VERSION, "block_size": block_size})
    prev = 0.0
    for n, spec in enumerate(specs):
        if spec.hash_ids and len(spec.hash_ids) != blocks_needed(spec.input_tokens, block_size):
            raise ValueError(
                f"request {spec.index}: {len(spec.hash_ids)} hash_ids do not cover "
                f"{spec.input_tokens} tokens in blocks of {block_size}"
            )
        if n and spec.arrival_s < prev:
            raise ValueError(f"request {spec.index}: arrival goes backwards ({spec.arrival_s} < {prev})")
        prev = spec.arrival_s
        yield _dumps(record(spec))


def write_native(path: str | Path, specs: Iterable[RequestSpec], block_size: int) -> None:
    """Write specs as a native trace, atomically: readers see the old file or the whole new one."""
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.writelines(lines(specs, block_size))
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(target)
    except BaseException:
        # Leave no half-written temp file behind, whatever stopped us (a bad spec, a full disk, Ctrl-C).
        tmp.unlink(missing_ok=True)
        raise


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n"
