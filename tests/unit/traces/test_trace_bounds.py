"""Memory bounds of the trace readers: tiny crafted files must not make soakd build gigabytes.

Each hostile file runs through `soakd trace inspect` in its own process, whose peak RSS is read, once it
has exited, by the small process that started it (soakd.testing.measured): it must stay under
500 MB, and bad input must end with exit code 2 and one line naming the file, line and key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import soakd
from soakd.config import TraceConfig
from soakd.errors import EXIT_INPUT, EXIT_OK
from soakd.testing import PEAK_RSS_LIMIT_MB, PeakRss, measured
from soakd.traces import loader, open_trace
from soakd.traces.loader import MAX_CHAIN_BLOCKS, MAX_HELD_IDS, MIN_MADE_UP_IDS, _Spans

RSS_LIMIT_MB = PEAK_RSS_LIMIT_MB
HANG_GUARD_S = 600  # only a hang guard for a busy 2-core machine, never a performance threshold
DAEMON = Path(soakd.__file__).resolve().parents[1]


def _inspect(path: str, *flags: str) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, peak RSS in MB) of `soakd trace inspect` in a child process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DAEMON), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        rss = Path(tmp) / "maxrss"
        argv = measured([sys.executable, "-m", "soakd", "trace", "inspect", path, *flags], rss)
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"trace inspect {path} still running after {HANG_GUARD_S} s")
        return proc.returncode, stdout, stderr, PeakRss.read(rss).mb


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    return path


_HEADER_1 = {"format": "soakd-trace", "version": 1, "block_size": 1}
_BIG = 1 << 25


def _native_sessions(p: Path) -> Path:
    # The reported case: five session rows of 2**25 tokens in blocks of 1 (was past 9 GB).
    rows = [{"t": i, "input_tokens": _BIG, "output_tokens": 1, "session": str(i)} for i in range(5)]
    return _jsonl(p / "t.jsonl", [_HEADER_1, *rows])


def _native_many_at_cap(p: Path) -> Path:
    # Every row just within the per-turn cap: the whole-trace budget of made-up ids ends it.
    n = MIN_MADE_UP_IDS // MAX_CHAIN_BLOCKS + 2
    rows = [
        {"t": 0, "input_tokens": MAX_CHAIN_BLOCKS, "output_tokens": 1, "session": str(i)} for i in range(n)
    ]
    return _jsonl(p / "t.jsonl", [_HEADER_1, *rows])


def _native_one_session(p: Path) -> Path:
    # Turns of one session at the cap: each shares the last one's blocks, yet each builds them again.
    n = MIN_MADE_UP_IDS // MAX_CHAIN_BLOCKS + 2
    rows = [{"t": i, "input_tokens": MAX_CHAIN_BLOCKS, "output_tokens": 1, "session": "s"} for i in range(n)]
    return _jsonl(p / "t.jsonl", [_HEADER_1, *rows])


def _native_sorted(p: Path) -> Path:
    # Backwards timestamps read with --sort: the sorted trace is held, and its made-up ids are bounded.
    n = MAX_HELD_IDS // MAX_CHAIN_BLOCKS + 2
    rows = [
        {"t": n - i, "input_tokens": MAX_CHAIN_BLOCKS, "output_tokens": 1, "session": str(i)}
        for i in range(n)
    ]
    return _jsonl(p / "t.jsonl", [_HEADER_1, *rows])


def _burstgpt(p: Path) -> Path:
    # The reported case: session rows of 2**25 tokens at the default block size of 16 (was ~700 MB).
    lines = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Session ID"]
    lines += [f"{i},m,{_BIG},1,{_BIG + 1},Conversation log,{i}" for i in range(4)]
    path = p / "t.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _bailian(p: Path) -> Path:
    # Turns of one chat without hash_ids: the loader would make up their prefix blocks.
    rows = [
        {
            "chat_id": i,
            "parent_chat_id": i - 1 if i else -1,
            "timestamp": i,
            "input_length": _BIG,
            "output_length": 1,
        }
        for i in range(4)
    ]
    return _jsonl(p / "t.jsonl", rows)


def _mooncake(p: Path) -> Path:
    # A huge prompt claimed with a single block id.
    rows = [{"timestamp": 0, "input_length": _BIG, "output_length": _BIG, "hash_ids": [0]}]
    return _jsonl(p / "t.jsonl", rows)


def _azure(p: Path) -> Path:
    path = p / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,1e300,1\n")
    return path


def _sharegpt(p: Path) -> Path:
    # Many assistant turns of one conversation: each turn's prompt is the whole conversation so far.
    messages = [{"from": "human", "value": "x" * 64}, {"from": "gpt", "value": "y"}] * 40
    messages.insert(0, {"from": "human", "value": "z" * 30_000})
    return _jsonl(p / "t.jsonl", [{"id": "c", "conversations": messages}])


def _sharegpt_bad(p: Path) -> Path:
    return _jsonl(p / "t.jsonl", [{"prompt": "x", "output_tokens": _BIG + 1}])


# (name, builder, extra flags, expected exit code, the line the error names, the key it names)
HOSTILE: list[tuple[str, Any, tuple[str, ...], int, int | None, str | None]] = [
    ("native-sessions", _native_sessions, (), EXIT_INPUT, 2, "input_tokens"),
    (
        "native-many-at-cap",
        _native_many_at_cap,
        (),
        EXIT_INPUT,
        MIN_MADE_UP_IDS // MAX_CHAIN_BLOCKS + 2,
        "input_tokens",
    ),
    (
        "native-one-session",
        _native_one_session,
        (),
        EXIT_INPUT,
        MIN_MADE_UP_IDS // MAX_CHAIN_BLOCKS + 2,
        "input_tokens",
    ),
    ("native-sorted", _native_sorted, ("--sort",), EXIT_INPUT, None, "input_tokens"),
    ("burstgpt-sessions", _burstgpt, (), EXIT_INPUT, 2, "Request tokens"),
    ("bailian-sessions", _bailian, (), EXIT_INPUT, 1, "input_length"),
    ("mooncake-one-block", _mooncake, (), EXIT_INPUT, 1, "hash_ids"),
    ("azure-huge-count", _azure, (), EXIT_INPUT, 2, "ContextTokens"),
    ("sharegpt-turns", _sharegpt, (), EXIT_OK, None, None),
    ("sharegpt-huge-output", _sharegpt_bad, (), EXIT_INPUT, 1, "output_tokens"),
]


@pytest.mark.parametrize(
    ("name", "build", "flags", "code", "line", "key"), HOSTILE, ids=[h[0] for h in HOSTILE]
)
def test_hostile_trace_stays_within_memory(
    tmp_path: Path,
    name: str,
    build: Any,
    flags: tuple[str, ...],
    code: int,
    line: int | None,
    key: str | None,
) -> None:
    path = build(tmp_path)
    got, _, err, rss_mb = _inspect(str(path), *flags)
    PeakRss(0, rss_mb).note(f"trace/{name}")
    assert rss_mb < RSS_LIMIT_MB, f"{name}: peak RSS {rss_mb:.0f} MB"
    assert got == code, err
    if code == EXIT_INPUT:
        assert "Traceback" not in err, err
        errors = [e for e in err.splitlines() if e.startswith("soakd: error:")]  # log lines may precede it
        assert len(errors) == 1, err
        where = f"{path}:{line}:" if line is not None else f"{path}:"
        assert where in errors[0], err
        assert f" {key}: " in errors[0], err


@pytest.mark.parametrize("trace", ["bundled:multiturn", "bundled:demo"])
def test_bundled_traces_still_load(trace: str) -> None:
    code, out, err, rss_mb = _inspect(trace, "--json")
    assert code == EXIT_OK, err
    assert json.loads(out)["requests"] > 0
    assert rss_mb < RSS_LIMIT_MB


def test_spans_count_distinct_ids() -> None:
    spans = _Spans()
    spans.add_all([10, 11, 12, 20])
    spans.add_all([12, 13, 19])  # touches both runs: merged into 10..13 and 19..20
    spans.add_all([5])
    spans.add_all(range(14, 19))  # fills the gap: one run 10..20
    assert spans.count == len({10, 11, 12, 13, 19, 20, 5, *range(14, 19)})
    spans.add_all([])
    assert spans.count == 12


def _open_native(path: Path, rows: list[dict[str, Any]]) -> list[Any]:
    _jsonl(path, [{"format": "soakd-trace", "version": 1, "block_size": 4}, *rows])
    trace = open_trace(TraceConfig(path=str(path)), Path, 0)
    return [trace.summary, *trace]


def test_session_prefixes_and_their_count_stay_exact(tmp_path: Path) -> None:
    rows = [
        {"t": 0, "input_tokens": 8, "output_tokens": 1, "session": "a"},
        {"t": 1, "input_tokens": 8, "output_tokens": 1, "session": "b"},
        {"t": 2, "input_tokens": 16, "output_tokens": 1, "session": "a"},
    ]
    summary, a1, b1, a2 = _open_native(tmp_path / "t.jsonl", rows)
    assert a2.hash_ids[:2] == a1.hash_ids and not set(a2.hash_ids) & set(b1.hash_ids)
    assert summary.unique_blocks == len({*a1.hash_ids, *b1.hash_ids, *a2.hash_ids}) == 6


def test_a_session_past_the_remembered_ids_starts_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "_CHAIN_IDS_KEPT", 3)
    rows = [
        {"t": 0, "input_tokens": 8, "output_tokens": 1, "session": "a"},
        {"t": 1, "input_tokens": 8, "output_tokens": 1, "session": "b"},  # 4 ids kept: a is forgotten
        {"t": 2, "input_tokens": 8, "output_tokens": 1, "session": "a"},
    ]
    summary, a1, _, a2 = _open_native(tmp_path / "t.jsonl", rows)
    assert not set(a1.hash_ids) & set(a2.hash_ids)
    assert summary.unique_blocks == 6


def test_a_traces_own_large_ids_are_counted_as_its_own(tmp_path: Path) -> None:
    big = 1 << 60  # above the made-up ids' base: told apart by where they come from, not by size
    rows = [
        {"t": 0, "input_tokens": 8, "output_tokens": 1, "hash_ids": [big, big + 7]},
        {"t": 1, "input_tokens": 8, "output_tokens": 1, "hash_ids": [big, big + 9], "session": "a"},
        {"t": 2, "input_tokens": 8, "output_tokens": 1, "session": "b"},
    ]
    summary, _, also_own, made_up = _open_native(tmp_path / "t.jsonl", rows)
    assert also_own.hash_ids == (big, big + 9) and len(made_up.hash_ids) == 2
    assert summary.unique_blocks == 5
