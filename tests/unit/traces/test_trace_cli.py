"""`soakd trace inspect|convert|synth`: figures, round trips, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soakd.cli import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def azure_csv(path: Path) -> Path:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(100):
        rows.append(f"2023-11-16 18:{i // 60:02d}:{i % 60:02d}.5000000,{100 + i},{1 + i % 10}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_inspect_json_has_exact_percentiles_and_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = azure_csv(tmp_path / "a.csv")
    code, out, _ = run(["trace", "inspect", str(path), "--json", "--buckets", "3"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["format"] == "azure" and doc["requests"] == 100 and doc["span_s"] == 99.0
    # Inputs are 100..199: nearest-rank p50 is the 50th value, p99 the 99th.
    assert doc["input_tokens_pct"] == {"mean": 149.5, "p50": 149, "p90": 189, "p99": 198, "max": 199}
    assert doc["output_tokens_pct"]["max"] == 10
    assert doc["rate_over_time"]["bucket_s"] == 33.0
    assert sum(doc["rate_over_time"]["rps"]) * 33.0 == pytest.approx(100)
    code, out, _ = run(["trace", "inspect", str(path)], capsys)
    assert code == 0 and "requests  100 over 99.0 s" in out


def test_convert_to_native_round_trips_times_and_sessions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "b.csv"
    src.write_text(
        "Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "10,s1,ChatGPT,40,5,45,Conversation log\n"
        "12.5,s1,ChatGPT,90,7,97,Conversation log\n"
        "13,s2,GPT-4,20,0,20,Conversation log\n"
    )
    out = tmp_path / "n.jsonl"
    code, text, _ = run(["trace", "convert", str(src), str(out)], capsys)
    assert code == 0 and "2 requests (burstgpt)" in text
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0] == {"format": "soakd-trace", "version": 1, "block_size": 16}
    assert [(r["t"], r["session"], r.get("turn", 0)) for r in lines[1:]] == [(0.0, "s1", 0), (2.5, "s1", 1)]
    # The chained prefix is written out, so the native file replays the same prompts.
    assert lines[2]["hash_ids"][:2] == lines[1]["hash_ids"][:2]
    code, _, err = run(["trace", "convert", str(src), str(out)], capsys)
    assert code == 2 and err.strip() == f"soakd: error: {out} exists (use --force to replace it)"
    # Transforms apply on the way: a window from 2 s on keeps the second request only.
    code, _, _ = run(["trace", "convert", str(src), str(out), "--force", "--set", "replay.start=2s"], capsys)
    assert code == 0 and len(out.read_text().splitlines()) == 2


def test_synth_is_deterministic_and_takes_its_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = [
        "--duration",
        "2m",
        "--rate",
        "4",
        "--process",
        "gamma",
        "--burstiness",
        "0.5",
        "--sessions",
        "0.5",
    ]
    assert run(["trace", "synth", str(a), *args, "--seed", "9"], capsys)[0] == 0
    assert run(["trace", "synth", str(b), *args, "--seed", "9"], capsys)[0] == 0
    assert a.read_bytes() == b.read_bytes()
    code, out, _ = run(["trace", "inspect", str(a), "--json"], capsys)
    doc = json.loads(out)
    assert doc["span_s"] < 120 and doc["session_turns"]["sessions"] > 10
    code, _, err = run(["trace", "synth", str(tmp_path / "c.jsonl"), "--burstiness", "-1"], capsys)
    assert code == 2 and "trace.arrivals.burstiness" in err and "Traceback" not in err
    assert not (tmp_path / "c.jsonl").exists()


def test_bad_rows_stop_with_file_line_field_unless_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
        '{"timestamp": 10, "input_length": "5", "output_length": 2}\n'
        '{"timestamp": 20, "input_length": 5, "output_length": 2}\n'
    )
    code, _, err = run(["trace", "inspect", str(path)], capsys)
    assert code == 2
    assert err.strip() == f"soakd: error: {path}:2: input_length: expected an integer, got string"
    code, out, _ = run(["trace", "inspect", str(path), "--skip-bad-rows", "--json"], capsys)
    assert code == 0 and json.loads(out)["bad_rows"] == 1
    out_file = tmp_path / "o.jsonl"
    assert run(["trace", "convert", str(path), str(out_file)], capsys)[0] == 2
    assert not out_file.exists()


def test_record_arguments_are_checked_before_listening(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rec.jsonl"
    code, _, err = run(["trace", "record", str(out), "--upstream", "http://x", "--listen", "nope"], capsys)
    assert code == 2 and "--listen: expected HOST:PORT" in err
    code, _, err = run(["trace", "record", str(out), "--upstream", "ftp://x"], capsys)
    assert code == 2 and "--upstream" in err
    assert not out.exists()


def test_record_never_overwrites_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rec.jsonl"
    out.write_text("precious\n")
    argv = ["trace", "record", str(out), "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"]
    code, _, err = run(argv, capsys)
    assert code == 2 and err.strip() == f"soakd: error: {out}: exists; recording never overwrites a trace"
    assert out.read_text() == "precious\n"
    code, _, err = run([*argv[:-1], "0.0.0.0:0"], capsys)
    assert code == 2 and "Traceback" not in err
