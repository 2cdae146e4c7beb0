"""Summaries of request records, criteria, and the verdict document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soakd.config import load
from soakd.files import write_json_atomic
from soakd.judge.criteria import evaluate, summarize
from soakd.judge.verdict import make_verdict
from soakd.metric import Sample


def req(status: str, ttft: float = 0.1, tpot: float = 0.01, error: str = "") -> Sample:
    fields: dict[str, float | int | str] = {"lateness_s": 0.0, "input_tokens": 10, "output_tokens": 5}
    if status == "ok":
        fields |= {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": ttft + 4 * tpot}
    if error:
        fields["error"] = error
    return Sample("requests", fields, 1, tags={"status": status})


def test_summary_counts_and_percentiles() -> None:
    samples = [req("ok", ttft=0.001 * i) for i in range(1, 101)]
    samples += [req("error", error="engine: boom"), req("shed", error="shed"), Sample("host", {"a": 1}, 1)]
    s = summarize(samples)
    assert (s.scheduled, s.completed, s.failed, s.shed) == (102, 100, 1, 1)
    assert s.errors == {"engine": 1}
    assert s.ttft is not None and s.ttft.p50_ms == pytest.approx(50.5) and s.ttft.max_ms == pytest.approx(100)
    assert s.ttft.p99_ms == pytest.approx(99.01)
    assert s.error_rate == pytest.approx(1 / 101)
    assert s.completed_ratio == pytest.approx(100 / 102)
    assert s.output_tokens == 505


def test_criteria_pass_and_fail() -> None:
    cfg = load(None).criteria
    good = summarize([req("ok") for _ in range(50)])
    results = evaluate(cfg, good, ran_s=120, planned_s=120)
    assert all(r.passed for r in results) and len(results) == 6
    slow = summarize([req("ok", ttft=9.0) for _ in range(50)])
    failed = {r.name for r in evaluate(cfg, slow, ran_s=120, planned_s=120) if not r.passed}
    assert failed == {"ttft_p99_ms"}
    short = {r.name for r in evaluate(cfg, good, ran_s=60, planned_s=120) if not r.passed}
    assert short == {"duration_completed_s"}
    # A resumed crash fails by default (the engine did not serve the whole duration in one piece)...
    crashed = [r for r in evaluate(cfg, good, ran_s=120, planned_s=120, interruptions=1, lost_in_flight=3)]
    bad = {r.name: r for r in crashed if not r.passed}
    assert set(bad) == {"interruptions"} and "3 requests lost" in bad["interruptions"].detail
    # ...and passes where the config allows it.
    lenient = load(None, {"criteria.max_interruptions": 1}).criteria
    assert all(r.passed for r in evaluate(lenient, good, ran_s=120, planned_s=120, interruptions=1))
    off = load(None, {"criteria.max_interruptions": False}).criteria
    assert "interruptions" not in {r.name for r in evaluate(off, good, ran_s=120, planned_s=120)}


def test_no_data_fails_and_switched_off_criteria_are_skipped() -> None:
    cfg = load(None, {"criteria.tpot_p99_ms": False}).criteria
    results = evaluate(cfg, summarize([]), ran_s=10, planned_s=10)
    names = {r.name: r for r in results}
    assert "tpot_p99_ms" not in names
    assert names["ttft_p99_ms"].passed is False and names["ttft_p99_ms"].detail == "no data"
    v = make_verdict("r", results, summarize([]), ran_s=10, planned_s=10, interrupted=False)
    assert v.word == "FAIL" and v.exit_code == 1


def test_verdict_document_and_atomic_write(tmp_path: Path) -> None:
    cfg = load(None).criteria
    s = summarize([req("ok")])
    v = make_verdict(
        "run-1", evaluate(cfg, s, ran_s=5, planned_s=5), s, ran_s=5, planned_s=5, interrupted=False
    )
    path = tmp_path / "verdict.json"
    write_json_atomic(path, v.to_dict())
    doc = json.loads(path.read_text())
    assert doc["verdict"] == "PASS" and doc["exit_code"] == 0 and doc["requests"]["completed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["verdict.json"]  # no temp file left behind
    assert v.lines()[0] == "PASS  run run-1"


def test_an_interrupted_run_never_passes_the_duration_criterion() -> None:
    cfg = load(None).criteria
    s = summarize([req("ok") for _ in range(5)])
    results = evaluate(cfg, s, ran_s=130, planned_s=120, interrupted=True)
    dur = next(r for r in results if r.name == "duration_completed_s")
    assert not dur.passed and dur.detail == "stopped before the end"


def test_quantiles_stay_exact_then_bounded_and_within_the_error() -> None:
    import numpy as np

    from soakd.judge.criteria import Quantiles

    rng = np.random.default_rng(5)
    values = rng.lognormal(-3.0, 1.0, size=200_000)  # latencies around 50 ms with a long tail
    small = Quantiles()
    for v in values[:1000]:
        small.add(float(v))
    # Under the exact limit: numpy's own percentile.
    assert small.percentile(99) == float(np.percentile(values[:1000], 99))
    big = Quantiles()
    for v in values:
        big.add(float(v))
    assert len(big) == 200_000 and big.max == float(values.max())
    for q in (50, 90, 99, 99.9):
        true = float(np.percentile(values, q))
        assert abs(big.percentile(q) - true) / true < 0.005, q  # type: ignore[operator]
    # Bounded: the histogram, not the values.
    assert big._exact is None and big._counts is not None and big._counts.nbytes < 64_000
    zero = Quantiles(exact_limit=2)
    for v in (0.0, 0.0, 0.0, 1e-9):
        zero.add(v)
    assert zero.percentile(50) == 0.0 and zero.percentile(100) == 1e-9


def _strict(text: str) -> object:
    """json.loads that refuses NaN / Infinity, as JavaScript, jq and Go do."""

    def refuse(token: str) -> object:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_figure_that_could_not_be_measured_is_null_in_the_written_json(tmp_path: Path) -> None:
    doc = {"ttft": {"p99_ms": float("nan"), "max_ms": float("inf")}, "rows": [1.5, float("-inf")], "n": 3}
    path = tmp_path / "verdict.json"
    write_json_atomic(path, doc)
    expected = {"ttft": {"p99_ms": None, "max_ms": None}, "rows": [1.5, None], "n": 3}
    assert _strict(path.read_text()) == expected
