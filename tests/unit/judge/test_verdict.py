"""Summaries of request records, criteria, and the verdict document."""

from __future__ import annotations

import ast
import errno
import json
import os
from pathlib import Path

import pytest

from soakd.config import load
from soakd.files import write_json_atomic
from soakd.judge.criteria import Ending, evaluate
from soakd.judge.requests import summarize
from soakd.judge.verdict import Verdict, make_verdict, stop_note, stopped_early, write_verdict
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
    v = make_verdict("r", results, summarize([]), ran_s=10, planned_s=10)
    assert v.word == "FAIL" and v.exit_code == 1


def test_verdict_document_and_atomic_write(tmp_path: Path) -> None:
    cfg = load(None).criteria
    s = summarize([req("ok")])
    v = make_verdict("run-1", evaluate(cfg, s, ran_s=5, planned_s=5), s, ran_s=5, planned_s=5)
    path = tmp_path / "verdict.json"
    write_verdict(tmp_path, v)
    doc = json.loads(path.read_text())
    assert doc["verdict"] == "PASS" and doc["exit_code"] == 0 and doc["requests"]["completed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["verdict.json"]  # no temp file left behind
    assert v.lines()[0] == "PASS  run run-1"


def test_a_run_that_ended_early_on_its_own_never_passes_the_duration_criterion() -> None:
    cfg = load(None).criteria
    s = summarize([req("ok") for _ in range(5)])
    # The drain may push ran_s past the mark: the soak still did not finish.
    results = evaluate(cfg, s, ran_s=130, planned_s=120, ending=Ending(error="engine died"))
    dur = next(r for r in results if r.name == "duration_completed_s")
    assert not dur.passed and dur.detail == "ended early: engine died"
    v = make_verdict("r", results, s, ran_s=130, planned_s=120, ending=Ending(error="engine died"))
    assert v.word == "FAIL" and v.exit_code == 3
    assert v.to_dict()["stopped_early"] is True and v.to_dict()["ended_early"] == "engine died"


def test_an_operators_stop_is_judged_on_the_work_done() -> None:
    cfg = load(None).criteria
    s = summarize([req("ok") for _ in range(5)])
    stop = Ending(stopped_by="SIGINT")
    results = evaluate(cfg, s, ran_s=30, planned_s=120, ending=stop)
    dur = next(r for r in results if r.name == "duration_completed_s")
    assert dur.passed and dur.informational and "stopped at 30 of 120 s by SIGINT" in dur.detail
    v = make_verdict("r", results, s, ran_s=30, planned_s=120, ending=stop)
    assert v.word == "PASS" and v.exit_code == 4
    doc = v.to_dict()
    assert doc["stopped_early"] is True and doc["stopped_by"] == "SIGINT" and doc["exit_code"] == 4
    assert "interrupted" not in doc  # the crashes resumed from are `interruptions`, a different thing
    lines = v.lines()
    assert lines[1] == "  stopped early by SIGINT at 30 s of 120 s: the verdict judges the work done"
    assert any(ln.startswith("  info duration_completed_s = 30 ") for ln in lines)
    # The systemd unit's stop code is what the verdict records.
    assert make_verdict("r", results, s, ran_s=30, planned_s=120, ending=stop, stopped_code=0).exit_code == 0
    # A criterion that does not hold still fails a stopped run.
    bad = summarize([req("ok"), req("error")])
    assert make_verdict("r", evaluate(cfg, bad, ran_s=30, planned_s=120, ending=stop), bad, ran_s=30,
                        planned_s=120, ending=stop).word == "FAIL"  # fmt: skip


def test_a_stop_before_the_replay_began_cannot_pass() -> None:
    off = load(None, {k: False for k in ("criteria.ttft_p99_ms", "criteria.tpot_p99_ms")}).criteria
    stop = Ending(stopped_by="SIGINT", replay_began=False)
    results = evaluate(off, summarize([req("ok")]), ran_s=0, planned_s=120, ending=stop)
    dur = next(r for r in results if r.name == "duration_completed_s")
    assert not dur.passed and "before the replay began" in dur.detail
    v = make_verdict("r", results, summarize([]), ran_s=0, planned_s=120, ending=stop)
    assert v.word == "FAIL" and v.exit_code == 4 and v.to_dict()["replay_began"] is False
    assert "before the replay began: nothing was replayed" in v.lines()[1]


def test_older_verdicts_that_say_interrupted_are_read_as_stopped_early() -> None:
    old = {"verdict": "FAIL", "run_id": "r", "interrupted": True, "ran_s": 10, "planned_s": 60}
    assert stopped_early(old) and stop_note(old) == "stopped before the end"
    assert not stopped_early({"interrupted": False}) and stop_note({"verdict": "PASS"}) == ""


def test_quantiles_stay_exact_then_bounded_and_within_the_error() -> None:
    import numpy as np

    from soakd.judge.requests import Quantiles

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


def queued(ttft: float, queue: float, *, offered: bool = True) -> Sample:
    """An answered request that waited `queue` s at the admission gate (offered: stamped from its due time,
    else a record written before the due-time fields)."""
    fields: dict[str, float | int | str] = {
        "lateness_s": 0.002,
        "queue_s": queue,
        "ttft_s": ttft,
        "tpot_s": 0.01,
        "e2e_s": ttft + 0.04,
        "input_tokens": 10,
        "output_tokens": 5,
    }
    if offered:
        # Stamped at the first token: 1 ms of connection time beyond the sum of the parts, so a fold that
        # read the parts instead of the stamp would be told apart.
        fields |= {"ttft_offered_s": queue + 0.003 + ttft, "e2e_offered_s": queue + 0.003 + ttft + 0.04}
    return Sample("requests", fields, 1, tags={"status": "ok"})


@pytest.mark.parametrize("offered", [True, False])
def test_the_ttft_criterion_judges_the_wait_from_the_due_time(offered: bool) -> None:
    # The ceiling bound: half the requests waited a minute at soakd's gate; the server answered in 100 ms.
    samples = [queued(0.1, 60.0 if i % 2 else 0.0, offered=offered) for i in range(100)]
    s = summarize(samples)
    assert s.ttft is not None and s.ttft.p99_ms == pytest.approx(100.0)
    stamped = 1.0 if offered else 0.0  # the stamp's connection millisecond, where there is a stamp
    assert s.ttft_offered is not None and s.ttft_offered.p99_ms == pytest.approx(60_102.0 + stamped)
    assert s.e2e_offered is not None and s.e2e_offered.max_ms == pytest.approx(60_142.0 + stamped)
    assert s.waited == 50 and s.admission_wait_share == pytest.approx(0.5)
    assert s.queue is not None and s.queue.p99_ms == pytest.approx(60_000.0)
    cfg = load(None, {"criteria.ttft_p99_ms": 5000}).criteria
    ttft = next(r for r in evaluate(cfg, s, ran_s=120, planned_s=120) if r.name == "ttft_p99_ms")
    # The send-relative p99 (100 ms) would pass; the user's (60 s) does not, and the line says both.
    assert not ttft.passed and ttft.value == pytest.approx(60_102.0 + stamped)
    assert "from the send 100 ms" in ttft.detail and "50 % waited" in ttft.detail
    unbound = summarize([queued(0.1, 0.0) for _ in range(10)])
    assert unbound.admission_wait_share == 0.0
    line = next(r for r in evaluate(cfg, unbound, ran_s=120, planned_s=120) if r.name == "ttft_p99_ms")
    assert line.passed and "ceiling" not in line.detail


def test_requests_lost_in_flight_count_in_every_figure_of_the_verdict() -> None:
    from soakd.judge.metrics import RunMetrics
    from soakd.judge.verdict import verdict_of

    metrics = RunMetrics().add_all(req("ok") for _ in range(19))
    cfg = load(
        None, {"criteria.checks": ["errors == 0", "completed_ratio >= 0.95", "requests == 24"]}
    ).criteria
    gap = {"at_s": 30.0, "down_s": 4.0, "lost_in_flight": 5, "resumed_utc": "x"}
    verdict = verdict_of("r", cfg, metrics, ran_s=120, planned_s=120, interruptions=[gap])
    m = verdict.metrics
    assert (m["requests"], m["completed"], m["errors"]) == (24.0, 19.0, 5.0)
    assert m["completed_ratio"] == pytest.approx(19 / 24) and m["error_rate"] == pytest.approx(5 / 24)
    assert verdict.requests.scheduled == 24 and verdict.requests.failed == 5
    checks = {r.expr: r for r in verdict.criteria if r.expr}
    # The checks read the same accounting: 5 of 24 lost is neither `errors == 0` nor 95 % completed.
    assert not checks["errors == 0"].passed and checks["errors == 0"].value == 5.0
    assert not checks["completed_ratio >= 0.95"].passed
    assert checks["requests == 24"].passed
    named = {r.name: r for r in verdict.criteria if not r.expr}
    assert named["completed_ratio"].value == pytest.approx(m["completed_ratio"])


def _verdict(run_id: str) -> Verdict:
    s = summarize([req("ok")])
    results = evaluate(load(None).criteria, s, ran_s=5, planned_s=5)
    return make_verdict(run_id, results, s, ran_s=5, planned_s=5)


def test_a_refused_verdict_leaves_the_earlier_one_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`soakd run` removes an earlier verdict.json (a stop's early verdict) when its own is refused; a
    re-judging keeps the one it could not replace."""
    from soakd.judge import verdict

    write_verdict(tmp_path, _verdict("early"))

    def refuse(path: Path, doc: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(verdict, "write_json_atomic", refuse)
    with pytest.raises(OSError, match="No space left"):
        write_verdict(tmp_path, _verdict("late"))
    assert json.loads((tmp_path / "verdict.json").read_text())["run_id"] == "early"
    with pytest.raises(OSError, match="No space left"):
        write_verdict(tmp_path, _verdict("late"), remove_if_refused=True)
    assert not (tmp_path / "verdict.json").exists()


PACKAGE = Path(__file__).resolve().parents[3] / "daemon" / "soakd"
# Calls that create, replace or remove a file (by name or method); `replace` also catches str.replace,
# which is harmless here: only a scope that also names verdict.json is looked at.
_WRITES = {
    "write_json_atomic", "write_private", "write_text", "write_bytes", "open", "open_no_follow",
    "unlink", "replace", "rename", "remove",
}  # fmt: skip


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _names_verdict(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value == "verdict.json"
    return (isinstance(node, ast.Name) and node.id == "VERDICT_FILE") or (
        isinstance(node, ast.Attribute) and node.attr == "VERDICT_FILE"
    )


def _writes(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")) in _WRITES


def _verdict_writers(source: str, module: str) -> set[str]:
    """The functions (module.qualname; the module for its own statements) that name verdict.json and
    write, replace or remove a file."""
    tree = ast.parse(source)
    scopes: dict[str, list[ast.stmt]] = {module: [n for n in tree.body if not isinstance(n, _DEFS)]}

    def collect(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, _DEFS):
                if not isinstance(node, ast.ClassDef):
                    scopes[f"{prefix}.{node.name}"] = [node]
                collect(node.body, f"{prefix}.{node.name}")

    collect(tree.body, module)
    found = set()
    for name, body in scopes.items():
        nodes = [n for stmt in body for n in ast.walk(stmt)]
        if any(map(_names_verdict, nodes)) and any(map(_writes, nodes)):
            found.add(name)
    return found


def test_one_function_writes_verdict_json() -> None:
    """verdict.json has one writer, judge.verdict.write_verdict: `soakd run` and `soakd report
    --rejudge` both go through it. (Functions that read it name it too; they do not write.)"""
    writers: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        writers |= _verdict_writers(path.read_text(encoding="utf-8"), module)
    assert writers == {"soakd.judge.verdict.write_verdict"}


def test_the_writer_check_sees_a_second_writer() -> None:
    """The check can fail: a method that builds the path in one line and writes it in the next is found,
    and a reader is not."""
    source = (
        "class Soak:\n"
        "    def _judge(self, doc):\n"
        "        path = self.run_dir / VERDICT_FILE\n"
        "        write_json_atomic(path, doc)\n"
        "    def _read(self):\n"
        "        return read_json(self.run_dir / VERDICT_FILE)\n"
        "def drop(run_dir):\n"
        "    (run_dir / 'verdict.json').unlink()\n"
    )
    assert _verdict_writers(source, "m") == {"m.Soak._judge", "m.drop"}


def test_requests_the_run_s_end_left_count_as_unserved_not_as_failures() -> None:
    """A backlog left at the end (status `incomplete`: still at the admission gate, or in flight when the
    drain ran out) is not an engine failure: out of `error_rate` and `errors`, in `completed_ratio`'s
    denominator and named in its detail, and its own run scalar for a check."""
    from soakd.judge.metrics import RunMetrics
    from soakd.judge.verdict import verdict_of

    samples = [req("ok") for _ in range(16)] + [req("error", error="engine: boom")]
    samples += [req("incomplete", error="aborted: replay ended before admission") for _ in range(2)]
    samples += [req("incomplete", error="aborted: replay ended")]
    s = summarize(samples)
    assert (s.scheduled, s.completed, s.failed, s.incomplete, s.incomplete_unsent) == (20, 16, 1, 3, 2)
    assert s.errors == {"engine": 1} and s.error_rate == pytest.approx(1 / 17)
    assert s.completed_ratio == pytest.approx(16 / 20)
    assert s.output_tokens == 5 * 20  # what the cut requests streamed was served

    cfg = load(None, {"criteria.max_error_rate": 0.1, "criteria.checks": ["incomplete <= 2"]}).criteria
    metrics = RunMetrics().add_all(samples)
    verdict = verdict_of("r", cfg, metrics, ran_s=120, planned_s=120, interruptions=[])
    m = verdict.metrics
    assert (m["errors"], m["incomplete"]) == (1.0, 3.0) and m["error_rate"] == pytest.approx(1 / 17)
    named = {r.name: r for r in verdict.criteria if not r.expr}
    assert named["error_rate"].passed and "3 left at the run's end not counted" in named["error_rate"].detail
    assert named["completed_ratio"].detail == "16 of 20 scheduled; 3 left at the run's end, 2 never sent"
    (check,) = [r for r in verdict.criteria if r.expr]
    assert check.value == 3.0 and not check.passed
    # Nothing finished at all: no error rate, and the detail says why.
    (cut,) = [
        r for r in evaluate(cfg, summarize(samples[-3:]), ran_s=9, planned_s=9) if r.name == "error_rate"
    ]
    assert (
        cut.value is None
        and not cut.passed
        and cut.detail == "no data: none finished; 3 left at the run's end"
    )
    # Before the status existed the same requests were `error`s: that accounting is what a failure is.
    old = summarize([req("ok") for _ in range(16)] + [req("error", error="aborted: replay ended")] * 4)
    assert (old.failed, old.incomplete) == (4, 0)


def test_the_window_error_rate_leaves_out_requests_the_end_cut_short() -> None:
    from soakd.judge.metrics import RunMetrics

    samples = [req("ok") for _ in range(3)] + [req("error", error="engine: boom")]
    samples += [req("incomplete", error="aborted: replay ended") for _ in range(4)]
    metrics = RunMetrics().add_all(samples)
    assert metrics.over("error_rate_window") == pytest.approx(1 / 4)
