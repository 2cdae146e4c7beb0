"""Open the trace a run replays: find it, detect its format, validate it whole, transform and summarise it.

`open_trace` reads the whole file once, streaming, before the run starts, so a bad row fails the run
at start-up with file, line and field, never hours in. The `Trace` it returns re-reads the file on each
iteration instead of holding it, so memory stays flat however long the trace or the run (a trace sorted
on request is the exception: it is held, sorted, in memory).

Pipeline, the same for every format: the format's reader yields Rows (or a TraceError / Skip per row)
-> bad rows raise, or are counted with `skip_bad_rows` -> arrival order is checked (or sorted on
request) -> times become seconds from the first request, turns of a session without block ids get the
previous turn's blocks as their prefix, requests are numbered -> the window and rate-scale transforms.

Over 500 lines because format detection, whole-file validation, transforms and the summary are one pass over
the file.
"""

from __future__ import annotations

import bisect
import csv
import gzip
import hashlib
import io
import itertools
import json
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import IO, Any

import structlog

from soakd.config import BUNDLED_PREFIX, BUNDLED_TRACES, ReplayConfig, TraceConfig
from soakd.errors import TraceError
from soakd.files import not_a_regular_file
from soakd.traces import azure, bailian, burstgpt, mooncake, native, sharegpt
from soakd.traces.model import (
    RequestSpec,
    Row,
    Skip,
    TraceSummary,
    blocks_needed,
    bounded_lines,
    json_lines,
    show_number,
)
from soakd.traces.synth import synthesize

log = structlog.get_logger(__name__)

DEMO_RESOURCE = BUNDLED_TRACES["demo"]
SYNTHETIC_PATH = "<synthetic>"
DEFAULT_BLOCK_SIZE = 16  # for formats without block ids: vLLM's KV block size, so prefixes align
FORMATS = ("native", "mooncake", "bailian", "azure", "burstgpt", "sharegpt")
_TIME_KEYS = {
    "native": native.TIME_KEY,
    "mooncake": mooncake.TIME_KEY,
    "bailian": bailian.TIME_KEY,
    "azure": azure.TIME_KEY,
    "burstgpt": burstgpt.TIME_KEY,
    "sharegpt": sharegpt.TIME_KEY,
}
_INPUT_KEYS = {  # the key of a row's prompt length, for errors about what it makes the loader build
    "native": "input_tokens",
    "mooncake": "input_length",
    "bailian": "input_length",
    "azure": "ContextTokens",
    "burstgpt": "Request tokens",
    "sharegpt": "conversations",
}
_MAX_CHAINS = 100_000  # sessions whose prefix blocks are remembered for their next turn
_CHAIN_ID_BASE = 1 << 48  # block ids made up for session prefixes; far above any trace's own ids
# Memory bounds on what session rows make up. A session turn without block ids of its own gets
# ceil(tokens / block_size) made-up ids, so a 40-byte row could ask for 2**25 of them (~1.3 GB of Python
# ints) and a handful of rows for many times that. The bounds below hold whatever the file says:
MAX_CHAIN_BLOCKS = 1 << 20
"""Most made-up block ids one session turn may span (~40 MB): a 10M-token context in blocks of 16 is
625k. A turn needing more is a bad row naming its token count."""
_CHAIN_IDS_KEPT = 1 << 21  # ids remembered over all sessions for their next turn; LRU sessions go first
MADE_UP_IDS_PER_BYTE = 64
"""Made-up block ids the session turns of a trace may span in total (a turn's shared prefix counted
again: it is built again): this many per byte of the file, at least MIN_MADE_UP_IDS. Real traces need
about one per byte (a BurstGPT row of 60 bytes and 1000 tokens: 63 ids); a crafted file that multiplies
tokens by turns is refused on the line where it runs over, so the time each pass over the trace
takes stays proportional to its size."""
MIN_MADE_UP_IDS = 1 << 24
MAX_HELD_IDS = 1 << 22
"""Made-up block ids a trace sorted on read may hold in memory at once (~170 MB)."""
_BAD_EXAMPLES = 3

_Items = Iterator[Row | TraceError | Skip]


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


@dataclass(frozen=True, slots=True)
class Transforms:
    """Replay-side changes to the trace itself (speed is applied by the pacer)."""

    start_s: float = 0.0
    end_s: float = 0.0  # 0: to the end of the trace
    rate_scale: float = 1.0

    @classmethod
    def of(cls, replay: ReplayConfig | None) -> Transforms:
        if replay is None:
            return cls()
        return cls(replay.start, replay.end, replay.rate_scale)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.start_s:
            out["start_s"] = self.start_s
        if self.end_s:
            out["end_s"] = self.end_s
        if self.rate_scale != 1.0:
            out["rate_scale"] = self.rate_scale
        return out


@dataclass(slots=True)
class _Counts:
    bad: int = 0
    bad_examples: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    unsorted_at: TraceError | None = None


def trace_source(path: str, resolve: Callable[[str], Path]) -> Traversable:
    """The file `trace.path` names: "" or "bundled:NAME" is a trace shipped with soakd, else a path."""
    if not path:
        return files("soakd").joinpath(DEMO_RESOURCE)
    if path.startswith(BUNDLED_PREFIX):
        # The config refused unknown names when it loaded.
        return files("soakd").joinpath(BUNDLED_TRACES[path[len(BUNDLED_PREFIX) :]])
    return resolve(path)


def open_trace(
    cfg: TraceConfig, resolve: Callable[[str], Path], seed: int, replay: ReplayConfig | None = None
) -> Trace:
    """Validate, transform and summarise the trace `cfg` names; raises TraceError on the first bad row.

    `cfg.path == ""` is the bundled demo trace, "bundled:NAME" another bundled one.
    `resolve` turns a configured path into a real one
    (relative to the config file). `seed` drives generated times and synthetic traces; `replay`
    carries the window and rate-scale transforms.
    """
    transforms = Transforms.of(replay)
    if cfg.format == "synthetic":
        return _synthetic(cfg, seed, transforms)
    source = trace_source(cfg.path, resolve)
    name = str(source)
    stamp = _stamp(source, name)
    fmt = cfg.format if cfg.format != "auto" else detect(source, name)
    made_up = _MadeUp(name, fmt, stamp)
    counter = _counter(cfg, resolve) if fmt == "sharegpt" else sharegpt.estimate_tokens
    block_size = cfg.block_size or DEFAULT_BLOCK_SIZE

    def items(on_bytes: Callable[[bytes], object] | None) -> _Items:
        return _read(source, name, fmt, cfg, seed, counter, on_bytes)

    digest = hashlib.sha256()
    counts = _Counts()
    tally = _Tally()
    rows = _checked(items(digest.update), name, fmt, cfg, counts, allow_unsorted=cfg.sort)
    for spec in _transform(_specs(rows, block_size, made_up), transforms, seed):
        tally.add(spec)
    held: list[RequestSpec] | None = None
    if counts.unsorted_at is not None:
        # Asked to sort, and needed: the only case where the trace is held in memory.
        log.warning("trace_sorted_on_read", file=name, first_backwards=str(counts.unsorted_at))
        unsorted = _checked(items(None), name, fmt, cfg, _Counts(), allow_unsorted=True)
        ordered = sorted(unsorted, key=lambda r: r.t_s)
        held = _held(_transform(_specs(ordered, block_size, made_up), transforms, seed), made_up)
        tally = _Tally()
        for spec in held:
            tally.add(spec)
    if tally.requests == 0:
        raise TraceError(_empty_reason(counts, transforms), file=name)
    token_counts = "recorded"
    if fmt == "sharegpt":
        token_counts = f"tokenizer {cfg.tokenizer}" if cfg.tokenizer else "estimated (4 characters per token)"
    summary = tally.summary(
        name,
        fmt,
        digest.hexdigest(),
        bad_rows=counts.bad,
        skipped=counts.skipped,
        sorted_on_read=held is not None,
        token_counts=token_counts,
        transforms=transforms.as_dict(),
    )
    if counts.bad:
        log.warning("trace_bad_rows_skipped", file=name, bad_rows=counts.bad, first=counts.bad_examples)
    if counts.skipped:
        log.info("trace_rows_left_out", file=name, **counts.skipped)
    if held is not None:
        kept = held
        return Trace(summary, lambda: iter(kept))

    def specs() -> Iterator[RequestSpec]:
        # A run that loops re-reads the file for hours; if someone rewrites it meanwhile, the replay
        # would no longer be the trace that was validated and summarised.
        if _stamp(source, name) != stamp:
            raise TraceError("changed since it was validated; restart the run", file=name)
        rows = _checked(items(None), name, fmt, cfg, _Counts(), allow_unsorted=False)
        return _transform(_specs(rows, block_size, made_up), transforms, seed)

    return Trace(summary, specs)


def _empty_reason(counts: _Counts, transforms: Transforms) -> str:
    if transforms.start_s or transforms.end_s or transforms.rate_scale < 1:
        return f"no requests left after the replay window/rate scale {transforms.as_dict()}"
    left_out = counts.bad + sum(counts.skipped.values())
    if left_out:
        return f"no usable requests ({left_out} rows left out)"
    return "empty trace (no requests)"


def _counter(cfg: TraceConfig, resolve: Callable[[str], Path]) -> sharegpt.Counter:
    if not cfg.tokenizer:
        return sharegpt.estimate_tokens
    return sharegpt.tokenizer_counter(str(resolve(cfg.tokenizer)))


def _synthetic(cfg: TraceConfig, seed: int, transforms: Transforms) -> Trace:
    # Small by construction (rate x duration), so held in memory; hashed as its native serialization
    # so that equal synthetic traces have equal digests.
    base = synthesize(cfg.synthetic, cfg.arrivals, seed)
    digest = hashlib.sha256()
    for line in native.lines(base, cfg.synthetic.block_size):
        digest.update(line.encode("utf-8"))
    specs = list(_transform(iter(base), transforms, seed))
    tally = _Tally()
    for spec in specs:
        tally.add(spec)
    if tally.requests == 0:
        raise TraceError(_empty_reason(_Counts(), transforms), file=SYNTHETIC_PATH)
    summary = tally.summary(SYNTHETIC_PATH, "synthetic", digest.hexdigest(), transforms=transforms.as_dict())
    return Trace(summary, lambda: iter(specs))


def _stamp(source: Traversable, name: str) -> int | None:
    """Size of a file on disk (None for a resource that is not a plain path).

    Size, not modification time: a `touch` or an rsync of the same content must not end a night's run.
    """
    if not isinstance(source, Path):
        return None
    kind = not_a_regular_file(source)
    if kind is not None:
        raise TraceError(f"cannot read: {kind}", file=name)
    try:
        st = source.stat()
    except OSError as err:
        raise TraceError(f"cannot read: {err.strerror or err}", file=name) from None
    return st.st_size


class _Tee(io.RawIOBase):
    """A raw reader that shows every byte it reads to `on_bytes` (the trace digest sees the file bytes)."""

    def __init__(self, raw: IO[bytes], on_bytes: Callable[[bytes], object]) -> None:
        self._raw = raw
        self._on_bytes = on_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self._on_bytes(data)
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open(source: Traversable, name: str, on_bytes: Callable[[bytes], object] | None) -> IO[bytes]:
    """The file's (decompressed) bytes; `on_bytes` sees the bytes as stored."""
    try:
        raw: IO[bytes] = source.open("rb")
    except OSError as err:
        raise TraceError(f"cannot read: {err.strerror or err}", file=name) from None
    stream: IO[bytes] = raw if on_bytes is None else io.BufferedReader(_Tee(raw, on_bytes), 1 << 16)
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    return stream


def detect(source: Traversable, name: str) -> str:
    """The format of a trace file, from its first row (or first array element, or CSV header)."""
    with _open(source, name, None) as fh:
        try:
            head = fh.read(1 << 16)
        except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise TraceError(f"cannot read: {err}", file=name) from None
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not text:
        raise TraceError("empty trace (no requests)", file=name)
    first_line_no = head[: len(head) - len(text)].count(b"\n") + 1
    if text.startswith(b"["):
        with _open(source, name, None) as fh:
            _, first = sharegpt.first_item(fh, name)
        if sharegpt.looks_like(first):
            return "sharegpt"
        raise TraceError("a JSON array, but its first element is not a conversation", file=name)
    first_line = text.split(b"\n", 1)[0]
    if text.startswith(b"{"):
        try:
            row = json.loads(first_line)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            row = None
        if isinstance(row, dict):
            if native.is_header(row):
                return "native"
            if bailian.looks_like(row):
                return "bailian"
            if mooncake.looks_like(row):
                return "mooncake"
            if sharegpt.looks_like(row):
                return "sharegpt"
    else:
        try:
            header = next(csv.reader([first_line.decode("utf-8", "replace")]), [])
        except csv.Error:  # e.g. a lone CR: not a CSV header either
            header = []
        if azure.looks_like(header):
            return "azure"
        if burstgpt.looks_like(header):
            return "burstgpt"
    raise TraceError(
        "cannot tell the format from the first row (expected a soakd-trace header, Mooncake or Bailian "
        "JSON lines, an Azure or BurstGPT CSV header, or ShareGPT conversations); set trace.format",
        file=name,
        line=first_line_no,
    )


def _read(
    source: Traversable,
    name: str,
    fmt: str,
    cfg: TraceConfig,
    seed: int,
    counter: sharegpt.Counter,
    on_bytes: Callable[[bytes], object] | None,
) -> _Items:
    """The rows of a file in format `fmt`, streamed; `on_bytes` (a digest's update) sees every byte."""
    with _open(source, name, on_bytes) as fh:
        try:
            if fmt in ("azure", "burstgpt"):
                text = io.TextIOWrapper(fh, encoding="utf-8-sig", newline="")
                reader = azure.read if fmt == "azure" else burstgpt.read
                yield from reader(text, name)
            elif fmt == "sharegpt":
                opts = sharegpt.Options(cfg.arrivals, seed, cfg.default_output_tokens, counter)
                yield from sharegpt.read(fh, name, opts)
            else:
                parse = {"native": native.read, "mooncake": mooncake.read, "bailian": bailian.read}[fmt]
                yield from parse(_json_rows(fh, name), name)
        except UnicodeDecodeError:
            raise TraceError("not UTF-8 text", file=name, line=_bad_utf8_line(source, name)) from None
        except csv.Error as err:
            raise TraceError(f"not CSV: {err}", file=name) from None
        except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise TraceError(f"cannot read: {getattr(err, 'strerror', None) or err}", file=name) from None


def _bad_utf8_line(source: Traversable, name: str) -> int | None:
    """The 1-based line of a file's first invalid UTF-8, or None.

    A second read, on the error path only: the CSV readers decode in chunks, which hides the line.
    """
    try:
        with _open(source, name, None) as fh:
            for number, raw in enumerate(bounded_lines(fh, name), start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    return number
    except (OSError, EOFError, zlib.error, TraceError):
        pass
    return None


def _json_rows(fh: IO[bytes], name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line, object) for each non-blank line; a line that is not a JSON object is raised."""
    for line, obj in json_lines(fh, name):
        if isinstance(obj, TraceError):
            raise obj
        yield line, obj


def _checked(
    items: _Items, name: str, fmt: str, cfg: TraceConfig, counts: _Counts, *, allow_unsorted: bool
) -> Iterator[Row]:
    """Good rows only: bad ones raise (or are counted with skip_bad_rows); arrival order is enforced."""
    prev: float | None = None
    default_block_size = cfg.block_size or DEFAULT_BLOCK_SIZE
    for read in items:
        item = read
        if isinstance(read, Row) and _chain_blocks(read, default_block_size) > MAX_CHAIN_BLOCKS:
            reason = _too_many_blocks(read.input_tokens, read.block_size or default_block_size)
            item = TraceError(reason, file=name, line=read.line or None, key=_INPUT_KEYS[fmt])
        if isinstance(item, Row):
            if prev is not None and item.t_s < prev:
                err = TraceError(
                    f"timestamp goes backwards ({show_number(item.t_s)} s < {show_number(prev)} s); "
                    "set trace.sort = true to sort on read",
                    file=name,
                    line=item.line or None,
                    key=_TIME_KEYS[fmt],
                )
                if not allow_unsorted:
                    raise err
                if counts.unsorted_at is None:
                    counts.unsorted_at = err
            prev = item.t_s if prev is None else max(prev, item.t_s)
            yield item
        elif isinstance(item, Skip):
            counts.skipped[item.reason] = counts.skipped.get(item.reason, 0) + 1
        else:
            if not cfg.skip_bad_rows:
                raise item
            counts.bad += 1
            if len(counts.bad_examples) < _BAD_EXAMPLES:
                counts.bad_examples.append(str(item))


class _MadeUp:
    """The file a trace's made-up block ids are counted against, and their budget (see
    MADE_UP_IDS_PER_BYTE); errors name the file, the row's line and its token count's key."""

    def __init__(self, name: str, fmt: str, size: int | None) -> None:
        self.name = name
        self.key = _INPUT_KEYS[fmt]
        self.budget = max(MIN_MADE_UP_IDS, MADE_UP_IDS_PER_BYTE * (size or 0))

    def error(self, reason: str, line: int) -> TraceError:
        return TraceError(reason, file=self.name, line=line or None, key=self.key)


class _MadeUpIds(tuple[int, ...]):
    """The block ids _specs made up for a session turn: runs of consecutive ids, told apart from a
    trace's own by type (a trace's ids may be any size), so the summary counts them per run."""

    __slots__ = ()


def _chain_blocks(row: Row, default_block_size: int) -> int:
    """How many block ids the loader makes up for a row (0: it has its own, or is not a session turn)."""
    if not row.session or row.hash_ids:
        return 0
    return blocks_needed(row.input_tokens, row.block_size or default_block_size)


def _specs(rows: Iterable[Row], default_block_size: int, made_up: _MadeUp) -> Iterator[RequestSpec]:
    """RequestSpecs: times from the first row, numbered, session turns chained onto their predecessors.

    A turn of a session without block ids of its own gets the previous turn's prompt blocks as its
    prefix (and fresh blocks for the rest), so its prompt starts with the previous prompt token for
    token and the prefix cache can hit, as it does in a real conversation. The prefixes remembered are
    bounded (_MAX_CHAINS sessions, _CHAIN_IDS_KEPT ids: a session forgotten starts afresh), and so are
    the ids made up over the whole trace (`made_up.budget`), checked before they are built.
    """
    chains: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    kept = 0
    asked = 0  # made-up ids in the specs so far, shared prefixes included: what each pass builds
    next_id = _CHAIN_ID_BASE
    first: float | None = None
    for index, row in enumerate(rows):
        if first is None:
            first = row.t_s
        block_size = row.block_size or default_block_size
        hash_ids = row.hash_ids
        needed = _chain_blocks(row, default_block_size)
        if needed:
            if needed > MAX_CHAIN_BLOCKS:  # _checked refuses these first; kept here as the guard
                raise made_up.error(_too_many_blocks(row.input_tokens, block_size), row.line)
            asked += needed
            if asked > made_up.budget:
                raise made_up.error(
                    f"session turns of this trace need more than {made_up.budget} made-up prefix "
                    f"blocks in all ({MADE_UP_IDS_PER_BYTE} per byte of the file); give the rows "
                    "hash_ids, fewer tokens, or a larger trace.block_size",
                    row.line,
                )
            old = chains.pop(row.session, ())
            kept -= len(old)
            prefix = old[:needed]
            fresh = needed - len(prefix)
            hash_ids = _MadeUpIds(itertools.chain(prefix, range(next_id, next_id + fresh)))
            next_id += fresh
            chains[row.session] = hash_ids
            kept += needed
            while chains and (len(chains) > _MAX_CHAINS or kept > _CHAIN_IDS_KEPT):
                _, evicted = chains.popitem(last=False)
                kept -= len(evicted)
        yield RequestSpec(
            index=index,
            arrival_s=row.t_s - first,
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            block_size=block_size,
            hash_ids=hash_ids,
            session=row.session,
            turn=row.turn,
            line=row.line,
            images=row.images,
            sampling=row.sampling,
        )


def _too_many_blocks(input_tokens: int, block_size: int) -> str:
    return (
        f"a session turn of {input_tokens} tokens spans {blocks_needed(input_tokens, block_size)} prefix "
        f"blocks of {block_size}, more than {MAX_CHAIN_BLOCKS}; give it hash_ids or a larger block_size"
    )


def _held(specs: Iterable[RequestSpec], made_up: _MadeUp) -> list[RequestSpec]:
    """The specs of a trace sorted on read, in a list, refused once their made-up ids pass MAX_HELD_IDS."""
    out: list[RequestSpec] = []
    held = 0
    for spec in specs:
        if isinstance(spec.hash_ids, _MadeUpIds):
            held += len(spec.hash_ids)
            if held > MAX_HELD_IDS:
                raise made_up.error(
                    f"too many session blocks to sort in memory (more than {MAX_HELD_IDS}); "
                    "sort the file by time instead of trace.sort",
                    spec.line,
                )
        out.append(spec)
    return out


def _transform(specs: Iterator[RequestSpec], transforms: Transforms, seed: int) -> Iterator[RequestSpec]:
    """The replay window (trace seconds [start, end), shifted to 0), then rate scaling."""
    start, end = transforms.start_s, transforms.end_s
    if start or end:
        specs = (
            replace(s, arrival_s=s.arrival_s - start)
            for s in specs
            if s.arrival_s >= start and (not end or s.arrival_s < end)
        )
    if transforms.rate_scale != 1.0:
        specs = _rate_scaled(specs, transforms.rate_scale, seed)
    return specs


def _rate_scaled(specs: Iterator[RequestSpec], scale: float, seed: int) -> Iterator[RequestSpec]:
    """Each request (each whole session) `scale` times on average, the copies spread over the next gap.

    A request is kept floor(scale) times, plus once more with probability frac(scale), decided by a
    hash of (seed, session or request) so a session is kept or dropped whole. Copy c > 0 gets its own
    session name and prompt salt (an independent conversation of the same shape) and arrives at a
    seeded point between its original and the next request, so order holds and no burst of identical
    arrivals is made up.
    """
    whole = int(scale)
    frac = scale - whole
    salt = seed.to_bytes(16, "little", signed=True)
    a, b = itertools.tee(specs)
    next(b, None)
    gap = 0.0
    for spec, after in itertools.zip_longest(a, b):
        key = (spec.session or f"#{spec.index}").encode()
        copies = whole + (_unit(salt, key, -1) < frac)
        if after is not None:  # the last request's copies spread over the gap before it
            gap = after.arrival_s - spec.arrival_s
        out = [
            replace(
                spec,
                copy=c,
                arrival_s=spec.arrival_s + (_unit(salt, key, c) * gap if c else 0.0),
                session=f"{spec.session}~{c}" if spec.session and c else spec.session,
            )
            for c in range(copies)
        ]
        out.sort(key=lambda s: s.arrival_s)
        yield from out


def _unit(salt: bytes, key: bytes, n: int) -> float:
    """A uniform number in [0, 1) fixed by (salt, key, n)."""
    h = hashlib.blake2b(key + n.to_bytes(4, "little", signed=True), digest_size=8, key=salt)
    return int.from_bytes(h.digest(), "little") / 2**64


class _Spans:
    """A set of ints kept as sorted, disjoint [start, end) runs: the made-up ids of session prefixes,
    which come in runs, so memory is per run (at most one per request), not per id."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.count = 0

    def add_all(self, ids: Iterable[int]) -> None:
        start = prev = -1
        for x in ids:
            if x != prev + 1:
                if prev >= 0:
                    self._add(start, prev + 1)
                start = x
            prev = x
        if prev >= 0:
            self._add(start, prev + 1)

    def _add(self, start: int, end: int) -> None:
        """Add [start, end), merging the runs it touches."""
        i = bisect.bisect_left(self._ends, start)  # the first run that ends at or after `start`
        j = bisect.bisect_right(self._starts, end)  # runs from i up to j touch [start, end)
        if i < j:
            start = min(start, self._starts[i])
            end = max(end, self._ends[j - 1])
            self.count -= sum(e - s for s, e in zip(self._starts[i:j], self._ends[i:j], strict=True))
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]
        self.count += end - start


class _Tally:
    """Running totals for a TraceSummary, fed one spec at a time (memory: one int per distinct block of
    the trace's own, one run per request for the ids made up for sessions)."""

    def __init__(self) -> None:
        self.requests = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.total_blocks = 0
        self.blocks: set[int] = set()
        self.made_up = _Spans()
        self.last_arrival = 0.0
        self.block_size = 0
        self.session_turns: dict[str, int] = {}

    def add(self, spec: RequestSpec) -> None:
        if self.requests == 0:
            self.block_size = spec.block_size
        self.requests += 1
        self.input_tokens += spec.input_tokens
        self.output_tokens += spec.output_tokens
        self.total_blocks += len(spec.hash_ids)
        if isinstance(spec.hash_ids, _MadeUpIds):
            self.made_up.add_all(spec.hash_ids)
        else:
            self.blocks.update(spec.hash_ids)
        self.last_arrival = spec.arrival_s
        if spec.session:
            self.session_turns[spec.session] = self.session_turns.get(spec.session, 0) + 1

    def summary(
        self,
        path: str,
        fmt: str,
        sha256: str,
        *,
        bad_rows: int = 0,
        skipped: dict[str, int] | None = None,
        sorted_on_read: bool = False,
        token_counts: str = "recorded",
        transforms: dict[str, float] | None = None,
    ) -> TraceSummary:
        unique = len(self.blocks) + self.made_up.count
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
            sessions=sum(1 for n in self.session_turns.values() if n > 1),
            turns_max=max(self.session_turns.values(), default=0),
            bad_rows=bad_rows,
            skipped_rows=dict(skipped or {}),
            sorted_on_read=sorted_on_read,
            token_counts=token_counts,
            transforms=dict(transforms or {}),
        )
