"""Fuzzing the readers of untrusted input: every trace format, the spool segments and line protocol.

The trace property: a mostly-valid file (valid rows with random damage) either reads whole, and then
every request has a finite arrival >= 0 and >= 1 input and output tokens, or it is refused with an
InputError (the CLI prints it as one line and exits with code 2). Any other exception is a crash.

Examples are bounded so the file stays fast on a small CI machine; each property runs both the named
format and auto-detection on the same file.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import math
import tempfile
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from soakd.config import ArrivalConfig, TraceConfig, TraceFormat
from soakd.errors import InputError
from soakd.metric import FieldValue, Sample, parse_line
from soakd.sinks.spool import Spool, iter_lines, iter_samples, list_segments
from soakd.traces import open_trace, sharegpt
from soakd.traces.model import MAX_TOKENS
from soakd.traces.sharegpt import MAX_DEPTH

_FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

Row = dict[str, str]  # key -> raw JSON text of its value, so values json.dumps cannot write can be planted


# --- Damage shared by every format ----------------------------------------------------------------

# Raw JSON values a reader must refuse cleanly (or accept): wrong types, non-finite and huge numbers
# (token counts just past MAX_TOKENS too), integers past Python's 4300-digit str limit, nesting past the
# recursion limit (and past sharegpt.MAX_DEPTH in the array layout), lone surrogates.
_DEEP = "[" * 1500 + "]" * 1500
_WEIRD_JSON = [
    "null", "true", "false", '""', '"x"', '"\\ud800"', '"é漢🙂"', "[]", "{}", "[1,2]", '{"a":1}',
    "0", "-1", "-0", "1.5", "-1e-9", "1e308", "1e400", "-1e400", "NaN", "Infinity", "-Infinity",
    str(2**63), str(2**64 + 1), str(-(2**63) - 1), str(10**400), str(-(10**400)), "1" * 5000, _DEEP,
    str(MAX_TOKENS + 1), "10000000000",
]  # fmt: skip
_WEIRD_CELLS = [
    "", " ", "0", "-1", "1.5", "52.0", "nan", "inf", "-inf", "1e400", "1e300", "1_000", "٣", "²",
    "abc", '"', "x,y", "a\nb", "2023-13-45 25:61:61", "2024-05-10 00:00:00.+00:00", "2024-05-10T00:00:00-99",
    "2024-05-10 00:00:00.5+05:30:00", "0001-01-01 00:00:00", "9999-12-31 23:59:59.9999999-23:59",
    "1" * 5000, "x" * 200_000, "33554433", "1e10",
]  # fmt: skip
_KEYS = st.sampled_from(["extra", "t", "timestamp", "input_tokens", "hash_ids", "session", "", "é"])


def _weird_json() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(_WEIRD_JSON), st.text(max_size=8).map(json.dumps))


@st.composite
def _mutated_row(draw: st.DrawFn, row: Row) -> Row:
    """The row with up to two of: a field dropped, a field added, a value swapped for a weird one."""
    out = dict(row)
    for _ in range(draw(st.integers(0, 2))):
        action = draw(st.sampled_from(["drop", "add", "swap"]))
        if action == "drop" and out:
            out.pop(draw(st.sampled_from(sorted(out))))
        elif action == "add":
            out[draw(_KEYS)] = draw(_weird_json())
        elif out:
            out[draw(st.sampled_from(sorted(out)))] = draw(_weird_json())
    return out


def _json_object(row: Row) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in row.items()) + "}"


@st.composite
def _json_lines(draw: st.DrawFn, rows: list[Row]) -> list[bytes]:
    """One JSON object per row, most rows intact; some mutated, truncated or replaced by junk bytes."""
    lines: list[bytes] = []
    for row in rows:
        damage = draw(st.sampled_from(["none"] * 12 + ["row"] * 2 + ["truncate", "junk"]))
        obj = draw(_mutated_row(row)) if damage == "row" else row
        line = _json_object(obj).encode("utf-8", "surrogatepass")
        if damage == "truncate":
            line = line[: draw(st.integers(0, max(0, len(line) - 1)))]
        elif damage == "junk":
            line = draw(st.binary(max_size=20))
        lines.append(line)
    return lines


@st.composite
def _file_bytes(draw: st.DrawFn, lines: list[bytes]) -> tuple[bytes, bool]:
    """(file content, gzipped): the lines joined by LF or CRLF, then maybe a BOM, a cut, junk, gzip."""
    if draw(st.integers(0, 30)) == 0:
        return b"", False
    newline = draw(st.sampled_from([b"\n", b"\r\n"]))
    data = newline.join(lines) + (newline if draw(st.booleans()) else b"")
    if draw(st.integers(0, 5)) == 0:
        data = b"\xef\xbb\xbf" + data
    damage = draw(st.sampled_from(["none"] * 6 + ["cut", "insert", "overwrite"]))
    if data and damage == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "insert":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    elif data and damage == "overwrite":
        at = draw(st.integers(0, len(data) - 1))
        junk = draw(st.binary(min_size=1, max_size=8))
        data = data[:at] + junk + data[at + len(junk) :]
    gzipped = draw(st.integers(0, 6)) == 0
    if gzipped:
        packed = bytearray(gzip.compress(data, mtime=0))
        if draw(st.booleans()):  # damage the compressed stream itself
            packed[draw(st.integers(10, len(packed) - 1))] = draw(st.integers(0, 255))
        data = bytes(packed)
    return data, gzipped


_DELTA = st.one_of(st.just(0.0), st.floats(0, 1e4, allow_nan=False))
_TOKENS = st.integers(1, 2000)
_TEXT = st.text(max_size=20)


def _blocks(tokens: int, size: int) -> int:
    return -(-tokens // size)


# --- Valid rows of each format --------------------------------------------------------------------


@st.composite
def _native(draw: st.DrawFn) -> list[bytes]:
    block_size = draw(st.sampled_from([16, 64, 512]))
    header: Row = {"format": '"soakd-trace"', "version": "1", "block_size": str(block_size)}
    rows = [header]
    t = draw(st.floats(0, 1e6, allow_nan=False))
    for _ in range(draw(st.integers(1, 8))):
        t += draw(_DELTA)
        tokens = draw(_TOKENS)
        row: Row = {"t": json.dumps(t), "input_tokens": str(tokens), "output_tokens": str(draw(_TOKENS))}
        if draw(st.booleans()):
            first = draw(st.integers(0, 2**40))
            row["hash_ids"] = json.dumps(list(range(first, first + _blocks(tokens, block_size))))
        if draw(st.booleans()):
            row["session"] = json.dumps(draw(_TEXT))
            row["turn"] = str(draw(st.integers(0, 50)))
        if draw(st.booleans()):
            row["images"] = str(draw(st.integers(0, 4)))
        if draw(st.booleans()):
            temp = draw(st.floats(0, 2, allow_nan=False))
            row["sampling"] = json.dumps({"temperature": temp, "top_p": 0.9, "greedy": True})
        if draw(st.booleans()):
            row["api"] = json.dumps(draw(st.sampled_from(["chat", "completions"])))
            row["prompt"] = json.dumps(draw(st.one_of(_TEXT, st.lists(_TEXT, max_size=3))))
        rows.append(row)
    return draw(_json_lines(rows))


@st.composite
def _mooncake(draw: st.DrawFn) -> list[bytes]:
    rows: list[Row] = []
    ms = draw(st.integers(-(10**6), 10**9))
    for _ in range(draw(st.integers(1, 8))):
        ms += draw(st.integers(0, 10**5))
        tokens = draw(st.integers(1, 10**5))
        row: Row = {"timestamp": str(ms), "input_length": str(tokens), "output_length": str(draw(_TOKENS))}
        if draw(st.booleans()):
            row["hash_ids"] = json.dumps(list(range(ms % 1000, ms % 1000 + _blocks(tokens, 512))))
        rows.append(row)
    return draw(_json_lines(rows))


@st.composite
def _bailian(draw: st.DrawFn) -> list[bytes]:
    rows: list[Row] = []
    t = draw(st.floats(0, 1e5, allow_nan=False))
    for chat in range(draw(st.integers(1, 8))):
        t += draw(_DELTA)
        tokens = draw(st.integers(1, 1000))
        parent = draw(st.integers(-1, chat - 1)) if chat else -1
        row: Row = {
            "chat_id": str(chat) if draw(st.booleans()) else json.dumps(f"c{chat}"),
            "parent_chat_id": str(parent),
            "timestamp": json.dumps(t),
            "input_length": str(tokens),
            "output_length": str(draw(_TOKENS)),
            "type": '"text"',
            "turn": str(draw(st.integers(0, 9))),
        }
        if draw(st.booleans()):
            row["hash_ids"] = json.dumps(list(range(_blocks(tokens, 16))))
        rows.append(row)
    return draw(_json_lines(rows))


@st.composite
def _csv_lines(draw: st.DrawFn, header: list[str], rows: list[dict[str, str]]) -> list[bytes]:
    """CSV lines (quoted by the csv module) of rows by column name, some cells or rows damaged."""
    lines: list[bytes] = []

    def line(cells: list[str]) -> bytes:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="").writerow(cells)
        return buf.getvalue().encode("utf-8")

    lines.append(line(header))
    for row in rows:
        cells = [row.get(name, "") for name in header]
        damage = draw(st.sampled_from(["none"] * 12 + ["cell"] * 2 + ["short", "long", "junk"]))
        if damage == "cell" and cells:
            cells[draw(st.integers(0, len(cells) - 1))] = draw(st.sampled_from(_WEIRD_CELLS))
        elif damage == "short":
            cells = cells[: draw(st.integers(0, len(cells)))]
        elif damage == "long":
            cells.append(draw(_TEXT))
        lines.append(draw(st.binary(max_size=20)) if damage == "junk" else line(cells))
    return lines


_EPOCH = datetime(2023, 11, 16, 18, 17, 3, tzinfo=UTC)


@st.composite
def _azure(draw: st.DrawFn) -> list[bytes]:
    names = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    if draw(st.booleans()):
        names.append("NumImages")
    header = list(draw(st.permutations(names)))
    rows: list[dict[str, str]] = []
    at = _EPOCH
    for _ in range(draw(st.integers(1, 8))):
        at += timedelta(microseconds=draw(st.integers(0, 10**8)))
        spelling = draw(st.sampled_from(["2023", "2024", "2025"]))
        if spelling == "2023":
            stamp = at.strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
        elif spelling == "2024":
            stamp = at.isoformat(sep=" ")
        else:
            stamp = at.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        rows.append(
            {
                "TIMESTAMP": stamp,
                "ContextTokens": str(draw(_TOKENS)),
                "GeneratedTokens": str(draw(st.integers(0, 2000))),
                "NumImages": str(draw(st.integers(0, 3))),
            }
        )
    return draw(_csv_lines(header, rows))


@st.composite
def _burstgpt(draw: st.DrawFn) -> list[bytes]:
    header = ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]
    if draw(st.booleans()):
        header.append("Session ID")
    if draw(st.booleans()):
        header.append("Elapsed time")
    rows: list[dict[str, str]] = []
    t = draw(st.integers(0, 10**5))
    for _ in range(draw(st.integers(1, 8))):
        t += draw(st.integers(0, 100))
        inp, out = draw(_TOKENS), draw(st.integers(0, 2000))
        rows.append(
            {
                "Timestamp": str(t),
                "Model": draw(st.sampled_from(["ChatGPT", "GPT-4"])),
                "Request tokens": str(inp),
                "Response tokens": str(out),
                "Total tokens": str(inp + out),
                "Log Type": "Conversation log",
                "Session ID": draw(st.sampled_from(["", "s1", "s2", "会话"])),
                "Elapsed time": "1.5",
            }
        )
    return draw(_csv_lines(header, rows))


_ROLES = st.sampled_from(["human", "gpt"] * 3 + ["user", "assistant", "system", "GPT", "robot"])


@st.composite
def _sharegpt(draw: st.DrawFn) -> list[bytes]:
    rows: list[Row] = []
    for n in range(draw(st.integers(1, 6))):
        if draw(st.integers(0, 3)) == 0:  # a vLLM-bench prompt row
            row: Row = {"prompt": json.dumps(draw(_TEXT))}
            if draw(st.booleans()):
                row["output_tokens"] = str(draw(_TOKENS))
        else:
            role_key, text_key = draw(st.sampled_from([("from", "value"), ("role", "content")]))
            messages = [
                {role_key: draw(_ROLES), text_key: draw(_TEXT)} for _ in range(draw(st.integers(0, 5)))
            ]
            key = draw(st.sampled_from(["conversations", "conversation"]))
            row = {"id": json.dumps(f"conv{n}"), key: json.dumps(messages)}
        rows.append(row)
    if draw(st.booleans()):  # the JSON array layout: one document, so no per-line damage
        mutated = [draw(_mutated_row(r)) for r in rows]
        return [b"[" + b",".join(_json_object(r).encode() for r in mutated) + b"]"]
    return draw(_json_lines(rows))


_TRACES: dict[str, Callable[[], st.SearchStrategy[list[bytes]]]] = {
    "native": _native,
    "mooncake": _mooncake,
    "bailian": _bailian,
    "azure": _azure,
    "burstgpt": _burstgpt,
    "sharegpt": _sharegpt,
}
_SUFFIX = {"azure": ".csv", "burstgpt": ".csv", "sharegpt": ".json"}


def _read_or_refuse(path: Path, fmt: TraceFormat, *, skip_bad_rows: bool = False, sort: bool = False) -> str:
    """Open and read the whole trace, saying how it went; any exception but InputError propagates."""
    cfg = TraceConfig(path=str(path), format=fmt, skip_bad_rows=skip_bad_rows, sort=sort)
    try:
        specs = list(open_trace(cfg, Path, 7))
    except InputError:
        return "refused"
    assert specs, "a trace that opens has requests"
    for spec in specs:
        assert math.isfinite(spec.arrival_s) and spec.arrival_s >= 0, spec
        assert spec.input_tokens >= 1 and spec.output_tokens >= 1, spec
    return "read"


@pytest.mark.parametrize("fmt", sorted(_TRACES))
@_FUZZ
@given(data=st.data(), skip_bad_rows=st.booleans(), sort=st.booleans())
def test_trace_reads_whole_or_refuses_cleanly(
    fmt: TraceFormat, data: st.DataObject, skip_bad_rows: bool, sort: bool
) -> None:
    lines = data.draw(_TRACES[fmt](), label="lines")
    content, gzipped = data.draw(_file_bytes(lines), label="file")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"trace{_SUFFIX.get(fmt, '.jsonl')}{'.gz' if gzipped else ''}"
        path.write_bytes(content)
        # Events show (with --hypothesis-show-statistics) that both outcomes are well exercised.
        event(f"{fmt}: {_read_or_refuse(path, fmt, skip_bad_rows=skip_bad_rows, sort=sort)}")
        event(f"auto: {_read_or_refuse(path, 'auto', skip_bad_rows=skip_bad_rows, sort=sort)}")


# --- Line protocol and the spool ------------------------------------------------------------------

# Names mix the characters line protocol escapes (or must not confuse) with any encodable text.
# Surrogates are left out: the spool writes UTF-8, and no caller hands it unencodable strings.
_LP_CHARS = st.one_of(
    st.sampled_from([" ", ",", "=", '"', "\\", "\n", "\t", "'", "\\n", "é", "漢"]),
    st.characters(codec="utf-8"),
)
_LP_TEXT = st.lists(_LP_CHARS, max_size=8).map("".join)
# Ints within what str() can print (Python's 4300-digit limit); InfluxDB itself stops at int64.
_FIELD_VALUES: st.SearchStrategy[FieldValue] = st.one_of(
    st.integers(-(2**256), 2**256), st.floats(), st.booleans(), _LP_TEXT
)
_SAMPLES = st.builds(
    Sample,
    measurement=_LP_TEXT,
    fields=st.dictionaries(_LP_TEXT, _FIELD_VALUES, max_size=4),
    time_ns=st.integers(-(2**63), 2**63 - 1),
    tags=st.dictionaries(_LP_TEXT, _LP_TEXT, max_size=3),
)

_Typed = tuple[str, dict[str, tuple[type, FieldValue]], int, dict[str, str]]


def _typed(sample: Sample) -> _Typed:
    """A sample as compared after a round trip: values with their types (True must not equal 1)."""
    return (
        sample.measurement,
        {k: (type(v), v) for k, v in sample.fields.items()},
        sample.time_ns,
        dict(sample.tags),
    )


def _as_written(sample: Sample) -> _Typed | None:
    """What the spool promises to keep: non-finite floats and empty tags are dropped, as documented."""
    fields = {k: v for k, v in sample.fields.items() if not (isinstance(v, float) and not math.isfinite(v))}
    if not fields:
        return None
    tags: Mapping[str, str] = {k: v for k, v in sample.tags.items() if v != ""}
    return _typed(Sample(sample.measurement, fields, sample.time_ns, tags))


@_FUZZ
@given(sample=_SAMPLES)
def test_parse_line_inverts_to_line(sample: Sample) -> None:
    line = sample.to_line()
    expected = _as_written(sample)
    if expected is None:
        assert line is None
        return
    assert line is not None and "\n" not in line
    assert _typed(parse_line(line)) == expected


def _write(directory: Path, batches: list[list[Sample]], segment_bytes: int) -> None:
    with Spool(directory, segment_bytes=segment_bytes, fsync_interval_s=3600.0) as spool:
        for batch in batches:
            spool.write(batch)


@settings(_FUZZ, max_examples=100)  # fewer: every example fsyncs each of its (tiny) segments
@given(
    batches=st.lists(st.lists(_SAMPLES, max_size=5), max_size=5),
    segment_bytes=st.integers(1, 400),
)
def test_spool_round_trips_samples(batches: list[list[Sample]], segment_bytes: int) -> None:
    expected = [e for batch in batches for s in batch if (e := _as_written(s)) is not None]
    with tempfile.TemporaryDirectory() as tmp:
        _write(Path(tmp), batches, segment_bytes)
        assert [_typed(s) for s in iter_samples(Path(tmp))] == expected


# Samples whose lines are known to parse back (plain names and string values); the damage property
# is about what a reader does with broken segments, not about escaping.
_PLAIN = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=6)
_INT64 = st.integers(-(2**63), 2**63 - 1)
_FINITE = st.floats(allow_nan=False, allow_infinity=False)
_SIMPLE_SAMPLES = st.builds(
    Sample,
    measurement=_PLAIN,
    fields=st.dictionaries(_PLAIN, st.one_of(_INT64, _FINITE, _LP_TEXT), min_size=1),
    time_ns=st.integers(0, 2**62),
    tags=st.dictionaries(_PLAIN, _PLAIN, max_size=2),
)


def _segment_lines(data: bytes) -> list[tuple[int, str]]:
    """(end offset, text) of each non-empty complete line of a segment's bytes."""
    out: list[tuple[int, str]] = []
    start = 0
    while (end := data.find(b"\n", start)) >= 0:
        if end > start:
            out.append((end + 1, data[start:end].decode("utf-8")))
        start = end + 1
    return out


@_FUZZ
@given(
    samples=st.lists(_SIMPLE_SAMPLES, min_size=1, max_size=12),
    segment_bytes=st.integers(64, 400),
    data=st.data(),
)
def test_damaged_spool_keeps_the_lines_before_the_damage(
    samples: list[Sample], segment_bytes: int, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        _write(directory, [samples], segment_bytes)
        segments = list_segments(directory)
        original = [_segment_lines(p.read_bytes()) for p in segments]
        assume(any(original))
        victim = data.draw(st.integers(0, len(segments) - 1), label="segment")
        content = segments[victim].read_bytes()
        assume(content)
        at = data.draw(st.integers(0, len(content) - 1), label="offset")
        truncate = data.draw(st.booleans(), label="truncate")
        if truncate:  # a torn write: the segment ends mid-line
            segments[victim].write_bytes(content[:at])
        else:  # bit rot: bytes overwritten in place
            junk = data.draw(st.binary(min_size=1, max_size=8), label="junk")
            segments[victim].write_bytes(content[:at] + junk + content[at + len(junk) :])

        before = [text for lines in original[:victim] for _, text in lines]
        before += [text for end, text in original[victim] if end <= at]
        after = [text for lines in original[victim + 1 :] for _, text in lines]
        got = list(iter_lines(directory))
        if truncate:
            assert got == before + after
        else:
            assert got[: len(before)] == before

        # Every line before the damage parses back; what follows parses or raises ValueError (documented).
        parsed: list[Sample] = []
        with contextlib.suppress(ValueError):
            parsed.extend(iter_samples(directory))
        assert len(parsed) >= len(before)
        assert [_typed(s) for s in parsed[: len(before)]] == [_typed(parse_line(t)) for t in before]


# --- Findings -------------------------------------------------------------------------------------

_MOONCAKE_ROW = '"input_length":1,"output_length":1'
_TURN = '{"from":"human","value":"a"},{"from":"gpt","value":"b"}'
_TWO_TURNS = f'"conversations":[{_TURN},{_TURN}]'
# Minimal files of the crashes the properties above found; each is now a TraceError naming the file.
_FOUND: dict[str, tuple[TraceFormat, bytes]] = {
    # OverflowError: an integer beyond float range as a time (RowReader.number).
    "huge-int-time": ("mooncake", f'{{"timestamp":{10**400},{_MOONCAKE_ROW}}}\n'.encode()),
    # OverflowError: the same as a sampling parameter (native._sampling).
    "huge-int-sampling": (
        "native",
        b'{"format":"soakd-trace","version":1,"block_size":16}\n'
        + f'{{"t":0,"input_tokens":1,"output_tokens":1,"sampling":{{"x":{10**400}}}}}\n'.encode(),
    ),
    # ValueError (not a JSONDecodeError): an integer past Python's 4300-digit limit (json_lines).
    "4301-digit-int": ("mooncake", f'{{"timestamp":0,{_MOONCAKE_ROW},"x":{"1" * 5000}}}\n'.encode()),
    # RecursionError: nesting past the recursion limit (json_lines, detect, sharegpt.first_item).
    "deep-nesting": ("mooncake", f'{{"timestamp":0,{_MOONCAKE_ROW},"x":{_DEEP}}}\n'.encode()),
    "deep-nesting-sharegpt": ("sharegpt", f'{{{_TWO_TURNS},"x":{_DEEP}}}\n'.encode()),
    # RecursionError: str() of a deeply nested conversation id (sharegpt._turns); now the depth guard.
    "deep-id": ("sharegpt", f'[{{"id":{_DEEP},{_TWO_TURNS}}}]'.encode()),
    # Segfault (C stack) in ijson's item builder: deep nesting in a later element of the array layout
    # (sharegpt._elements; tests/data/bad_input has the 100000-level case, run in a child process).
    "deep-nesting-sharegpt-array": ("sharegpt", f'[{{{_TWO_TURNS}}},{{{_TWO_TURNS},"x":{_DEEP}}}]'.encode()),
    # zlib.error (not an OSError): a damaged deflate stream in a .gz trace (loader._read, detect).
    "bad-deflate": (
        "native",
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\x03\x00\xbf{?\x00\xe1\x97\x10\x01\x03\x00\x00\x00",
    ),
    # csv.Error: a lone CR in the first line, read as a CSV header by auto-detection (detect).
    "cr-in-first-line": ("bailian", b"a\rb\n"),
}


@pytest.mark.parametrize("case", sorted(_FOUND))
def test_found_crashes_are_refused_cleanly(case: str, tmp_path: Path) -> None:
    fmt, content = _FOUND[case]
    path = tmp_path / ("trace.jsonl.gz" if content.startswith(b"\x1f\x8b") else "trace.jsonl")
    path.write_bytes(content)
    as_formats: tuple[TraceFormat, ...] = (fmt, "auto")
    for as_format in as_formats:
        with pytest.raises(InputError) as info:
            open_trace(TraceConfig(path=str(path), format=as_format), Path, 7)
        assert info.value.file == str(path)


@pytest.mark.parametrize(
    "sample",
    [
        Sample('m"', {"f": 1}, 0),  # a quote in a name is not a string
        Sample("m", {"f": 1}, 0, {"k": 'v"'}),
        Sample("m", {'f"': 1, "g": 2}, 0),
        Sample("m\\", {"f": 1}, 0),  # a trailing backslash must not escape the space after it
        Sample("m", {"f\\": 1}, 0),
        Sample("m", {"\\n": 1}, 0),  # backslash + n is not a newline
        Sample("m", {"f": 1}, 0, {"k=": "v"}),  # an escaped = in a tag key
    ],
    ids=repr,
)
def test_found_line_protocol_round_trips(sample: Sample) -> None:
    line = sample.to_line()
    assert line is not None
    assert _typed(parse_line(line)) == _typed(sample)


_NATIVE_HEADER = '{"format":"soakd-trace","version":1,"block_size":16}\n'
_BURSTGPT_HEADER = "Timestamp,Request tokens,Response tokens,Session ID\n"
_BAILIAN_ROW = '{{"chat_id":{},"parent_chat_id":{},"timestamp":0,"input_length":{},"output_length":1}}\n'
# (format, file content, line, key) of token counts past MAX_TOKENS. In a session (BurstGPT, native) the
# loader made up ceil(count / 16) prefix block ids: 1e300 raised OverflowError, 1e10 ran out of memory.
_HUGE_COUNTS: dict[str, tuple[TraceFormat, str, int, str]] = {
    "burstgpt-session-1e300": ("burstgpt", _BURSTGPT_HEADER + "0,1e300,5,s\n", 2, "Request tokens"),
    "burstgpt-session-1e10": (
        "burstgpt",
        _BURSTGPT_HEADER + "0,5,8,s\n1,10000000000,5,s\n",
        3,
        "Request tokens",
    ),
    "burstgpt-output": ("burstgpt", _BURSTGPT_HEADER + f"0,5,{MAX_TOKENS + 1},s\n", 2, "Response tokens"),
    "azure": (
        "azure",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,1e10,5\n",
        2,
        "ContextTokens",
    ),
    "native-session": (
        "native",
        _NATIVE_HEADER + '{"t":0,"input_tokens":10000000000,"output_tokens":1,"session":"s"}\n',
        2,
        "input_tokens",
    ),
    "mooncake-301-digits": (
        "mooncake",
        f'{{"timestamp":0,"input_length":{10**300},"output_length":1}}\n',
        1,
        "input_length",
    ),
    "bailian-session": (
        "bailian",
        _BAILIAN_ROW.format(1, -1, 1) + _BAILIAN_ROW.format(2, 1, MAX_TOKENS + 1),
        2,
        "input_length",
    ),
    "sharegpt-output": ("sharegpt", '{"prompt":"hi","output_tokens":10000000000}\n', 1, "output_tokens"),
}


@pytest.mark.parametrize("case", sorted(_HUGE_COUNTS))
def test_huge_token_counts_are_refused_cleanly(case: str, tmp_path: Path) -> None:
    fmt, content, line, key = _HUGE_COUNTS[case]
    path = tmp_path / "trace"
    path.write_text(content)
    as_formats: tuple[TraceFormat, ...] = (fmt, "auto")
    for as_format in as_formats:
        with pytest.raises(InputError) as info:
            open_trace(TraceConfig(path=str(path), format=as_format), Path, 7)
        err = info.value
        assert (err.file, err.line, err.key) == (str(path), line, key)
        assert err.reason.startswith(f"must be <= {MAX_TOKENS} (more tokens than any model's context), got ")


def test_token_counts_up_to_the_bound_are_read(tmp_path: Path) -> None:
    path = tmp_path / "n.jsonl"
    path.write_text(_NATIVE_HEADER + f'{{"t":0,"input_tokens":{MAX_TOKENS},"output_tokens":{MAX_TOKENS}}}\n')
    (spec,) = open_trace(TraceConfig(path=str(path)), Path, 7)
    assert (spec.input_tokens, spec.output_tokens) == (MAX_TOKENS, MAX_TOKENS)


def _nested_conversation(levels: int) -> str:
    """A conversation whose extra field reaches `levels` of nesting, the enclosing array counted."""
    # The array is level 1 and the object level 2, so the field's brackets start at level 3.
    brackets = levels - 2
    return f'{{{_TWO_TURNS},"x":{"[" * brackets}{"]" * brackets}}}'


def test_sharegpt_array_nesting_up_to_the_bound_is_read(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(f"[{_nested_conversation(MAX_DEPTH)}]")
    assert len(list(open_trace(TraceConfig(path=str(path)), Path, 7))) == 2


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 100_000])
def test_sharegpt_array_element_nested_too_deep_is_a_bad_row(levels: int, tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(f"[{_nested_conversation(3)},{_nested_conversation(levels)},{_nested_conversation(3)}]")
    with pytest.raises(InputError) as info:
        open_trace(TraceConfig(path=str(path)), Path, 7)
    assert (info.value.key, info.value.reason) == (
        "[1]",
        f"nested more than {MAX_DEPTH} levels deep (a conversation is 4)",
    )
    # The parser skips the element and reads on: the rows after it are kept with skip_bad_rows.
    trace = open_trace(TraceConfig(path=str(path), skip_bad_rows=True), Path, 7)
    assert (trace.summary.requests, trace.summary.bad_rows) == (4, 1)


@pytest.mark.parametrize(
    ("row", "count", "key"),
    [
        # Each message within the bound, the conversation before the reply ([1]) past it.
        (f'{{"id":"c",{_TWO_TURNS}}}', MAX_TOKENS // 2 + 1, "conversations[1].value"),
        ('{"prompt":"x"}', MAX_TOKENS + 1, "prompt"),
    ],
)
def test_sharegpt_counted_tokens_past_the_bound_are_refused(row: str, count: int, key: str) -> None:
    # A text long enough to count past MAX_TOKENS (134 MB) is too big for a test: the counter says so.
    opts = sharegpt.Options(ArrivalConfig(), 7, 16, lambda text: count)
    (item,) = sharegpt.read(io.BufferedReader(io.BytesIO(f"{row}\n".encode())), "s.jsonl", opts)
    assert isinstance(item, InputError)
    assert (item.line, item.key) == (1, key)
    assert item.reason.startswith(f"must be <= {MAX_TOKENS} ")
