"""`soakd compare` over real H200 runs (tests/data/h200): server mode against local mode with a rebuild on
the same synthetic trace, and the demo-trace soak, which replayed a different trace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from soakd.cli import main
from soakd.report.compare import compare_metrics, compare_runs, lines
from soakd.report.metric_kinds import RATES, direction
from soakd.testing import recorded_run_dir

DATA = Path(__file__).resolve().parents[2] / "data" / "h200"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {n: recorded_run_dir(root, n, data=DATA) for n in ("server", "rebuild", "soak")}


def test_same_trace_runs_side_by_side_with_directions(runs: dict[str, Path]) -> None:
    comp = compare_runs(runs["server"], runs["rebuild"])
    assert comp.comparable and not any("NOT COMPARABLE" in w for w in comp.warnings)
    # Same trace, but 40 s against 80 s of replay and another engine: said before any figure.
    text = lines(comp)
    assert text[0] == (
        "!! DIFFERENT LENGTHS: A replayed 40 s, B 80 s (+101 %, beyond 10 %): a short run's tails and "
        "peaks are not a long one's; totals are not judged"
    )
    assert text[1].startswith("!! DIFFERENT ENGINE CONFIG: engine.") and "engine.kind" in text[1]
    by = {m.name: m for m in comp.metrics}
    # The rebuild stalled requests for 37 s: TTFT p99 869 ms -> 38.8 s.
    ttft = by["p99(ttft_ms)"]
    assert ttft.a == pytest.approx(869.1, abs=0.1) and ttft.b == pytest.approx(38847.4, abs=0.1)
    assert ttft.status == "worse" and ttft.rel == pytest.approx(ttft.b / ttft.a - 1)
    # Output tokens over the replay: 98,617 in 38.6 s against the rebuild run's own.
    tps = by["tokens_per_s"]
    assert by["output_tokens"].a == 98617 and by["output_tokens"].status == "changed"
    assert tps.a == pytest.approx(98617 / by["replay_s"].a)  # type: ignore[operator]
    assert tps.direction == "higher" and tps.status == "worse" and tps.rel == pytest.approx(-0.294, abs=1e-3)
    # Within the 5 % tolerance is noise, whichever way.
    assert by["p50(ttft_ms)"].status == "same" and abs(by["p50(ttft_ms)"].rel or 0) < 0.05
    assert by["graph_hit_rate"].status == "same"  # 98.9 % vs 95.9 %
    assert by["peak_engine_rss_bytes"].status == "better"  # 3.10 GiB -> 2.79 GiB
    assert by["requests"].status == "changed"  # a count, no better side
    # Verdicts and criteria side by side.
    assert (comp.a.verdict, comp.b.verdict) == ("PASS", "FAIL")
    crit = {n: (a, b) for n, a, b in comp.criteria}
    assert crit["ttft_p99_ms"][0]["passed"] is True and crit["ttft_p99_ms"][1]["passed"] is False
    env = {e.key: e for e in comp.environment}
    assert env["engine kind"].differs and (env["engine kind"].a, env["engine kind"].b) == (
        "vllm-server",
        "vllm-local",
    )
    assert not env["trace sha256"].differs and not env["vLLM version"].differs
    changed = {c.key for c in comp.config_changes}
    assert {"engine.kind", "engine.changes", "run.duration"} <= changed and "run.name" not in changed
    # A zero A is not a change below the noise floor: fragmentation growth 0 -> -4.7e-5.
    assert by["fragmentation_growth"].status == "same" and by["engine_rebuilds"].status == "changed"
    # Regressions beyond 50 %: the tail latencies, not throughput (-29 %) nor p50 TTFT.
    worse = {m.name for m in comp.regressions(50.0)}
    assert {"p99(ttft_ms)", "max(ttft_ms)", "p99(e2e_ms)", "p50(e2e_ms)", "p99(tpot_ms)"} <= worse
    assert not worse & {"tokens_per_s", "p50(ttft_ms)", "prefix_hit_rate", "peak_engine_rss_bytes"}


def test_different_traces_are_flagged_not_comparable(runs: dict[str, Path]) -> None:
    # The API still compares them (the CLI refuses without --allow-unlike), the trace line first.
    comp = compare_runs(runs["soak"], runs["server"])
    assert not comp.comparable
    text = lines(comp)
    assert text[0].startswith("!! NOT COMPARABLE: the runs replayed different traces (sha256 bbbafd98f350")


def test_a_different_gpu_is_named(runs: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(runs["rebuild"], other)
    meta = json.loads((other / "meta.json").read_text())
    meta["gpu"] = {"driver": "580.159.04", "devices": [{"name": "NVIDIA H100 80GB HBM3"}] * 2}
    (other / "meta.json").write_text(json.dumps(meta))
    comp = compare_runs(runs["rebuild"], other)
    env = {e.key: e for e in comp.environment}
    assert (env["GPU"].a, env["GPU"].b) == (None, "2x NVIDIA H100 80GB HBM3") and env["GPU"].differs
    assert comp.comparable  # the same trace: comparable, the GPU difference is in the table
    meta["gpu"]["devices"] = [{"name": "NVIDIA H200"}]
    (runs_h200 := tmp_path / "h200").mkdir()
    shutil.copytree(other, runs_h200, dirs_exist_ok=True)
    (runs_h200 / "meta.json").write_text(json.dumps(meta))
    assert (
        "different GPU: 2x NVIDIA H100 80GB HBM3 vs 1x NVIDIA H200" in compare_runs(other, runs_h200).warnings
    )


def test_tolerance_and_zero_baselines() -> None:
    a = {"p99(ttft_ms)": 100.0, "tokens_per_s": 50.0, "error_rate": 0.0, "graph_hit_rate": None}
    b = {"p99(ttft_ms)": 104.0, "tokens_per_s": 60.0, "error_rate": 1e-4, "graph_hit_rate": 0.9}
    a["requests"] = b["requests"] = 10.0
    by = {m.name: m for m in compare_metrics(a, b, tolerance_pct=5.0)}
    assert by["p99(ttft_ms)"].status == "same"
    assert by["tokens_per_s"].status == "better" and by["tokens_per_s"].rel == pytest.approx(0.2)
    # From no errors any error is worse, by more than any percentage: 1 in 10,000 is not rounding noise.
    assert (
        by["error_rate"].status == "worse"
        and by["error_rate"].rel is None
        and by["error_rate"].worse_by_pct() == float("inf")
    )
    assert by["graph_hit_rate"].status == "n/a" and by["requests"].status == "same"
    tight = {m.name: m for m in compare_metrics(a, b, tolerance_pct=1.0)}
    assert tight["p99(ttft_ms)"].status == "worse"
    assert direction("peak_gpu_mem_bytes") == "lower" and direction("min(spec_acceptance)") == "higher"
    assert direction("replay_s") == direction("output_tokens") == direction("recaptures") == "none"
    # Totals are not judged, whatever their better side would be: their rates are.
    assert direction("errors") == direction("engine_restarts") == direction("events(downscale)") == "none"
    assert direction("engine_restarts_per_h") == direction("shed_ratio") == "lower"
    assert {n: direction(n) for n in RATES if direction(n) == "none"} == {}  # every rate is judged
    assert direction("max(e2e_ms)") == direction("p90(lateness_ms)") == direction("max(temp_c)") == "lower"


def test_cli_text_json_and_exit_codes(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(runs["server"]), str(runs["rebuild"])]) == 0
    out = capsys.readouterr().out
    assert "p99(ttft_ms)" in out and "worse" in out and "ttft_p99_ms" in out and "vllm-server" in out
    assert main(["compare", str(runs["server"]), str(runs["rebuild"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["comparable"] is True and doc["a"]["verdict"] == "PASS" and doc["b"]["verdict"] == "FAIL"
    # --fail-on-regression: TTFT p99 is 4,370 % worse.
    assert main(["compare", str(runs["server"]), str(runs["rebuild"]), "--fail-on-regression", "10"]) == 1
    assert "regression: p99(ttft_ms)" in capsys.readouterr().err
    # The other way round the worst is max(tpot_ms), +89 %: a 100 % gate passes, a 50 % gate does not.
    assert main(["compare", str(runs["rebuild"]), str(runs["server"]), "--fail-on-regression", "100"]) == 0
    assert main(["compare", str(runs["rebuild"]), str(runs["server"]), "--fail-on-regression", "50"]) == 1
    assert capsys.readouterr().err.count("regression:") == 1  # not fragmentation_growth -4.7e-5 -> 0
    capsys.readouterr()
    # Different traces: refused, one line, unless asked for; then a gate cannot pass on them.
    assert main(["compare", str(runs["soak"]), str(runs["soak"]), "--fail-on-regression", "10"]) == 0
    capsys.readouterr()
    assert main(["compare", str(runs["soak"]), str(runs["server"])]) == 2
    refused = capsys.readouterr()
    assert refused.out == "" and refused.err.count("\n") == 1
    assert refused.err.startswith("soakd: error: not compared: the runs replayed different traces (sha256 ")
    assert refused.err.rstrip().endswith("--allow-unlike compares them anyway")
    gate = ["--fail-on-regression", "1000000", "--allow-unlike"]
    assert main(["compare", str(runs["soak"]), str(runs["server"]), *gate]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("!! NOT COMPARABLE") and "NOT COMPARABLE" in captured.err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["nowhere", "nowhere-either"], "no run at 'nowhere'"),
        (["{server}", "{server}", "--tolerance", "-1"], "--tolerance: must be a number >= 0"),
        (["{server}", "{server}", "--fail-on-regression", "x"], "expected a percentage"),
        (["{server}"], "the following arguments are required: RUN_B"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(
    runs: dict[str, Path],
    args: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compare", *(a.format(server=runs["server"]) for a in args)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and says in captured.err


def test_a_damaged_meta_is_bad_input(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(runs["server"], bad)
    (bad / "meta.json").write_text("{not json", encoding="utf-8")
    assert main(["compare", str(runs["server"]), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"soakd: error: {bad / 'meta.json'}:1: not JSON")


def _with_metrics(src: Path, dst: Path, ran_s: float, metrics: dict[str, float]) -> Path:
    """A copy of a recorded run whose verdict.json says it replayed `ran_s` s and measured `metrics`."""
    shutil.copytree(src, dst)
    verdict = json.loads((dst / "verdict.json").read_text())
    verdict.update(ran_s=ran_s, metrics=metrics)
    (dst / "verdict.json").write_text(json.dumps(verdict))
    return dst


def test_runs_of_different_lengths_are_judged_by_rates(runs: dict[str, Path], tmp_path: Path) -> None:
    def run(name: str, s: float, restarts: float, offered_p99: float) -> Path:
        # The same load, 10 req/s and 1,000 tok/s with 1 % errors, for `s` seconds.
        totals = {"requests": 10 * s, "errors": 0.1 * s, "output_tokens": 1000 * s, "input_tokens": 2000 * s}
        rates = {"tokens_per_s": 1000.0, "requests_per_s": 10.0, "error_rate": 0.01, "p99(ttft_ms)": 400.0}
        more = {
            "replay_s": s,
            "duration_s": s,
            "engine_restarts": restarts,
            "p99(ttft_offered_ms)": offered_p99,
        }
        return _with_metrics(runs["server"], tmp_path / name, s, {**totals, **rates, **more})

    comp = compare_runs(run("long", 120.0, 2.0, 500.0), run("short", 30.0, 1.0, 510.0))
    assert lines(comp)[0].startswith("!! DIFFERENT LENGTHS: A replayed 120 s, B 30 s (-75 %, beyond 10 %)")
    by = {m.name: m for m in comp.metrics}
    # Four times the totals in the long run: shown, not judged.
    for total in ("requests", "errors", "output_tokens", "input_tokens", "engine_restarts"):
        assert by[total].direction == "none" and by[total].status == "changed", total
    # Their rates are judged: the same throughput and error rate, restarts 60/h -> 120/h.
    assert by["input_tokens_per_s"].a == by["input_tokens_per_s"].b == pytest.approx(2000.0)
    assert by["input_tokens_per_s"].direction == "higher"
    assert by["input_tokens_per_s"].status == by["error_rate"].status == by["tokens_per_s"].status == "same"
    restarts = by["engine_restarts_per_h"]
    assert (restarts.a, restarts.b, restarts.status) == (pytest.approx(60.0), pytest.approx(120.0), "worse")
    assert {m.name for m in comp.regressions(10.0)} == {"engine_restarts_per_h"}
    # The latency as offered comes first when the runs have it.
    assert comp.metrics[0].name == "p99(ttft_offered_ms)" and comp.metrics[0].status == "same"
    assert comp.to_dict()["a"]["ran_s"] == 120.0
    row = next(line for line in lines(comp) if line.startswith("requests "))
    assert row.split() == ["requests", "1,200", "300", "-900", "-75.0%", "changed", "(total)"]
    # Within 10 % of A's length is no warning.
    near = compare_runs(tmp_path / "long", run("near", 110.0, 2.0, 500.0))
    assert not any(w.startswith("DIFFERENT LENGTHS") for w in near.warnings)
