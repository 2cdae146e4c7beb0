"""The criteria language (`[criteria] checks`) and the run metrics it judges: parsing with clear errors,
the metrics folded from real H200 spools checked against independent sums of the same lines, windows and
sustained ratios on synthetic runs with a known shape, and the verdict/CLI ends."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from soakd.config import CriteriaConfig, load
from soakd.errors import ConfigError
from soakd.judge.criteria import evaluate
from soakd.judge.metrics import SERIES, RunMetrics
from soakd.lang.criteria import SCALARS, SERIES_TOTAL, parse_check
from soakd.metric import Sample, parse_line
from soakd.report.runs import judge, load_metrics

DATA = Path(__file__).resolve().parents[2] / "data" / "h200"
T0 = 1_800_000_000 * 10**9


def _fold(path: Path) -> tuple[RunMetrics, list[Sample]]:
    with gzip.open(path, "rt") as fh:
        samples = [parse_line(line) for line in fh]
    return RunMetrics().add_all(samples), samples


# -- parsing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name", "op", "threshold"),
    [
        ("p99(ttft_ms) < 500", "p99(ttft_ms)", "<", 500.0),
        ("p99.9(tpot_ms)<=40", "p99.9(tpot_ms)", "<=", 40.0),
        ("throttle_time_pct < 5", "throttle_time_pct", "<", 5.0),
        (
            "sustained_ratio(tokens_per_s, last=1h, first=30m) > 0.9",
            "sustained_ratio(tokens_per_s, first=1800s, last=3600s)",
            ">",
            0.9,
        ),
        ("min(spec_acceptance) > 0.6", "min(spec_acceptance, window=60s)", ">", 0.6),
        ("max(temp_c, window=5m) < 83", "max(temp_c, window=300s)", "<", 83.0),
        ("graph_hit_rate > 0.9", "graph_hit_rate", ">", 0.9),
        ("errors == 0", "errors", "==", 0.0),
        ("engine_restarts != 1e0", "engine_restarts", "!=", 1.0),
        ("events(throttle_enter) <= 2", "events(throttle_enter)", "<=", 2.0),
        ("mean(e2e_ms) < 2000", "mean(e2e_ms)", "<", 2000.0),
    ],
)
def test_checks_parse_to_their_canonical_metric(text: str, name: str, op: str, threshold: float) -> None:
    check = parse_check(text)
    assert (check.name, check.op, check.threshold) == (name, op, threshold)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("p99(ttf_ms) < 5", "not 'ttf_ms'"),
        ("ttft_ms < 5", "is a distribution"),
        ("temp_c < 80", "is a series"),
        ("foo < 1", "unknown metric 'foo'"),
        ("p99(ttft_ms) <", "must be a number"),
        ("p99(ttft_ms) < fast", "must be a number"),
        ("errors = 0", "one comparison"),
        ("errors < 1 < 2", "one comparison"),
        ("p100(ttft_ms) < 1", "unknown function 'p100'"),
        ("p0(ttft_ms) < 1", "between 0 and 100"),
        ("max(power_w, windw=1m) < 700", "takes window=, not windw"),
        ("min(temp_c, window=0s) < 5", "more than 0"),
        ("min(temp_c, window=soon) < 5", "not a duration"),
        ("sustained_ratio(ttft_ms) > 1", "takes a series"),
        ("sustained_ratio(tokens_per_s, last=1h, last=2h) > 1", "given twice"),
        ("p99(ttft_ms, window=1m) < 5", "takes no window="),
        ("min(requests) > 5", "takes a latency or a series"),
        ("p99(ttft_ms) < inf", "must be a number"),
        ("", "a check is a string"),
    ],
)
def test_bad_checks_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        parse_check(text)
    assert says in str(err.value)


def test_a_bad_check_in_config_names_file_line_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        '[run]\nname = "x"\n\n[criteria]\nchecks = [\n  "p99(ttft_ms) < 500",\n  "p99(ttft_m) < 5",\n]\n'
    )
    with pytest.raises(ConfigError) as err:
        load(cfg)
    assert str(err.value).startswith(f"{cfg}:7: criteria.checks.1: ")
    # The CLI: one line, exit 2, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "soakd", "check", "--config", str(cfg)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert f"{cfg}:7: criteria.checks.1:" in proc.stderr


def test_the_language_and_the_fold_name_the_same_series() -> None:
    assert set(SERIES_TOTAL) == set(SERIES)
    assert all(SERIES_TOTAL[n] == s.total for n, s in SERIES.items())
    assert set(RunMetrics().scalars()) >= set(SCALARS) - {"duration_s", "interruptions", "lost_in_flight"}


# -- metrics from real H200 spools --------------------------------------------------------------------


def test_spec_and_graph_rates_equal_the_sums_of_the_spooled_points() -> None:
    metrics, samples = _fold(DATA / "soak_spool.lp.gz")
    spec = [s for s in samples if s.measurement == "spec_decode"]
    engine = [s for s in samples if s.measurement == "engine" and "cg_steps" in s.fields]
    accepted = sum(int(s.fields["accepted"]) for s in spec)
    drafted = sum(int(s.fields["draft_tokens"]) for s in spec)
    assert accepted == json.loads((DATA / "soak_summary.json").read_text())["spec_decode"]["accepted"]
    scal = metrics.scalars()
    assert scal["spec_acceptance"] == pytest.approx(accepted / drafted)
    graph = sum(int(s.fields["cg_graph_steps"]) for s in engine)
    steps = sum(int(s.fields["cg_steps"]) for s in engine)
    assert 0.5 < graph / steps < 1.0  # a real mix of graph and eager steps
    assert scal["graph_hit_rate"] == pytest.approx(graph / steps)
    # No GPU telemetry in this recording: the throttle metric has no data, it is not 0.
    assert scal["throttle_time_pct"] is None
    ok = [s for s in samples if s.measurement == "requests" and s.tags.get("status") == "ok"]
    assert scal["errors"] == 0 and scal["completed"] == len(ok)
    assert scal["output_tokens"] == sum(int(s.fields["output_tokens"]) for s in ok)


def test_mtp_acceptance_of_the_h200_recording_is_the_sum_of_its_points() -> None:
    """vLLM's `mtp` method (MiMo-7B-RL shape, k = 1, dummy weights) on an H200: one draft position, its
    acceptance folded from the points equals the summary's counters and the rates the points carry."""
    metrics, samples = _fold(DATA / "mtp" / "spool.lp.gz")
    spec = [s for s in samples if s.measurement == "spec_decode"]
    accepted = sum(int(s.fields["accepted"]) for s in spec)
    drafted = sum(int(s.fields["draft_tokens"]) for s in spec)
    summary = json.loads((DATA / "mtp" / "summary.json").read_text())["spec_decode"]
    assert (accepted, drafted) == (summary["accepted"], summary["drafts"]) == (13006, 37489)
    assert all(s.fields["draft_tokens"] == s.fields["draft_tokens_pos0"] for s in spec)  # k = 1
    assert not any("draft_tokens_pos1" in s.fields for s in spec)
    assert metrics.scalars()["spec_acceptance"] == pytest.approx(accepted / drafted)
    assert 0.3 < accepted / drafted < 0.4


def test_throttle_time_is_the_detector_time_inside_the_replay() -> None:
    """The control recording has one power-cap episode during the replay (summary: 45.1 s throttled)."""
    metrics, samples = _fold(DATA / "control" / "spool.lp.gz")
    reqs = [s.time_ns for s in samples if s.measurement == "requests"]
    lo, hi = min(reqs) // 10**10 * 10**10, (max(reqs) // 10**10 + 1) * 10**10
    thr = [s for s in samples if s.measurement == "throttle" and s.tags.get("gpu") == "0"]
    inside = [(s.time_ns, float(s.fields["throttled_s"])) for s in thr]
    grown = covered = 0.0
    for (t0, v0), (t1, v1) in itertools.pairwise(inside):
        if lo <= t1 < hi:
            grown += v1 - v0
            covered += (t1 - t0) / 1e9
    summary = json.loads((DATA / "control" / "summary.json").read_text())
    assert 0 < grown <= summary["gpu_throttle"]["0"]["throttled_s"] + 1e-3
    pct = metrics.scalars()["throttle_time_pct"]
    assert pct == pytest.approx(100 * grown / covered, rel=0.02)
    assert 10 < pct < 90
    # The episode was an annotated event, and a check on it fails the run that had it.
    assert metrics.events["throttle_enter"] >= 1
    results = evaluate(
        CriteriaConfig(checks=["throttle_time_pct < 5", "events(throttle_enter) == 0"]),
        metrics.summary(),
        ran_s=100,
        planned_s=100,
        metrics=metrics,
    )
    dsl_results = [r for r in results if r.expr]
    assert [r.passed for r in dsl_results] == [False, False]
    assert dsl_results[0].value == pct


# -- windows, sustained ratios, growth: synthetic runs with a known shape ------------------------------


def _request(t_s: float, out: int, status: str = "ok") -> Sample:
    return Sample(
        "requests",
        {
            "output_tokens": out,
            "input_tokens": 10,
            "ttft_s": 0.1,
            "tpot_s": 0.01,
            "e2e_s": 1.0,
            "lateness_s": 0.0,
        },
        T0 + int(t_s * 1e9),
        tags={"status": status},
    )


def _declining_run(hours: float = 2.0) -> RunMetrics:
    """Output tokens/s falls linearly from 100 to 50 over the run; acceptance from 0.8 to 0.4."""
    m = RunMetrics()
    total = int(hours * 3600)
    for t in range(0, total + 1):
        frac = t / total
        m.add(_request(t, round(100 - 50 * frac)))
        if t % 5 == 0:
            m.add(
                Sample(
                    "spec_decode",
                    {"draft_tokens": 100, "accepted": round(100 * (0.8 - 0.4 * frac))},
                    T0 + t * 10**9,
                )
            )
            m.add(
                Sample(
                    "allocator", {"fragmentation": 0.01 + 0.1 * frac}, T0 + t * 10**9, tags={"worker": "0"}
                )
            )
    return m


def test_sustained_ratio_and_window_minimum_follow_the_shape() -> None:
    m = _declining_run()
    cfg = CriteriaConfig(
        checks=[
            "sustained_ratio(tokens_per_s, last=30m, first=30m) > 0.9",
            "min(spec_acceptance, window=5m) > 0.6",
            "max(spec_acceptance, window=5m) > 0.6",
            "fragmentation_growth < 0.05",
            "sustained_ratio(tokens_per_s, last=3h, first=1h) > 0",
        ]
    )
    results = {r.expr: r for r in evaluate(cfg, m.summary(), ran_s=7200, planned_s=7200, metrics=m)}
    ratio = results[cfg.checks[0]]
    # Mean of the last half hour (~56.25 tok/s) over the first (~93.75): 0.6.
    assert ratio.value == pytest.approx(56.25 / 93.75, rel=0.01) and not ratio.passed
    low = results[cfg.checks[1]]
    assert low.value == pytest.approx(0.4, abs=0.02) and not low.passed
    assert "24 windows of 300 s" in low.detail
    assert results[cfg.checks[2]].value == pytest.approx(0.8, abs=0.02) and results[cfg.checks[2]].passed
    growth = results[cfg.checks[3]]
    assert growth.value == pytest.approx(0.1, abs=0.02) and not growth.passed
    short = results[cfg.checks[4]]
    assert short.value is None and not short.passed and "shorter than" in short.detail


def test_a_steady_run_passes_the_same_checks() -> None:
    m = RunMetrics()
    for t in range(0, 3601):
        m.add(_request(t, 80))
        if t % 5 == 0:
            m.add(Sample("spec_decode", {"draft_tokens": 100, "accepted": 70}, T0 + t * 10**9))
    cfg = CriteriaConfig(
        checks=[
            "sustained_ratio(tokens_per_s, last=10m, first=10m) > 0.95",
            "min(spec_acceptance) > 0.6",
            "tokens_per_s >= 79",
            "errors == 0",
            "p99(ttft_ms) < 101",
            "duration_s >= 3600",
        ]
    )
    results = [r for r in evaluate(cfg, m.summary(), ran_s=3600, planned_s=3600, metrics=m) if r.expr]
    assert all(r.passed for r in results), [(r.name, r.value, r.detail) for r in results]


def test_no_metrics_fails_every_check_with_no_data() -> None:
    cfg = CriteriaConfig(checks=["graph_hit_rate > 0.9"])
    m = RunMetrics()
    (result,) = [r for r in evaluate(cfg, m.summary(), ran_s=1, planned_s=1, metrics=m) if r.expr]
    assert result.value is None and not result.passed and result.detail == "no data"


# -- the verdict and `soakd report` --------------------------------------------------------------------


def test_report_judges_a_run_by_its_checks_and_keeps_every_metric(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "spool").mkdir(parents=True)
    with gzip.open(DATA / "soak_spool.lp.gz", "rb") as src:
        (run / "spool" / "seg-00000001.lp").write_bytes(src.read())
    recorded = json.loads((DATA / "soak_verdict.json").read_text())
    crit = CriteriaConfig(checks=["graph_hit_rate > 0.99", "min(spec_acceptance, window=30s) > 0.6"])
    verdict = judge(run, recorded["run_id"], crit, ran_s=60, planned_s=60)
    assert verdict.word == "FAIL"
    by = {c.expr: c for c in verdict.criteria if c.expr}
    assert not by["graph_hit_rate > 0.99"].passed and by["min(spec_acceptance, window=30s) > 0.6"].passed
    written = json.loads((run / "verdict.json").read_text())
    assert written["metrics"]["graph_hit_rate"] == by["graph_hit_rate > 0.99"].value
    assert written["metrics"]["min(spec_acceptance, window=30s)"] is not None
    assert load_metrics(run) == written["metrics"]
    line = next(x for x in verdict.lines() if "graph_hit_rate" in x)
    assert "FAIL" in line and "must be > 0.99" in line
