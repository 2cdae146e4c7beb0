"""Trace reading: native and Mooncake parsing, detection, every error kind, summaries, synthesis."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import ValidationError

from soakd.config import BUNDLED_TRACES, ArrivalConfig, SyntheticTraceConfig, TraceConfig
from soakd.errors import TraceError
from soakd.traces import RequestSpec, Trace, open_trace, synthesize, write_native
from soakd.traces.loader import DEMO_RESOURCE

REPO = Path(__file__).resolve().parents[3]
Format = Literal["auto", "native", "mooncake", "synthetic"]
HEADER = {"format": "soakd-trace", "version": 1, "block_size": 4}


def _write(path: Path, rows: list[Any]) -> Path:
    """One line per row: dicts as JSON, strings verbatim (for blank or broken lines)."""
    text = "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    path.write_text(text, encoding="utf-8")
    return path


def _open(path: Path, fmt: Format = "auto", seed: int = 0) -> Trace:
    return open_trace(TraceConfig(path=str(path), format=fmt), Path, seed)


def _error(path: Path, fmt: Format = "auto") -> str:
    with pytest.raises(TraceError) as info:
        _open(path, fmt)
    return str(info.value)


# --- parsing ----------------------------------------------------------------------------------------


def test_native_parses_every_field_and_counts_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [
            HEADER,
            {"t": 1.5, "input_tokens": 6, "output_tokens": 3, "hash_ids": [7, 8]},
            "",
            {"t": 2.0, "input_tokens": 4, "output_tokens": 1, "session": "c1", "turn": 2},
            {"t": 2.0, "input_tokens": 9, "output_tokens": 5, "hash_ids": []},
        ],
    )
    trace = _open(path)
    assert trace.summary.format == "native"
    assert list(trace) == [
        RequestSpec(0, 0.0, 6, 3, 4, (7, 8), line=2),
        RequestSpec(1, 0.5, 4, 1, 4, (1 << 48,), session="c1", turn=2, line=4),
        RequestSpec(2, 0.5, 9, 5, 4, (), line=5),
    ]


def test_mooncake_parses_ms_timestamps_and_512_blocks(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "m.jsonl",
        [
            {"timestamp": 1000, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
            {"timestamp": 1250, "input_length": 512, "output_length": 7, "hash_ids": [1], "extra": "ok"},
            {"timestamp": 4000, "input_length": 10, "output_length": 1},
        ],
    )
    specs = list(_open(path, "mooncake"))
    assert specs == [
        RequestSpec(0, 0.0, 600, 20, 512, (1, 2), line=1),
        RequestSpec(1, 0.25, 512, 7, 512, (1,), line=2),
        RequestSpec(2, 3.0, 10, 1, 512, (), line=3),
    ]


def test_auto_detects_each_format(tmp_path: Path) -> None:
    native_path = _write(tmp_path / "n.jsonl", [HEADER, {"t": 0, "input_tokens": 1, "output_tokens": 1}])
    mooncake_path = _write(
        tmp_path / "m.jsonl", [{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}]
    )
    assert _open(native_path).summary.format == "native"
    assert _open(mooncake_path).summary.format == "mooncake"


def test_auto_detection_rejects_an_unknown_first_row(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.jsonl", ["", {"text": "hi", "time": 0}])
    assert _error(path).startswith(f"{path}:2: cannot tell the format")


def test_summary_totals_blocks_and_digest(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "m.jsonl",
        [
            {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
            {"timestamp": 500, "input_length": 700, "output_length": 10, "hash_ids": [1, 3]},
            {"timestamp": 2500, "input_length": 100, "output_length": 5, "hash_ids": [1]},
        ],
    )
    s = _open(path).summary
    assert (s.path, s.format, s.requests, s.span_s) == (str(path), "mooncake", 3, 2.5)
    assert (s.input_tokens, s.output_tokens, s.block_size) == (1400, 35, 512)
    assert s.unique_blocks == 3
    assert s.block_reuse_ratio == pytest.approx(1 - 3 / 5)
    assert s.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_summary_without_blocks_has_zero_reuse(tmp_path: Path) -> None:
    path = _write(tmp_path / "n.jsonl", [HEADER, {"t": 0, "input_tokens": 3, "output_tokens": 1}])
    s = _open(path).summary
    assert (s.unique_blocks, s.block_reuse_ratio) == (0, 0.0)


def test_relative_path_goes_through_resolve(tmp_path: Path) -> None:
    _write(tmp_path / "n.jsonl", [HEADER, {"t": 0, "input_tokens": 3, "output_tokens": 1}])
    trace = open_trace(TraceConfig(path="n.jsonl"), lambda p: tmp_path / p, 0)
    assert trace.summary.path == str(tmp_path / "n.jsonl")


def test_reiterating_gives_the_same_specs(tmp_path: Path) -> None:
    rows: list[Any] = [HEADER] + [
        {"t": i * 0.1, "input_tokens": i + 1, "output_tokens": 2, "hash_ids": list(range(i // 4 + 1))}
        for i in range(20)
    ]
    trace = _open(_write(tmp_path / "n.jsonl", rows))
    first = list(trace)
    assert len(first) == 20
    assert list(trace) == first


def test_iterating_a_file_rewritten_after_validation_fails(tmp_path: Path) -> None:
    path = _write(tmp_path / "n.jsonl", [HEADER, {"t": 0, "input_tokens": 3, "output_tokens": 1}])
    trace = _open(path)
    _write(path, [HEADER, {"t": 0, "input_tokens": 3, "output_tokens": 1}, {"x": 1}])
    with pytest.raises(TraceError, match="changed since it was validated"):
        list(trace)


def test_touching_the_file_does_not_count_as_a_change(tmp_path: Path) -> None:
    path = _write(tmp_path / "n.jsonl", [HEADER, {"t": 0, "input_tokens": 3, "output_tokens": 1}])
    trace = _open(path)
    os.utime(path, (1, 1))
    assert len(list(trace)) == 1


# --- errors -----------------------------------------------------------------------------------------

N_OK = {"t": 0, "input_tokens": 4, "output_tokens": 1}
M_OK = {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # (rows of the file, expected message after "FILE:")
        ([HEADER, N_OK, "{not json"], "3: not JSON"),
        ([HEADER, N_OK, "[1, 2]"], "3: expected a JSON object, got list"),
        ([HEADER, {"t": 0, "output_tokens": 1}], "2: input_tokens: missing field"),
        ([HEADER, {"t": "0", "input_tokens": 4, "output_tokens": 1}], "2: t: expected a number"),
        ([HEADER, {"t": 0, "input_tokens": 4.5, "output_tokens": 1}], "2: input_tokens: expected an integer"),
        (
            [HEADER, {"t": 0, "input_tokens": True, "output_tokens": 1}],
            "2: input_tokens: expected an integer",
        ),
        ([HEADER, {"t": 0, "input_tokens": 0, "output_tokens": 1}], "2: input_tokens: must be >= 1, got 0"),
        (
            [HEADER, {"t": 0, "input_tokens": 4, "output_tokens": -2}],
            "2: output_tokens: must be >= 1, got -2",
        ),
        ([HEADER, {"t": -1, "input_tokens": 4, "output_tokens": 1}], "2: t: must be >= 0"),
        (
            [HEADER, N_OK, '{"t": NaN, "input_tokens": 4, "output_tokens": 1}'],
            "3: t: expected a finite number",
        ),
        ([HEADER, {**N_OK, "hash_ids": [1, 2]}], "2: hash_ids: has 2 block ids but input_tokens=4 needs"),
        ([HEADER, {**N_OK, "hash_ids": "1"}], "2: hash_ids: expected a list of integers"),
        ([HEADER, {**N_OK, "hash_ids": [-1]}], "2: hash_ids: block ids must be >= 0"),
        ([HEADER, {**N_OK, "session": 3}], "2: session: expected a string"),
        ([HEADER, {**N_OK, "turn": -1}], "2: turn: must be >= 0"),
        ([HEADER, {**N_OK, "inputs_tokens": 4}], "2: inputs_tokens: unknown field"),
        ([HEADER, {**N_OK, "t": 5}, "", {**N_OK, "t": 4.5}], "4: t: timestamp goes backwards (4.5 s < 5 s)"),
        ([{**HEADER, "version": 2}, N_OK], "1: version: unsupported version 2"),
        ([{**HEADER, "format": "other"}, N_OK], "1: format: expected 'soakd-trace'"),
        ([{**HEADER, "blocksize": 4}, N_OK], "1: blocksize: unknown header field"),
        ([{"format": "soakd-trace", "version": 1}, N_OK], "1: block_size: missing field"),
        (
            [M_OK, {**M_OK, "input_length": 600, "hash_ids": [1]}],
            "2: hash_ids: has 1 block ids but input_length",
        ),
        ([M_OK, {**M_OK, "output_length": 0}], "2: output_length: must be >= 1, got 0"),
        ([M_OK, {**M_OK, "input_length": "4"}], "2: input_length: expected an integer, got string"),
        (
            [{**M_OK, "timestamp": 3600000}, {**M_OK, "timestamp": 3599999}],
            "2: timestamp: timestamp goes backwards (3599.999 s < 3600 s)",
        ),
    ],
)
def test_each_bad_row_names_file_line_and_field(tmp_path: Path, rows: list[Any], expected: str) -> None:
    path = _write(tmp_path / "bad.jsonl", rows)
    assert _error(path).startswith(f"{path}:{expected}")


def test_bad_row_fails_at_open_even_late_in_the_file(tmp_path: Path) -> None:
    rows: list[Any] = (
        [HEADER] + [{**N_OK, "t": i} for i in range(500)] + [{**N_OK, "t": 500, "output_tokens": 0}]
    )
    path = _write(tmp_path / "late.jsonl", rows)
    assert _error(path) == f"{path}:502: output_tokens: must be >= 1, got 0"


def test_explicit_format_that_does_not_match(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.jsonl", [M_OK])
    assert _error(path, "native").startswith(f"{path}:1: format: expected the header")
    native_path = _write(tmp_path / "n.jsonl", [HEADER, N_OK])
    assert _error(native_path, "mooncake") == f"{native_path}:1: timestamp: missing field"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    assert _error(path) == f"{path}: cannot read: No such file or directory"


@pytest.mark.parametrize("rows", [[], ["", "  "], [HEADER], [HEADER, ""]])
def test_empty_trace(tmp_path: Path, rows: list[Any]) -> None:
    path = _write(tmp_path / "e.jsonl", rows)
    assert _error(path) == f"{path}: empty trace (no requests)"


def test_non_utf8_line(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    path.write_bytes(json.dumps(HEADER).encode() + b"\n" + b'{"t": "\xff"}\n')
    assert _error(path) == f"{path}:2: not UTF-8 text"


# --- bundled demo -----------------------------------------------------------------------------------


def test_bundled_demo_trace_opens_with_reuse() -> None:
    trace = open_trace(TraceConfig(), lambda p: Path("/nonexistent") / p, 0)
    s = trace.summary
    assert s.path.endswith(DEMO_RESOURCE)
    assert s.format == "mooncake"
    assert 200 <= s.requests <= 280
    assert 100.0 <= s.span_s <= 120.0
    assert 0.3 < s.block_reuse_ratio < 0.8
    specs = list(trace)
    assert all(64 <= x.input_tokens <= 900 and 16 <= x.output_tokens <= 128 for x in specs)
    shared = sum(1 for x in specs if x.hash_ids[0] < 4)
    assert 0.45 < shared / len(specs) < 0.75


def _run_script(name: str, out: Path) -> bytes:
    """What scripts/NAME writes to `out` (the generator of a bundled trace)."""
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), "--out", str(out)], check=True, capture_output=True
    )
    assert out.stat().st_mode & 0o777 == 0o644  # package data: readable by the service's user too
    return out.read_bytes()


def test_bundled_demo_trace_is_what_the_script_writes(tmp_path: Path) -> None:
    bundled = REPO / "daemon" / "soakd" / DEMO_RESOURCE
    written = _run_script("make_demo_trace.py", tmp_path / "demo.jsonl")
    assert written == bundled.read_bytes(), "rerun scripts/make_demo_trace.py"
    # One Mooncake object per line, nothing else.
    first = json.loads(bundled.read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}


# --- synthesis --------------------------------------------------------------------------------------


def test_synthesize_is_deterministic_per_seed() -> None:
    cfg = SyntheticTraceConfig(duration=30.0)
    arr = ArrivalConfig(rate_rps=5.0)
    assert synthesize(cfg, arr, 1) == synthesize(cfg, arr, 1)
    assert synthesize(cfg, arr, 1) != synthesize(cfg, arr, 2)
    assert synthesize(cfg, arr, -1) != synthesize(cfg, arr, 1)


def test_synthesize_rate_lengths_and_prefixes() -> None:
    cfg = SyntheticTraceConfig(
        duration=100.0,
        input_tokens_mean=300,
        input_tokens_max=1000,
        output_tokens_mean=50,
        output_tokens_max=80,
        prefix_share=0.5,
        prefix_blocks=2,
        block_size=128,
    )
    specs = synthesize(cfg, ArrivalConfig(rate_rps=20.0), 7)
    # 1 + Poisson(2000): sd ~45, so +-300 is more than 6 sd.
    assert 1700 <= len(specs) <= 2300
    arrivals = [s.arrival_s for s in specs]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] < 100.0
    assert [s.index for s in specs] == list(range(len(specs)))
    assert all(1 <= s.input_tokens <= 1000 and 1 <= s.output_tokens <= 80 for s in specs)
    # Clipping pulls the mean down a little; the lognormal still centres on the configured mean.
    assert 250 < sum(s.input_tokens for s in specs) / len(specs) < 320
    assert all(len(s.hash_ids) == -(-s.input_tokens // 128) for s in specs)
    pool = range(4 * 2)
    with_prefix = [s for s in specs if s.hash_ids[0] in pool]
    assert 0.4 < len(with_prefix) / len(specs) < 0.6
    # A shared prefix is a whole system prompt's first blocks, in order.
    for s in with_prefix:
        head = s.hash_ids[: min(2, len(s.hash_ids))]
        assert head == tuple(range(head[0], head[0] + len(head))) and head[0] % 2 == 0
    # Every block outside the pool is used once.
    rest = [b for s in specs for b in s.hash_ids if b not in pool]
    assert len(rest) == len(set(rest))


def test_open_trace_synthetic_ignores_path_and_hashes_its_native_form(tmp_path: Path) -> None:
    cfg = SyntheticTraceConfig(duration=20.0, block_size=64)
    arr = ArrivalConfig(rate_rps=3.0)
    trace = open_trace(
        TraceConfig(path="does/not/exist", format="synthetic", synthetic=cfg, arrivals=arr), Path, 5
    )
    specs = synthesize(cfg, arr, 5)
    assert list(trace) == specs
    assert list(trace) == specs
    s = trace.summary
    assert (s.format, s.requests, s.block_size) == ("synthetic", len(specs), 64)
    assert s.span_s == specs[-1].arrival_s
    assert s.block_reuse_ratio > 0
    out = tmp_path / "s.jsonl"
    write_native(out, specs, 64)
    assert s.sha256 == hashlib.sha256(out.read_bytes()).hexdigest()


# --- writing ----------------------------------------------------------------------------------------


def test_write_native_round_trip(tmp_path: Path) -> None:
    specs = [
        RequestSpec(0, 0.0, 10, 3, 4, (1, 2, 3)),
        RequestSpec(1, 0.123456789, 4, 1, 4, (), session="s", turn=1),
        RequestSpec(2, 7.5, 5, 2, 4, (1, 9), session="s", turn=2),
    ]
    out = tmp_path / "out.jsonl"
    write_native(out, specs, 4)
    got = list(_open(out))
    # A session turn without block ids of its own gets chained ones on reading (see loader._specs).
    chained = replace(specs[1], hash_ids=(1 << 48,))
    assert got == [replace(s, line=s.index + 2) for s in [specs[0], chained, specs[2]]]
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_write_native_refuses_bad_specs_and_keeps_the_old_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    with pytest.raises(ValueError, match="hash_ids"):
        write_native(out, [RequestSpec(0, 0.0, 10, 3, 4, (1,))], 4)
    with pytest.raises(ValueError, match="backwards"):
        write_native(out, [RequestSpec(0, 1.0, 1, 1, 4), RequestSpec(1, 0.5, 1, 1, 4)], 4)
    assert out.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


# --- bundled multi-turn trace ---------------------------------------------------------------------


def test_bundled_multiturn_trace_has_sessions_reuse_and_a_quiet_minute() -> None:
    trace = open_trace(TraceConfig(path="bundled:multiturn"), lambda p: Path("/nonexistent") / p, 0)
    s = trace.summary
    assert s.format == "native" and s.block_size == 16
    assert 7000 <= s.requests <= 9000 and 530.0 <= s.span_s <= 540.0
    assert s.sessions > 1000
    assert s.block_reuse_ratio > 0.5
    arrivals = [x.arrival_s for x in trace]
    # Nothing arrives in the quiet minute the re-capture policy waits for; both sides are busy.
    assert not [t for t in arrivals if 300.0 <= t < 360.0]
    assert sum(1 for t in arrivals if 240.0 <= t < 300.0) > 600
    assert sum(1 for t in arrivals if 360.0 <= t < 420.0) > 600
    # Later turns carry their conversation's history: the prompt starts with the previous turn's blocks.
    by_session: dict[str, list[tuple[int, ...]]] = {}
    for x in trace:
        if x.session:
            by_session.setdefault(x.session, []).append(x.hash_ids)
    grown = [h for h in by_session.values() if len(h) > 1 and len(h[0]) < 128]
    assert grown and all(h[1][: len(h[0])] == h[0] for h in grown)


def test_bundled_multiturn_trace_is_what_the_script_writes(tmp_path: Path) -> None:
    bundled = REPO / "daemon" / "soakd" / BUNDLED_TRACES["multiturn"]
    written = _run_script("make_multiturn_trace.py", tmp_path / "multiturn.jsonl.gz")
    assert written == bundled.read_bytes(), "rerun scripts/make_multiturn_trace.py"


def test_an_unknown_bundled_trace_is_refused_by_the_config() -> None:
    with pytest.raises(ValidationError, match="no bundled trace 'bundled:nope'"):
        TraceConfig(path="bundled:nope")
