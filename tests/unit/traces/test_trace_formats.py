"""The public trace formats, bad-row handling, sorting, session chaining, transforms and arrival processes."""

from __future__ import annotations

import gzip
import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from soakd.config import ArrivalConfig, ReplayConfig, SyntheticTraceConfig, TraceConfig
from soakd.errors import TraceError
from soakd.traces import open_trace, synthesize
from soakd.traces.arrivals import arrivals_until
from soakd.traces.azure import TimestampParser
from soakd.traces.loader import Trace
from soakd.traces.model import RequestSpec


def _open(path: Path, fmt: str = "auto", replay: ReplayConfig | None = None, **kw: Any) -> Trace:
    return open_trace(TraceConfig(path=str(path), format=fmt, **kw), Path, 3, replay)  # type: ignore[arg-type]


def _error(path: Path, fmt: str = "auto", **kw: Any) -> str:
    with pytest.raises(TraceError) as info:
        _open(path, fmt, **kw)
    return str(info.value)


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --- Bailian ----------------------------------------------------------------------------------------


def _bailian(
    chat: int, parent: int, t: float, inp: int, out: int, turn: int, ids: list[int]
) -> dict[str, Any]:
    return {
        "chat_id": chat,
        "parent_chat_id": parent,
        "timestamp": t,
        "input_length": inp,
        "output_length": out,
        "type": "text",
        "turn": turn,
        "hash_ids": ids,
    }


def test_bailian_turns_become_sessions_named_after_the_first_chat(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "b.jsonl",
        [
            _bailian(10, -1, 100.5, 20, 5, 1, [1, 2]),
            _bailian(11, -1, 101.0, 16, 4, 1, [9]),
            _bailian(12, 10, 103.25, 40, 6, 2, [1, 2, 3]),
            _bailian(13, 12, 110.0, 50, 7, 3, [1, 2, 3, 4]),
        ],
    )
    trace = _open(path)
    specs = list(trace)
    assert trace.summary.format == "bailian"
    assert [s.arrival_s for s in specs] == [0.0, 0.5, 2.75, 9.5]
    assert [s.session for s in specs] == ["10", "11", "10", "10"]
    assert [s.turn for s in specs] == [1, 1, 2, 3]
    assert all(s.block_size == 16 for s in specs)
    assert specs[3].hash_ids == (1, 2, 3, 4)
    assert trace.summary.sessions == 1 and trace.summary.turns_max == 3


def test_bailian_checks_block_ids_at_16_tokens(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "b.jsonl", [_bailian(1, -1, 0, 40, 5, 1, [1, 2])])
    assert _error(path) == f"{path}:1: hash_ids: has 2 block ids but input_length=40 needs ceil(40/16) = 3"


# --- Azure ------------------------------------------------------------------------------------------


def test_azure_2023_naive_timestamps_with_seven_fractional_digits(tmp_path: Path) -> None:
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:16:01.0000000,879,0\n"
        "2023-11-16 18:16:02,200,12\n"
    )
    trace = _open(path)
    specs = list(trace)
    assert trace.summary.format == "azure"
    assert [s.input_tokens for s in specs] == [374, 396, 200]
    assert specs[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert specs[2].arrival_s == pytest.approx(15.31941, abs=1e-6)
    assert trace.summary.skipped_rows == {"0 generated tokens": 1}


def test_azure_2024_offsets_and_mixed_precision_and_2025_images(tmp_path: Path) -> None:
    path = tmp_path / "a24.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,10,1\n"
        "2024-05-10 00:00:01+00:00,10,1\n"
        "2024-05-10 02:00:01.5+02:00,10,1\n"
    )
    assert [s.arrival_s for s in _open(path)] == pytest.approx([0.0, 0.99007, 1.49007])
    lmm = tmp_path / "lmm.csv"
    lmm.write_text(
        "TIMESTAMP,NumImages,ContextTokens,GeneratedTokens\n"
        "2025-03-01T00:00:00.123Z,2,1500,30\n"
        "2025-03-01T00:00:01.000Z,0,20,3\n"
    )
    specs = list(_open(lmm))
    assert [s.images for s in specs] == [2, 0]
    assert specs[1].arrival_s == pytest.approx(0.877)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("2023-11-16 18:15:46.6805900", True),
        ("2023-11-16T18:15:46Z", True),
        ("2023-11-16 18:15:46.", False),
        ("2023-11-16", False),
        ("2023-11-16 18:15:46+5", False),
        ("16/11/2023 18:15:46", False),
    ],
)
def test_azure_timestamp_spellings(text: str, ok: bool) -> None:
    parse = TimestampParser()
    if ok:
        assert parse(text) == pytest.approx(1700158546.68059 if "." in text else 1700158546.0)
    else:
        with pytest.raises(ValueError):
            parse(text)


def test_azure_bad_rows_name_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,1\n2023-11-16 18:15:47,ten,1\n"
    )
    assert _error(path) == f"{path}:3: ContextTokens: expected an integer, got 'ten'"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,1\n")
    assert _error(path).startswith(f"{path}:2: TIMESTAMP: not a date and time: 'yesterday'")
    path.write_text("TIMESTAMP,Tokens\n2023-11-16 18:15:46,10\n")
    assert _error(path, "azure") == (
        f"{path}:1: header lacks ContextTokens, GeneratedTokens "
        "(expected TIMESTAMP,ContextTokens,GeneratedTokens[,NumImages])"
    )


# --- BurstGPT ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
        "Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Elapsed time",
    ],
)
def test_burstgpt_all_column_layouts(tmp_path: Path, header: str) -> None:
    cols = header.split(",")
    values = [
        {"Timestamp": "5", "Session ID": "a", "Request tokens": "472", "Response tokens": "18"},
        {"Timestamp": "45", "Session ID": "b", "Request tokens": "1087", "Response tokens": "0"},
        {"Timestamp": "118", "Session ID": "a", "Request tokens": "417", "Response tokens": "276"},
    ]
    filler = {
        "Model": "ChatGPT",
        "Total tokens": "490",
        "Log Type": "Conversation log",
        "Elapsed time": "3.2",
    }
    lines = [header] + [",".join({**filler, **v}[c] for c in cols) for v in values]
    path = tmp_path / "BurstGPT_1.csv"
    path.write_text("\n".join(lines) + "\n")
    trace = _open(path)
    specs = list(trace)
    assert trace.summary.format == "burstgpt"
    assert [(s.arrival_s, s.input_tokens, s.output_tokens) for s in specs] == [
        (0.0, 472, 18),
        (113.0, 417, 276),
    ]
    assert trace.summary.skipped_rows == {"failed request (0 response tokens)": 1}
    if "Session ID" in cols:
        assert [(s.session, s.turn) for s in specs] == [("a", 0), ("a", 1)]
        # The second turn's prompt opens with the first turn's blocks (16 tokens each, chained).
        assert specs[1].hash_ids[:26] == specs[0].hash_ids[:26] and len(specs[0].hash_ids) == 30
    else:
        assert all(s.session == "" and s.hash_ids == () for s in specs)


# --- ShareGPT / vLLM bench --------------------------------------------------------------------------


def _conv(cid: str, *turns: tuple[str, str]) -> dict[str, Any]:
    msgs = []
    for human, gpt in turns:
        msgs.append({"from": "human", "value": human})
        if gpt:
            msgs.append({"from": "gpt", "value": gpt})
    return {"id": cid, "conversations": msgs}


def test_sharegpt_array_turns_carry_the_conversation_and_get_generated_times(tmp_path: Path) -> None:
    convs = [
        _conv("c0", ("a" * 40, "b" * 80), ("c" * 20, "d" * 8)),
        _conv("c1", ("e" * 4, "f" * 4)),
        _conv("c2", ("g" * 4, "")),  # no reply: left out
        {
            "id": "c3",
            "conversations": [
                {"role": "system", "content": "s" * 8},
                {"role": "user", "content": "h"},
                {"role": "assistant", "content": "i" * 12},
            ],
        },
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs, indent=1))
    arrivals = ArrivalConfig(rate_rps=1.0, think_time=2.0)
    trace = _open(path, arrivals=arrivals)
    specs = list(trace)
    s = trace.summary
    assert (s.format, s.requests, s.sessions) == ("sharegpt", 4, 1)
    assert s.token_counts.startswith("estimated")
    assert s.skipped_rows == {"no assistant reply": 1}
    by_session = [x for x in specs if x.session == "c0"]
    assert [(x.input_tokens, x.output_tokens) for x in by_session] == [(10, 20), (35, 2)]
    assert by_session[1].hash_ids[: len(by_session[0].hash_ids)] == by_session[0].hash_ids
    assert [x.arrival_s for x in specs] == sorted(x.arrival_s for x in specs)
    single = [x for x in specs if not x.session]
    assert sorted((x.input_tokens, x.output_tokens) for x in single) == [(1, 1), (3, 3)]
    # The times are seeded: opening it again gives the same trace.
    assert list(_open(path, arrivals=arrivals)) == specs


def test_vllm_bench_prompt_rows_and_bad_items(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x" * 100, "output_tokens": 7}, {"prompt": "y" * 9}])
    specs = list(_open(path, default_output_tokens=33))
    assert [(s.input_tokens, s.output_tokens) for s in specs] == [(25, 7), (3, 33)]
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": "x", "output_tokens": 0}])
    assert _error(bad, "sharegpt") == f"{bad}:2: output_tokens: expected an integer >= 1"
    arr = tmp_path / "arr.json"
    arr.write_text(
        json.dumps([_conv("a", ("q", "r")), {"id": "b", "conversations": [{"from": "alien", "value": "?"}]}])
    )
    assert _error(arr) == f"{arr}: [1].conversations[0].from: unknown role 'alien'"


# --- bad rows, sorting, compression, detection ------------------------------------------------------


def _mooncake(ts: int, inp: int = 10, out: int = 2) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": inp, "output_length": out}


def test_skip_bad_rows_counts_them_and_strict_mode_stops_at_the_first(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "m.jsonl",
        [
            _mooncake(0),
            {"timestamp": 5, "input_length": 0, "output_length": 1},
            _mooncake(9),
            _mooncake(12, out=-1),
        ],
    )
    assert _error(path) == f"{path}:2: input_length: must be >= 1, got 0"
    trace = _open(path, skip_bad_rows=True)
    assert [s.line for s in trace] == [1, 3]
    assert trace.summary.bad_rows == 2 and trace.summary.requests == 2


def test_backwards_timestamps_fail_unless_sorted_on_request(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "m.jsonl", [_mooncake(1000), _mooncake(3000, inp=30), _mooncake(2000, inp=20)])
    assert _error(path) == (
        f"{path}:3: timestamp: timestamp goes backwards (2 s < 3 s); set trace.sort = true to sort on read"
    )
    trace = _open(path, sort=True)
    specs = list(trace)
    assert [(s.arrival_s, s.input_tokens, s.index) for s in specs] == [
        (0.0, 10, 0),
        (1.0, 20, 1),
        (2.0, 30, 2),
    ]
    assert trace.summary.sorted_on_read
    ordered = _jsonl(tmp_path / "o.jsonl", [_mooncake(0), _mooncake(5)])
    assert not _open(ordered, sort=True).summary.sorted_on_read


def test_gzip_traces_are_read_and_hashed_as_stored(tmp_path: Path) -> None:
    path = tmp_path / "t.csv.gz"
    raw = b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,1\n2023-11-16 18:15:48,12,2\n"
    path.write_bytes(gzip.compress(raw))
    import hashlib

    trace = _open(path)
    assert [s.arrival_s for s in trace] == [0.0, 2.0]
    assert trace.summary.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_auto_detection_per_format(tmp_path: Path) -> None:
    files = {
        "native": _jsonl(
            tmp_path / "n.jsonl",
            [
                {"format": "soakd-trace", "version": 1, "block_size": 4},
                {"t": 0, "input_tokens": 1, "output_tokens": 1},
            ],
        ),
        "mooncake": _jsonl(tmp_path / "m.jsonl", [_mooncake(0)]),
        "bailian": _jsonl(tmp_path / "b.jsonl", [_bailian(1, -1, 0, 16, 1, 1, [3])]),
        "sharegpt": _jsonl(tmp_path / "s.jsonl", [_conv("x", ("q", "r"))]),
    }
    (tmp_path / "bg.csv").write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,m,5,5,10,x\n"
    )
    files["burstgpt"] = tmp_path / "bg.csv"
    for fmt, path in files.items():
        assert _open(path).summary.format == fmt


# --- transforms -------------------------------------------------------------------------------------


def test_window_keeps_the_requests_inside_and_shifts_them_to_zero(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "m.jsonl", [_mooncake(ms) for ms in range(0, 10_000, 1000)])
    trace = _open(path, replay=ReplayConfig(start=2.5, end=6.0))
    assert [s.arrival_s for s in trace] == [0.5, 1.5, 2.5]
    assert trace.summary.transforms == {"start_s": 2.5, "end_s": 6.0}
    with pytest.raises(TraceError, match="no requests left"):
        _open(path, replay=ReplayConfig(start=20.0))


def test_rate_scale_copies_and_thins_whole_sessions(tmp_path: Path) -> None:
    rows = [{"format": "soakd-trace", "version": 1, "block_size": 16}]
    for i in range(400):
        rows.append(
            {"t": i * 0.5, "input_tokens": 32, "output_tokens": 4, "session": f"s{i % 100}", "turn": i // 100}
        )
    path = _jsonl(tmp_path / "n.jsonl", rows)
    base = list(_open(path))
    double = list(_open(path, replay=ReplayConfig(rate_scale=2.0)))
    assert len(double) == 800
    assert [s.arrival_s for s in double] == sorted(s.arrival_s for s in double)
    copies = [s for s in double if s.copy == 1]
    assert len(copies) == 400 and all(s.session.endswith("~1") for s in copies)
    # Copies land between their original and the next request, never on top of it in a burst.
    assert all(0 < s.arrival_s - base[s.index].arrival_s < 0.5 for s in copies)
    half = list(_open(path, replay=ReplayConfig(rate_scale=0.5)))
    kept = {s.session for s in half}
    assert 30 <= len(kept) <= 70
    # A session is kept or dropped whole: every kept session still has all four turns.
    assert all(sum(1 for s in half if s.session == k) == 4 for k in kept)


# --- arrival processes and the synthetic generator --------------------------------------------------


def _cv(times: list[float]) -> float:
    gaps = np.diff(np.array(times))
    return float(gaps.std() / gaps.mean())


def test_arrival_processes_rate_and_burstiness() -> None:
    poisson = arrivals_until(ArrivalConfig(rate_rps=50.0), 1, 200.0)
    assert 9_500 < len(poisson) < 10_500
    assert 0.95 < _cv(poisson) < 1.05
    bursty = arrivals_until(ArrivalConfig(process="gamma", rate_rps=50.0, burstiness=0.25), 1, 200.0)
    assert 9_000 < len(bursty) < 11_000
    assert 1.8 < _cv(bursty) < 2.2  # gamma shape k has CV 1/sqrt(k)
    constant = arrivals_until(ArrivalConfig(process="constant", rate_rps=4.0), 1, 10.0)
    assert constant == pytest.approx([i / 4 for i in range(40)])


def test_diurnal_profile_shapes_the_rate() -> None:
    cfg = ArrivalConfig(rate_rps=10.0, diurnal_amplitude=0.8, diurnal_period=1000.0, diurnal_peak=250.0)
    times = np.array(arrivals_until(cfg, 2, 1000.0))
    assert 9_400 < len(times) < 10_600  # the mean rate is unchanged over whole periods
    peak = np.sum((times >= 200) & (times < 300))  # rate ~ 10 * (1 + 0.8 cos(small)) ~ 17.7/s
    trough = np.sum((times >= 700) & (times < 800))  # ~ 2.3/s
    assert peak > 5 * trough
    assert math.isclose(peak / 100, 17.7, rel_tol=0.2)


def test_synthetic_sessions_extend_their_prompts_and_keep_order() -> None:
    cfg = SyntheticTraceConfig(duration=120.0, session_share=1.0, turns_mean=4.0, block_size=16)
    specs = synthesize(cfg, ArrivalConfig(rate_rps=1.0, think_time=3.0), 4)
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert [s.index for s in specs] == list(range(len(specs)))
    sessions: dict[str, list[RequestSpec]] = {}
    for s in specs:
        if s.session:
            sessions.setdefault(s.session, []).append(s)
    assert len(sessions) > 50
    turns = [len(v) for v in sessions.values()]
    assert 3.0 < sum(turns) / len(turns) < 5.0
    for chain in sessions.values():
        assert [s.turn for s in chain] == list(range(len(chain)))
        for a, b in itertools.pairwise(chain):
            n = min(len(a.hash_ids), len(b.hash_ids))
            assert b.hash_ids[:n] == a.hash_ids[:n]
            assert b.input_tokens >= min(a.input_tokens + a.output_tokens, cfg.input_tokens_max)
