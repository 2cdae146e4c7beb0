"""The ablation matrix's file, plan and table, with each variant's `soakd run` stood in for by a recorded
real H200 run (tests/data/h200); the real engine runs are tests/integration/test_matrix_e2e.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from soakd.cli import main
from soakd.cli.parser import _override
from soakd.errors import ConfigError, UsageError
from soakd.matrix import DEFAULT_MATRIX, MATRIX_JSON, MATRIX_MD, Matrix, load_matrix, markdown, plan, set_args
from soakd.testing import recorded_run_dir

DATA = Path(__file__).resolve().parents[2] / "data" / "h200"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recorded")
    return {n: recorded_run_dir(root, n, data=DATA) for n in ("server", "rebuild", "soak")}


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


MATRIX = """
[base]
"engine.speculative.enabled" = false

[[variant]]
name = "baseline"

[[variant]]
name = "+spec"
set = { "engine.speculative.enabled" = true }

[[variant]]
name = "+graphs"
what = "CUDA graphs"
set = { engine = { enforce_eager = false } }
needs = "cuda"

[[variant]]
name = "+broken"
set = { "engine.max_num_seqs" = 2 }
"""


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            '[[variant]]\nname = "a"\n\n[[variant]]\nname = "b"\ncolour = 1\n',
            "m.toml:6: variant.1.colour: unknown key",
        ),
        ('[[variant]]\nname = "a"\n[[variant]]\nname = "a"\n', "m.toml: variant name 'a' is used twice"),
        ('[[variant]]\nname = "a b"\n', "m.toml:2: variant.0.name: string should match pattern"),
        ('baseline = "z"\n[[variant]]\nname = "a"\n', "m.toml: baseline 'z' is not a variant's name"),
        ("variant = []\n", "m.toml:1: variant: list should have at least 1 item"),
        (
            '[[variant]]\nname = "a"\nneeds = "tpu"\n',
            "m.toml:3: variant.0.needs: input should be '' or 'cuda'",
        ),
        ("[[variant]\n", "m.toml:1: TOML syntax"),
    ],
)
def test_bad_matrix_files_name_file_line_and_key(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_matrix(_write(tmp_path / "m.toml", text))
    assert says in str(err.value).replace(str(tmp_path) + "/", "")


def test_every_variant_is_checked_against_the_config_before_anything_runs(tmp_path: Path) -> None:
    m = _write(tmp_path / "m.toml", MATRIX.replace('max_num_seqs" = 2', 'max_num_seqs" = 0'))
    with pytest.raises(ConfigError) as err:
        plan(load_matrix(m), None, {}, matrix_file=m)
    assert str(err.value) == (
        f"{m}:20: engine.max_num_seqs: variant '+broken': input should be greater than or equal to 1"
    )
    trace = _write(tmp_path / "t.toml", '[[variant]]\nname = "a"\nset = { "trace.path" = "other.jsonl" }\n')
    with pytest.raises(ConfigError, match="may not change the trace"):
        plan(load_matrix(trace), None, {}, matrix_file=trace)
    when = _write(tmp_path / "d.toml", '[[variant]]\nname = "a"\nset = { "run.seed" = 2026-11-30 }\n')
    with pytest.raises(ConfigError, match=r"run\.seed: not a string, number, boolean or array of them"):
        plan(load_matrix(when), None, {}, matrix_file=when)
    with pytest.raises(UsageError, match=r"engine\.kind must be vllm-local or vllm-server"):
        plan(DEFAULT_MATRIX, None, {"engine.kind": "openai", "engine.url": "http://127.0.0.1:1"})


def test_the_built_in_matrix_is_valid_and_set_args_round_trip() -> None:
    planned = plan(DEFAULT_MATRIX, None, {"run.duration": "1m"})
    names = [p.variant.name for p in planned]
    assert names == [
        "baseline",
        "+speculation",
        "+cuda-graphs",
        "+chunked-prefill",
        "+spec+graphs",
        "+all-three",
    ]
    base, spec = planned[0].overrides, planned[1].overrides
    assert base["engine.speculative.enabled"] is False and spec["engine.speculative.enabled"] is True
    assert base["run.name"] == "soak-baseline" and planned[5].overrides["run.name"] == "soak-all-three"
    assert [p.variant.needs for p in planned] == ["", "", "cuda", "", "cuda", "cuda"]
    args = set_args({**planned[3].overrides, "x.list": [1, "two"], "x.text": 'a "quoted" é'})
    parsed = dict(_override(a) for a in args[1::2])
    assert parsed == {**planned[3].overrides, "x.list": [1, "two"], "x.text": 'a "quoted" é'}
    assert parsed["engine.extra_args.max_num_batched_tokens"] == 2048


def _fake_runs(
    recorded: dict[str, Path], tmp_path: Path, by_variant: dict[str, str | int], platform: str = ""
) -> object:
    """A launcher that answers each variant's `soakd run` with a recorded run (or a failure exit code),
    its meta.json's engine platform set to `platform` if given."""
    calls: list[list[str]] = []

    def launch(argv: list[str], log: Path) -> tuple[int, str]:
        calls.append(argv)
        sets = dict(_override(argv[i + 1]) for i, a in enumerate(argv) if a == "--set")
        name = str(sets["run.name"]).removeprefix("soak-")
        what = by_variant[name]
        if isinstance(what, int):
            log.write_text("vllm said things\nsoakd: EngineError: engine did not start: out of memory\n")
            return what, ""
        run_dir = tmp_path / "runs" / f"{name}-run"
        shutil.copytree(recorded[what], run_dir)
        if platform:
            meta = json.loads((run_dir / "meta.json").read_text())
            meta["engine"].setdefault("details", {})["platform"] = platform
            (run_dir / "meta.json").write_text(json.dumps(meta))
        log.write_text("")
        return (0 if what != "rebuild" else 1), json.dumps({"run_dir": str(run_dir)})

    launch.calls = calls  # type: ignore[attr-defined]
    return launch


def test_rows_link_runs_say_why_and_show_deltas(recorded: dict[str, Path], tmp_path: Path) -> None:
    m = _write(tmp_path / "m.toml", MATRIX)
    planned = plan(load_matrix(m), None, {}, matrix_file=m)
    out = tmp_path / "matrices" / "one"
    out.mkdir(parents=True)
    launch = _fake_runs(recorded, tmp_path, {"baseline": "server", "spec": "rebuild", "broken": 3}, "cpu")

    def no_nvml() -> bool:
        raise AssertionError("the runs' meta says cpu: NVML is not asked")

    matrix = Matrix(planned, "baseline", out, None, launch=launch, gpu_present=no_nvml)  # type: ignore[arg-type]
    rows = {r.variant: r for r in matrix.run()}
    # The runs' engine was on the CPU: no CUDA-graph row, and it is not run.
    assert rows["+graphs"].status == "not applicable" and rows["+graphs"].reason.endswith(
        "(CPU: no CUDA graphs)"
    )
    assert len(launch.calls) == 3  # type: ignore[attr-defined]
    assert rows["+broken"].status == "failed"
    assert rows["+broken"].reason == "exit 3: EngineError: engine did not start: out of memory"
    base, spec = rows["baseline"], rows["+spec"]
    assert base.status == spec.status == "ran" and (base.verdict, spec.verdict) == ("PASS", "FAIL")
    assert spec.link == "../../runs/spec-run" and (out / spec.link / "meta.json").is_file()
    assert spec.vs_baseline["p99(ttft_ms)"]["status"] == "worse"
    assert spec.vs_baseline["tokens_per_s"]["rel"] == pytest.approx(
        spec.metrics["tokens_per_s"] / base.metrics["tokens_per_s"] - 1  # type: ignore[operator]
    )
    assert spec.what == "engine.speculative.enabled=true" and rows["+graphs"].what == "CUDA graphs"
    # The files: matrix.json as returned, matrix.md the printed table with relative links.
    doc = json.loads((out / MATRIX_JSON).read_text())
    assert [r["status"] for r in doc["rows"]] == ["ran", "ran", "not applicable", "failed"]
    md = (out / MATRIX_MD).read_text()
    assert md.splitlines() == markdown(matrix)
    table = [ln for ln in md.splitlines() if ln.startswith("| +spec ")]
    assert len(table) == 1
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    # TTFT p99 as offered: these recordings predate its field, so the sum of its parts (38,847.4 ms
    # from the send, +0.2 ms of admission wait and lateness).
    assert cells[2] == "1,804.4 (-29.4%)" and cells[4] == "38,847.6 (+4368.4%)"
    assert cells[6] == "2.79 GiB RSS" and cells[7] == "FAIL"
    assert cells[8] == f"[{spec.run_id}](../../runs/spec-run)"
    assert "| exit 3: EngineError: engine did not start: out of memory |" in md.replace("  ", "")


def test_a_gpu_run_decides_the_platform_and_a_different_trace_is_flagged(
    recorded: dict[str, Path], tmp_path: Path
) -> None:
    m = _write(tmp_path / "m.toml", MATRIX.replace('max_num_seqs" = 2', 'max_num_seqs" = 4'))
    planned = plan(load_matrix(m), None, {}, matrix_file=m)
    out = tmp_path / "mx"
    out.mkdir()
    launch = _fake_runs(
        recorded, tmp_path, {"baseline": "server", "spec": "rebuild", "graphs": "server", "broken": "soak"}
    )

    matrix = Matrix(planned, "baseline", out, None, launch=launch, gpu_present=lambda: False)  # type: ignore[arg-type]
    rows = {r.variant: r for r in matrix.run()}
    # The first run to finish (server mode) names no platform, the next (local) says cuda: NVML, which
    # would say no GPU here, is not asked.
    assert matrix.platform == "cuda" and rows["+graphs"].status == "ran"
    assert matrix.warnings() == [
        "+broken: NOT COMPARABLE: the runs replayed different traces (sha256 64bf74515907 vs bbbafd98f350); "
        "their deltas mix the traffic with the change"
    ]
    assert "**Warning:** +broken: NOT COMPARABLE" in (out / MATRIX_MD).read_text()


def test_cli_bad_matrix_is_exit_2_with_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    m = _write(tmp_path / "m.toml", MATRIX.replace('max_num_seqs" = 2', 'max_num_seq" = 2'))
    assert main(["matrix", "--matrix", str(m), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    said = "unknown key (did you mean 'max_num_seqs'?)"
    assert err == f"soakd: error: {m}:20: engine.max_num_seq: variant '+broken': {said}\n"
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
    (tmp_path / "out").mkdir()
    assert main(["matrix", "--out", str(tmp_path / "out")]) == 2
    assert "a matrix directory is never reused" in capsys.readouterr().err


def test_a_stop_mid_variant_marks_it_and_runs_nothing_more(recorded: dict[str, Path], tmp_path: Path) -> None:
    import os
    import signal

    m = _write(tmp_path / "m.toml", MATRIX)
    planned = plan(load_matrix(m), None, {}, matrix_file=m)
    inner = _fake_runs(recorded, tmp_path, {"baseline": "server", "spec": "rebuild"}, "cpu")

    def launch(argv: list[str], log: Path) -> tuple[int, str]:
        result = inner(argv, log)  # type: ignore[operator]
        if 'run.name="soak-spec"' in argv:
            os.kill(os.getpid(), signal.SIGTERM)  # as systemd stops the matrix while +spec runs
        return result  # type: ignore[no-any-return]

    before = signal.getsignal(signal.SIGTERM)
    matrix = Matrix(planned, "baseline", tmp_path, None, launch=launch, gpu_present=lambda: False)
    rows = {r.variant: r for r in matrix.run()}
    assert signal.getsignal(signal.SIGTERM) is before
    assert rows["baseline"].status == "ran"
    assert (rows["+spec"].status, rows["+spec"].reason) == ("failed", "stopped (SIGTERM) during the run")
    assert rows["+spec"].link  # its run is still linked
    assert rows["+broken"].status == rows["+graphs"].status == "not run" and matrix.stopped
    assert len(inner.calls) == 2  # type: ignore[attr-defined]
