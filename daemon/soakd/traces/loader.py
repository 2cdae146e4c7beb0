"""Open the trace a run replays: find it, detect its format, validate it whole and summarise it.

`open_trace` reads the whole file once, streaming, before the run starts, so a bad row fails the run
at start-up with file, line and field, never hours in. The `Trace` it returns re-reads the file on each
iteration instead of holding it, so memory stays flat however long the trace or the run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import IO, Any

from soakd.config import TraceConfig
from soakd.errors import TraceError
from soakd.traces import mooncake, native
from soakd.traces.model import RequestSpec, TraceSummary
from soakd.traces.synth import synthesize

DEMO_RESOURCE = "data/demo_trace.jsonl"
SYNTHETIC_PATH = "<synthetic>"

_Rows = Iterator[tuple[int, dict[str, Any]]]


class Trace:
    """A validated trace: its summary, and its requests in order, as often as they are iterated."""

    def __init__(self, summary: TraceSummary, specs: Callable[[], Iterator[RequestSpec]]) -> None:
        self.summary = summary
        self._specs = specs

    def __iter__(self) -> Iterator[RequestSpec]:
        return self._specs()

    def __repr__(self) -> str:
        s = self.summary
        return f"Trace({s.path!r}, format={s.format!r}, requests={s.requests})"


def open_trace(cfg: TraceConfig, resolve: Callable[[str], Path], seed: int) -> Trace:
    """Validate and summarise the trace `cfg` names; raises TraceError on the first bad row.

    `cfg.path == ""` is the bundled demo trace. `resolve` turns a configured path into a real one
    (relative to the config file). `seed` drives the synthetic format only.
    """
    if cfg.format == "synthetic":
        return _synthetic(cfg, seed)
    source: Traversable = resolve(cfg.path) if cfg.path else files("soakd").joinpath(DEMO_RESOURCE)
    name = str(source)
    stamp = _stamp(source, name)
    fmt = cfg.format if cfg.format != "auto" else _detect(source, name)
    digest = hashlib.sha256()
    tally = _Tally()
    for spec in _read(source, name, fmt, digest.update):
        tally.add(spec)
    if tally.requests == 0:
        raise TraceError("empty trace (no requests)", file=name)
    summary = tally.summary(name, fmt, digest.hexdigest())

    def specs() -> Iterator[RequestSpec]:
        # A run that loops re-reads the file for hours; if someone rewrites it meanwhile, the replay
        # would no longer be the trace that was validated and summarised.
        if _stamp(source, name) != stamp:
            raise TraceError("changed since it was validated; restart the run", file=name)
        return _read(source, name, fmt, None)

    return Trace(summary, specs)


def _synthetic(cfg: TraceConfig, seed: int) -> Trace:
    # Small by construction (rate x duration), so held in memory; hashed as its native serialization
    # so that equal synthetic traces have equal digests.
    specs = synthesize(cfg.synthetic, seed)
    block_size = cfg.synthetic.block_size
    digest = hashlib.sha256()
    for line in native.lines(specs, block_size):
        digest.update(line.encode("utf-8"))
    tally = _Tally()
    for spec in specs:
        tally.add(spec)
    summary = tally.summary(SYNTHETIC_PATH, "synthetic", digest.hexdigest())
    return Trace(summary, lambda: iter(specs))


def _stamp(source: Traversable, name: str) -> int | None:
    """Size of a file on disk (None for a resource that is not a plain path).

    Size, not modification time: a `touch` or an rsync of the same content must not end a night's run.
    """
    if not isinstance(source, Path):
        return None
    try:
        st = source.stat()
    except OSError as err:
        raise TraceError(f"cannot read: {err.strerror or err}", file=name) from None
    return st.st_size


def _open(source: Traversable, name: str) -> IO[bytes]:
    try:
        fh: IO[bytes] = source.open("rb")
    except OSError as err:
        raise TraceError(f"cannot read: {err.strerror or err}", file=name) from None
    return fh


def _detect(source: Traversable, name: str) -> str:
    """ "native" or "mooncake", from the first JSON row."""
    with _open(source, name) as fh:
        first = next(_rows(fh, name, None), None)
    if first is None:
        raise TraceError("empty trace (no requests)", file=name)
    line, row = first
    if native.is_header(row):
        return "native"
    if mooncake.looks_like(row):
        return "mooncake"
    raise TraceError(
        'cannot tell the format: expected a header {"format": "soakd-trace", ...} or the Mooncake fields '
        "timestamp, input_length, output_length (or set trace.format)",
        file=name,
        line=line,
    )


def _read(
    source: Traversable, name: str, fmt: str, on_bytes: Callable[[bytes], object] | None
) -> Iterator[RequestSpec]:
    """The specs of a file in format `fmt`, streamed; `on_bytes` (a digest's update) sees every byte."""
    parse = native.parse if fmt == "native" else mooncake.parse
    with _open(source, name) as fh:
        try:
            yield from parse(_rows(fh, name, on_bytes), name)
        except OSError as err:
            raise TraceError(f"cannot read: {err.strerror or err}", file=name) from None


def _rows(fh: Iterable[bytes], name: str, on_bytes: Callable[[bytes], object] | None) -> _Rows:
    """(1-based line, object) for each non-blank line; TraceError for text that is not a JSON object."""
    for line, raw in enumerate(fh, start=1):
        if on_bytes is not None:
            on_bytes(raw)
        if not raw.strip():
            continue
        try:
            # utf-8-sig on the first line: editors on Windows like to start files with a BOM.
            text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
        except UnicodeDecodeError:
            raise TraceError("not UTF-8 text", file=name, line=line) from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise TraceError(f"not JSON: {err.msg} at column {err.colno}", file=name, line=line) from None
        if not isinstance(obj, dict):
            raise TraceError(f"expected a JSON object, got {type(obj).__name__}", file=name, line=line)
        yield line, obj


class _Tally:
    """Running totals for a TraceSummary, fed one spec at a time (memory: one int per distinct block)."""

    def __init__(self) -> None:
        self.requests = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.total_blocks = 0
        self.blocks: set[int] = set()
        self.last_arrival = 0.0
        self.block_size = 0

    def add(self, spec: RequestSpec) -> None:
        if self.requests == 0:
            self.block_size = spec.block_size
        self.requests += 1
        self.input_tokens += spec.input_tokens
        self.output_tokens += spec.output_tokens
        self.total_blocks += len(spec.hash_ids)
        self.blocks.update(spec.hash_ids)
        self.last_arrival = spec.arrival_s

    def summary(self, path: str, fmt: str, sha256: str) -> TraceSummary:
        unique = len(self.blocks)
        return TraceSummary(
            path=path,
            format=fmt,
            sha256=sha256,
            requests=self.requests,
            span_s=self.last_arrival,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            block_size=self.block_size,
            unique_blocks=unique,
            block_reuse_ratio=1.0 - unique / self.total_blocks if self.total_blocks else 0.0,
        )
