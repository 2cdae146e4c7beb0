"""The command line: bad input is one line on stderr, exit code 2, and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from soakd.cli import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("soakd: error: ")
    return lines[0]


def test_bad_config_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\noutput_dir = "runs"\n[replay]\nspeeed = 2\n')
    code, _, err = run(["run", "--config", str(cfg)], capsys)
    assert code == 2
    assert one_line_error(err) == f"soakd: error: {cfg}:4: replay.speeed: unknown key (did you mean 'speed'?)"
    assert not (tmp_path / "runs").exists()


def test_bad_trace_row_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": "ten", "output_length": 5, "hash_ids": [1]}\n'
    )
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\noutput_dir = "runs"\n')
    code, _, err = run(["run", "--config", str(cfg), "--trace", str(trace)], capsys)
    assert code == 2
    line = one_line_error(err)
    assert f"{trace}:2:" in line and "input_length" in line
    assert not (tmp_path / "runs").exists()


def test_missing_model_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\noutput_dir = "runs"\n[engine]\nmodel = "nowhere"\n')
    code, _, err = run(["run", "--config", str(cfg)], capsys)
    assert code == 2
    assert "engine.model: no model at" in one_line_error(err)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--duration", "soon"], "run.duration"),
        (["run", "--set", "nokey"], "KEY=VALUE"),
        (["run", "--set", "replay.max_concurrency=0"], "replay.max_concurrency"),
        (["frobnicate"], "invalid choice"),
        (["report", "no-such-run"], "no run at"),
        ([], "required"),
    ],
)
def test_bad_arguments(
    argv: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run(argv, capsys)
    assert code == 2
    assert needle in one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_check_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["check", "--json"], capsys)
    # No model in an empty folder: check answers, and says what is missing.
    assert code == 1
    checks = {c["name"]: c for c in json.loads(out)}
    assert checks["config"]["ok"] and checks["trace"]["ok"]
    assert not checks["model"]["ok"] and "soakd model tiny" in checks["model"]["detail"]
    assert checks["influx"]["detail"].startswith("disabled")
    assert checks["gpu"]["ok"]


def test_check_reports_an_unreachable_influxdb(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[sinks.influx]\nenabled = true\nurl = "http://127.0.0.1:9"\ntimeout = "2s"\n')
    code, out, _ = run(["check", "--config", str(cfg)], capsys)
    assert code == 1
    assert "FAIL influx: http://127.0.0.1:9 (v1)" in out


def test_check_in_attach_mode_asks_the_server_not_for_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine.kind = "openai" needs no local vLLM (a service host may have none): check asks the server."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[engine]\nkind = "openai"\nurl = "http://u:secret@127.0.0.1:9/v1"\n')
    code, out, _ = run(["check", "--config", str(cfg), "--json"], capsys)
    assert code == 1
    engine = {c["name"]: c for c in json.loads(out)}["engine"]
    assert not engine["ok"] and "127.0.0.1:9" in engine["detail"], engine
    assert "vLLM is not installed" not in engine["detail"] and "secret" not in engine["detail"]


def test_help_does_not_import_vllm() -> None:
    code = (
        "import sys; from soakd.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False False"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["telemetry", "record", "--duration", "soon", "OUT"], "argument --duration"),
        (["telemetry", "record", "--duration", "0s", "OUT"], "must be more than 0"),
        (["telemetry", "record", "--duration", "5s", "--fast-hz", "-1", "OUT"], "argument --fast-hz"),
        (["telemetry", "record", "--duration", "5s", "/no/such/dir/out.jsonl"], "is not a folder"),
        (["probe", "--model", "/no/such/model"], "not a folder"),
    ],
)
def test_telemetry_and_probe_arguments(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(tmp_path / a) if a == "OUT" else a for a in argv]
    code, _, err = run(argv, capsys)
    assert code == 2 and needle in one_line_error(err)
    assert not list(tmp_path.iterdir())  # nothing written


def test_telemetry_record_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rec.jsonl"
    out.write_text("keep me\n")
    code, _, err = run(["telemetry", "record", "--duration", "1s", str(out)], capsys)
    assert code == 2 and "--force" in one_line_error(err)
    assert out.read_text() == "keep me\n"


def test_probe_without_a_gpu_still_gives_the_models_bytes_per_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "torch_dtype": "bfloat16"}
        )
    )
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    code, out, _ = run(["probe", "--model", str(model), "--no-copy", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["model"]["weight_bytes"] == 64
    if not doc["gpus"]:
        assert doc["reason"]


def test_hardware_lines_of_a_summary() -> None:
    from soakd.cli.common import hardware_lines

    summary = {
        "gpu_throttle": {
            "0": {
                "state": "ok",
                "throttled_s": 40.61,
                "enters": 2,
                "per_reason_s": {"power": 40.6},
                "cotenant_episodes": 1,
            },
            "1": {"state": "ok", "throttled_s": 0.0, "enters": 0, "per_reason_s": {}, "cotenant_episodes": 0},
        },
        "host_throttle": {"state": "throttled", "throttled_s": 3.0, "enters": 1, "per_reason_s": {}},
        "gpu_events": {"listening": True, "xid_errors": 1, "xid_benign": 2, "totals": {"xid": 3}},
        "decode_ceiling": {"available": False, "reason": "no GPU"},
    }
    assert hardware_lines(summary) == [
        "  throttle, GPU 0: 40.6 s throttled in 2 episode(s), now ok; counters: power 40.6 s",
        "  another process on GPU 0: came 1 time(s) (cotenant_enter events); the figures are not the "
        "engine's alone",
        "  throttle, GPU 1: 0.0 s throttled in 0 episode(s), now ok",
        "  throttle, host CPUs: 3.0 s throttled in 1 episode(s), now throttled",
        "  GPU error events: 1 XID error(s), 2 benign XID(s), totals {'xid': 3}",
        "  decode ceiling: not computed (no GPU)",
    ]
    assert hardware_lines({}) == []


def test_report_reads_a_damaged_spool_up_to_what_is_whole_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from soakd.config import load

    run = tmp_path / "20261130T000000Z-soak-aaaa"
    (run / "spool").mkdir(parents=True)
    meta = {"run_id": run.name, "config": load(None).model_dump(mode="json")}
    (run / "meta.json").write_text(json.dumps(meta))
    ok = "requests,status=ok index={i}i,loop=0i,ttft_s=0.1,tpot_s=0.01,e2e_s=0.2 {t}\n"
    seg1 = ok.format(i=1, t=100) + "requests,status=ok \x00\x00garbage\n" + ok.format(i=2, t=300)
    (run / "spool" / "seg-00000001.lp").write_text(seg1)
    # The crash tore the last line of the newest segment.
    (run / "spool" / "seg-00000002.lp").write_text(ok.format(i=3, t=400) + "requests,status=ok index=4i,lo")
    code = main(["report", str(run), "--json", "--exit-code"])
    out, err = capsys.readouterr()
    verdict = json.loads(out)
    assert code == 1 and verdict["verdict"] == "FAIL"  # no summary: it did not finish
    assert verdict["requests"]["scheduled"] == 3  # the three whole records, nothing else
    warnings = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    damaged = [w for w in warnings if w["event"] == "spool_line_damaged"]
    torn = [w for w in warnings if w["event"] == "spool_torn_tail"]
    assert [(Path(w["file"]).name, w["line"]) for w in damaged] == [("seg-00000001.lp", 2)]
    assert [(Path(w["file"]).name, w["bytes"]) for w in torn] == [("seg-00000002.lp", 30)]
    assert "Traceback" not in err


def test_model_shapes_lists_names_params_and_kv(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["model", "shapes"], capsys)
    assert code == 0
    assert "Qwen3-8B" in out and "8.19B" in out and "144 KiB" in out and "MiMo-7B-RL" in out
    code, out, _ = run(["model", "shapes", "--json"], capsys)
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["Llama-3.1-70B"]["params"] == 70_553_706_496


def test_model_shape_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["model", "shape", "qwen9-1b", str(tmp_path / "m")], capsys)
    assert code == 2 and one_line_error(err).startswith("soakd: error: NAME: unknown shape 'qwen9-1b'")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    code, _, err = run(["model", "shape", "qwen3-0.6b", str(full)], capsys)
    assert code == 2 and "DIR: " in one_line_error(err) and "--force" in err
    code, _, err = run(["model", "shape", "qwen3-0.6b", str(tmp_path / "no" / "dir")], capsys)
    assert code == 2 and "is not a folder" in one_line_error(err)
    code, _, err = run(["model", "shape", "qwen3-0.6b", str(full / "x")], capsys)
    assert code == 2 and "is not a folder" in one_line_error(err)
    assert not (tmp_path / "m").exists() and [p.name for p in full.iterdir()] == ["x"]


def test_model_shape_writes_and_probe_says_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q"
    code, text, _ = run(["model", "shape", "QWEN3-0.6B", str(out)], capsys)
    assert code == 0 and "Qwen3-0.6B written" in text and (out / "soakd-shape.json").is_file()
    code, text, _ = run(["probe", "--model", str(out), "--no-copy"], capsys)
    assert code == 0 and "weights from config.json: 0.60B params" in text
    code, _, err = run(["probe", "--model", str(out), "--load-format", "fast"], capsys)
    assert code == 2 and "--load-format" in one_line_error(err)


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["run", "--log-level", "debug"], "debug"),
        (["--log-level", "warning", "run"], "warning"),
        (["run"], "info"),
        (["trace", "inspect", "t.jsonl", "--log-level", "error"], "error"),
        (["model", "shapes", "--log-level", "debug"], "debug"),
    ],
)
def test_log_level_is_taken_before_and_after_the_subcommand(argv: list[str], level: str) -> None:
    from soakd.cli.parser import build_parser

    assert build_parser().parse_args(argv).log_level == level


def test_check_applies_set_overrides_as_run_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sets = ['sinks.influx.url="http://127.0.0.1:9"', "sinks.influx.enabled=true", 'sinks.influx.timeout="1s"']
    code, out, _ = run(["check", "--json", *(a for s in sets for a in ("--set", s))], capsys)
    influx = {c["name"]: c for c in json.loads(out)}["influx"]
    assert code == 1 and not influx["ok"] and "127.0.0.1:9" in influx["detail"]
    code, _, err = run(["check", "--set", "replay.speed=inf"], capsys)
    assert code == 2 and "replay.speed" in one_line_error(err)


def test_a_bare_hub_id_is_a_model_unless_a_local_folder_has_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["check", "--json", "--model", "Qwen/Qwen3-0.6B"], capsys)
    model = {c["name"]: c for c in json.loads(out)}["model"]
    assert model == {"name": "model", "ok": True, "detail": "Qwen/Qwen3-0.6B"}
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)  # a local folder wins, and holds no model
    code, out, _ = run(["check", "--json", "--model", "Qwen/Qwen3-0.6B"], capsys)
    model = {c["name"]: c for c in json.loads(out)}["model"]
    assert (
        code == 1
        and not model["ok"]
        and model["detail"].startswith(f"no model at {tmp_path / 'Qwen' / 'Qwen3-0.6B'}")
    )
    for not_an_id in ("./Qwen/Qwen3-0.6B", "a/b/c", "models/tiny/"):
        _, out, _ = run(["check", "--json", "--model", not_an_id], capsys)
        assert not {c["name"]: c for c in json.loads(out)}["model"]["ok"], not_an_id


def test_target_attaches_to_a_running_server() -> None:
    from soakd.cli.common import engine_overrides
    from soakd.cli.parser import build_parser

    overrides: dict[str, object] = {}
    engine_overrides(build_parser().parse_args(["run", "--target", "http://gpu-1:8000/v1"]), overrides)
    assert overrides == {"engine.kind": "openai", "engine.url": "http://gpu-1:8000/v1"}
    # With --target, --model names the model the server serves (as vllm bench serve's --model does).
    overrides = {}
    argv = ["run", "--target", "http://gpu-1:8000", "--model", "Qwen/Qwen3-8B"]
    engine_overrides(build_parser().parse_args(argv), overrides)
    assert overrides["engine.served_model"] == "Qwen/Qwen3-8B" and "engine.model" not in overrides


def test_check_reports_url_credentials_with_an_api_key_without_trying_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SOAKD_OPENAI_API_KEY", "sk-Zq9apikey")
    code, out, err = run(["check", "--json", "--target", "http://user:Zq9pw@127.0.0.1:9"], capsys)
    results = {c["name"]: c for c in json.loads(out)}
    assert code == 1 and "Zq9" not in out + err
    for name in ("model", "engine"):
        assert not results[name]["ok"]
        assert results[name]["detail"].startswith("credentials in the URL (http://<redacted>@127.0.0.1:9)")
        assert "$SOAKD_OPENAI_API_KEY" in results[name]["detail"]


def test_every_subcommand_has_a_description() -> None:
    import argparse

    from soakd.cli.parser import build_parser

    def walk(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, str | None]]:
        out = [(path, parser.description)]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out += walk(sub, f"{path} {name}")
        return out

    found = walk(build_parser(), "soakd")
    assert len(found) > 15  # run, report, compare, matrix, check, trace ..., telemetry record, model ...
    assert [p for p, d in found if not d] == []
    assert [p for p, d in found if d and "%%" in d] == []  # descriptions are not %-formatted
    run = dict(found)["soakd run"]
    assert run is not None and "report.html" in run
    # A subcommand without its own description gets its one-line help, as a sentence.
    assert dict(found)["soakd model tiny"] == "Build the tiny random-weight test model (no download)."
