"""The sign-off report (`soakd report` -> report.html + report.json) over real H200 runs: the control run
(a 700 W power-cap episode, a downscale, a CUDA-graph re-capture with an engine rebuild, an upscale)
and the soak run (spec decoding, no GPU series): series, episodes, sections, digest, bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from soakd.cli import main
from soakd.config import CriteriaConfig
from soakd.metric import Sample, parse_line
from soakd.report.html import build_doc, render_html
from soakd.report.series import SeriesBuilder, nice_bucket

H200 = Path(__file__).parents[2] / "data" / "h200"


def _lines(name: str) -> bytes:
    return gzip.decompress((H200 / name).read_bytes())


def control_run(root: Path) -> Path:
    """A run directory from the recorded control run: its spool and summary, the config of the H200
    runs (the gpu collector on), started when its first event was written."""
    spool = _lines("control/spool.lp.gz")
    run_id = spool.split(b"run_id=", 1)[1].split(b" ", 1)[0].split(b",", 1)[0].decode()
    run = root / run_id
    (run / "spool").mkdir(parents=True)
    # Two segments, as a long run has them: the digest covers both, in order.
    cut = spool.index(b"\n", len(spool) // 2) + 1
    (run / "spool" / "seg-00000001.lp").write_bytes(spool[:cut])
    (run / "spool" / "seg-00000002.lp").write_bytes(spool[cut:])
    meta = json.loads((H200 / "rebuild" / "meta.json").read_text())
    meta["run_id"] = run_id
    meta["config"]["run"]["duration"] = 100.0
    meta["config"]["telemetry"]["collectors"] = ["host", "engine", "allocator", "gpu"]
    meta["config"]["engine"]["speculative"]["enabled"] = False
    meta["started_utc"] = "2026-11-30T04:22:52+00:00"
    (run / "meta.json").write_text(json.dumps(meta))
    (run / "summary.json").write_text((H200 / "control" / "summary.json").read_text())
    return run


@pytest.fixture(scope="module")
def control_samples() -> list[Sample]:
    return [parse_line(line) for line in _lines("control/spool.lp.gz").decode().splitlines()]


def _build(samples: list[Sample], **kw: Any) -> dict[str, Any]:
    b = SeriesBuilder()
    for s in samples:
        b.add(s)
    return b.build({}, **kw)


def test_series_do_not_depend_on_the_order_points_arrive_in_nor_on_int_or_float(
    control_samples: list[Sample],
) -> None:
    data = _build(control_samples)
    shuffled = list(control_samples)
    random.Random(7).shuffle(shuffled)
    # InfluxDB's JSON gives a float field 700.0 back as 700: numbers are read as floats.
    as_ints = [
        Sample(
            s.measurement,
            {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in s.fields.items()},
            s.time_ns,
            s.tags,
        )
        for s in shuffled
    ]
    assert json.dumps(_build(as_ints), sort_keys=True) == json.dumps(data, sort_keys=True)


def test_the_power_cap_episode_is_where_the_clock_dropped_and_the_power_sat_at_its_limit(
    control_samples: list[Sample],
) -> None:
    data = _build(control_samples)
    (ep,) = data["episodes"]
    assert ep["scope"] == "GPU 0" and "sw_power_cap" in ep["reasons"] and not ep["open"]
    assert ep["start_s"] < ep["recovering_s"] < ep["end_s"]
    (clock,) = data["panels"]["sm_clock"]["series"]
    (power,) = data["panels"]["power"]["series"]
    inside = [i for i, t in enumerate(clock["t"]) if ep["start_s"] + 5 <= t <= ep["recovering_s"] - 10]
    before = [i for i, t in enumerate(clock["t"]) if 45 <= t <= ep["start_s"] - 5]
    assert inside and before
    # Throttled: the clock's lowest reading well under its 1980 MHz maximum, the power at the 700 W cap.
    assert max(clock["lo"][i] for i in inside) < 1600 < min(clock["mid"][i] for i in before)
    assert min(power["hi"][i] for i in inside) > 650
    assert data["panels"]["power"]["refs"] == [{"name": "GPU power limit", "value": 700.0}]
    kinds = {e["kind"] for e in data["events"]}
    assert {"downscale", "recapture", "engine_rebuild", "upscale"} <= kinds
    (ceiling,) = data["panels"]["actions"]["series"]
    assert {v for v in ceiling["mid"] if v is not None} >= {32.0, 24.0, 30.0}
    # The control run's engine had no CUDA-graph metrics and no speculation: said, not left out.
    assert data["panels"]["cudagraph"]["series"] == [] and "CUDA-graph" in data["panels"]["cudagraph"]["why"]
    # Its decode_ceiling_pct counted tokens against a tokens ceiling: not drawn as a bandwidth share.
    bandwidth = data["panels"]["bandwidth"]
    assert bandwidth["series"] == [] and "recorded before soakd counted decode steps" in bandwidth["why"]


def test_the_bandwidth_panel_puts_measured_dram_beside_the_computed_decode_reads() -> None:
    s = 1_000_000_000
    samples = [
        *(Sample("engine", {"decode_bw_pct": 30.0 + k, "generation_tokens": 10}, k * s) for k in range(4)),
        *(Sample("gpu", {"gpm_dram_bw_pct": 40.0 + k}, k * s, {"gpu": "0"}) for k in range(4)),
    ]
    computed, measured = _build(samples)["panels"]["bandwidth"]["series"]
    assert computed["name"] == "decode reads (computed)" and computed["mid"] == [30.0, 31.0, 32.0, 33.0]
    assert measured["name"] == "GPU DRAM (GPM)" and measured["hi"] == [40.0, 41.0, 42.0, 43.0]
    assert "no decode bandwidth" in _build([])["panels"]["bandwidth"]["why"]


def test_eight_hours_of_one_second_points_are_cut_to_minute_buckets_keeping_a_one_second_dip() -> None:
    t0 = 1_800_000_000 * 10**9
    samples = [
        Sample(
            "gpu",
            {"sm_mhz_min": 1200 if i == 12_345 else 1980, "sm_mhz_mean": 1980.0, "sm_mhz_max": 1980},
            t0 + i * 10**9,
            {"gpu": "0"},
        )
        for i in range(8 * 3600)
    ]
    data = _build(samples)
    (clock,) = data["panels"]["sm_clock"]["series"]
    assert data["bucket_s"] == 60.0 == nice_bucket(8 * 3600, 600)
    assert len(clock["t"]) == 480
    dips = [t for t, lo in zip(clock["t"], clock["lo"], strict=True) if lo == 1200.0]
    assert dips == [12_330.0]  # the bucket [12300, 12360) s holds it, drawn at its middle
    assert set(clock["mid"]) == {1980.0}


def test_report_json_of_the_control_run_and_its_digest_checked_later(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = control_run(tmp_path)
    code = main(["report", str(run), "--no-html", "--exit-code"])
    out, err = capsys.readouterr()
    assert code == 1 and out.startswith("FAIL")  # ttft_p99_ms: requests waited through the rebuild
    assert "report: " in err and not (run / "report.html").exists()
    doc = json.loads((run / "report.json").read_text())
    for path in (run / "report.json", run / "verdict.json"):
        assert path.stat().st_mode & 0o777 == 0o600
    assert not list(run.glob(".*tmp"))
    assert doc["verdict"] == json.loads((run / "verdict.json").read_text())
    env = {g["group"]: dict(g["items"]) for g in doc["environment"]}
    assert env["Engine"]["vLLM version"] == "0.26.0"
    assert env["Trace"]["sha256"] == json.loads((run / "meta.json").read_text())["trace"]["sha256"]
    assert env["GPU"]["GPU 0 (from its series)"] == "140.4 GiB, power limit 700 W"
    assert doc["generated"]["source"] == "spool"

    # The digest is what `cat spool/seg-*.lp meta.json verdict.json | sha256sum` gives.
    want = hashlib.sha256(
        b"".join(
            p.read_bytes()
            for p in [*sorted((run / "spool").glob("seg-*.lp")), run / "meta.json", run / "verdict.json"]
        )
    ).hexdigest()
    assert doc["digest"]["sha256"] == want
    assert doc["digest"]["files"] == [
        "spool/seg-00000001.lp",
        "spool/seg-00000002.lp",
        "meta.json",
        "verdict.json",
    ]
    assert main(["report", str(run), "--verify-digest", want.upper()]) == 0
    segment = run / "spool" / "seg-00000001.lp"
    data = segment.read_bytes()
    segment.write_bytes(data.replace(b"power_w_max=79.902", b"power_w_max=79.903", 1))
    assert main(["report", str(run), "--verify-digest", want]) == 1
    assert "digest CHANGED" in capsys.readouterr().out


def test_an_expression_criterion_shows_its_expression_and_a_run_without_points_renders() -> None:
    verdict = {
        "run_id": "r",
        "verdict": "PASS",
        "passed": True,
        "ran_s": 60.0,
        "planned_s": 60.0,
        "interrupted": False,
        "criteria": [
            {
                "name": "ttft_ratio",
                "op": "<=",
                "threshold": 2.0,
                "value": 1.5,
                "passed": True,
                "detail": "",
                "expr": "p99(ttft) / p50(ttft)",
            }
        ],
        "requests": {},
    }
    doc = build_doc(Path("/nonexistent"), {"run_id": "r"}, verdict, SeriesBuilder().build({}), source="spool")
    page = render_html(doc)
    assert "<th>expression</th>" in page and "p99(ttft) / p50(ttft)" in page
    # Panels without data are one line naming each and why, not a box each; no events is one line too.
    assert "<figure" not in page and page.count('id="not-recorded"') == 1
    line = page.split('id="not-recorded"', 1)[1].split("</p>", 1)[0]
    assert line.count('<span id="plot-') == 11 and "SM clock" in line
    assert "No events in this run." in page


@pytest.mark.parametrize(
    ("meta", "says"),
    [
        (
            {"config": {"telemetry": {"collectors": ["host", "engine"]}}},
            "not read: the gpu collector was off",
        ),
        (
            {"config": {"telemetry": {"collectors": ["gpu"]}}, "gpu": {"source": "none", "reason": "no GPU"}},
            "none: no GPU (GPU telemetry was off)",
        ),
        (
            {"config": {"telemetry": {"collectors": ["gpu"]}}, "engine": {"details": {"platform": "cpu"}}},
            "none: the engine ran on the CPU platform",
        ),
        ({"config": {"telemetry": {"collectors": ["gpu"]}}}, "not recorded in meta.json (runs before soakd"),
    ],
)
def test_the_gpu_table_says_why_a_run_has_no_gpu(meta: dict[str, Any], says: str) -> None:
    doc = build_doc(Path("/nonexistent"), meta, {"run_id": "r"}, SeriesBuilder().build({}), source="spool")
    gpu = next(g["items"] for g in doc["environment"] if g["group"] == "GPU")
    assert says in gpu[0][1]
    assert gpu[-1] == ["GPU series", "none in this run"]
    assert doc["digest"]["files"] == []


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--html", "{tmp}/no/such/folder/r.html"], "not a file in an existing folder"),
        (["--report-json", "{tmp}"], "not a file in an existing folder"),
        (["--verify-digest", "12ab"], "expected 64 hex digits"),
        (["--no-report", "--html", "{tmp}/r.html"], "--no-report with --html"),
    ],
)
def test_bad_report_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    run = control_run(tmp_path)
    before = sorted(p.name for p in run.iterdir())
    code = main(["report", str(run), *(a.format(tmp=tmp_path) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2 and reason in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == before


def test_influx_reader_reads_a_cut_short_window_again_in_halves_and_drops_empty_tags() -> None:
    """InfluxDB marks an answer cut at its row limit `partial`: the window is read again in halves
    (a real 1.6.7 server with the default config never cuts, so its answers are played here)."""
    import httpx

    from soakd.config import InfluxConfig
    from soakd.report.influxql import InfluxReader

    seen: list[tuple[int, int]] = []
    rows = [(t * 10**9, float(t)) for t in range(0, 100, 10)]

    def answer(request: httpx.Request) -> httpx.Response:
        q = dict(httpx.QueryParams(request.content.decode()))["q"]
        assert q.startswith(
            'SELECT "fragmentation","reserved_bytes_peak","reserved_bytes" FROM "allocator" '
            "WHERE \"run_id\" = 'r\\'1'"
        )
        start, end = (int(x) for x in re.findall(r"time [<>]=? (\d+)", q))
        seen.append((start, end))
        inside = [[t, v] for t, v in rows if start <= t < end]
        series = {
            "name": "allocator",
            "tags": {"worker": "0", "config": ""},
            "columns": ["time", "fragmentation"],
        }
        if len(inside) > 3:
            return httpx.Response(
                200, json={"results": [{"series": [{**series, "values": inside[:3], "partial": True}]}]}
            )
        return httpx.Response(
            200, json={"results": [{"series": [{**series, "values": [*inside, [end, None]]}]}]}
        )

    reader = InfluxReader(InfluxConfig(), {}, transport=httpx.MockTransport(answer))
    with reader:
        got = list(reader.samples("allocator", "r'1", 0, 80 * 10**9))
    assert [s.time_ns for s in got] == [t * 10**9 for t in range(0, 80, 10)]
    assert all(s.tags == {"worker": "0"} for s in got)
    assert seen[0] == (0, 80 * 10**9) and (0, 40 * 10**9) in seen and len(seen) > 3


def test_a_run_whose_config_this_soakd_cannot_load_is_bad_input_naming_meta_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = control_run(tmp_path)
    meta = json.loads((run / "meta.json").read_text())
    meta["config"]["trace"]["synthetic"]["rate_rps"] = 2.0  # a key an older soakd wrote
    (run / "meta.json").write_text(json.dumps(meta))
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"soakd: error: {run / 'meta.json'}: the run's config does not load")
    assert "trace.synthetic.rate_rps" in err and "--config FILE" in err and len(err.splitlines()) == 1
    assert not (run / "verdict.json").exists() and not (run / "report.html").exists()


def test_the_report_after_a_run_uses_the_run_s_own_verdict_and_never_fails_the_run(tmp_path: Path) -> None:
    from soakd.report.finished import report_after_run
    from soakd.report.runs import judge

    run = control_run(tmp_path)
    meta = json.loads((run / "meta.json").read_text())
    judge(run, meta["run_id"], CriteriaConfig(), ran_s=100.0, planned_s=100.0)
    written = json.loads((run / "verdict.json").read_text())
    with capture_logs() as logs:
        report_after_run(run)
    report = json.loads((run / "report.json").read_text())
    assert report["verdict"] == written and "<svg" in (run / "report.html").read_text()
    assert "report_not_written" not in [e["event"] for e in logs]
    # A run whose files are unreadable: said in the log, nothing raised (the run's exit code stands).
    (run / "verdict.json").write_text("{not json")
    (run / "report.html").unlink()
    with capture_logs() as logs:
        report_after_run(run)
    assert "report_not_written" in [e["event"] for e in logs] and not (run / "report.html").exists()


def test_report_shows_the_recorded_verdict_and_judges_again_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from soakd.report.runs import judge

    run = control_run(tmp_path)
    meta = json.loads((run / "meta.json").read_text())
    lenient = CriteriaConfig(ttft_p99_ms=False, tpot_p99_ms=False, max_error_rate=1.0, min_completed_ratio=0)
    judge(run, meta["run_id"], lenient, ran_s=100.0, planned_s=100.0)
    recorded = (run / "verdict.json").read_bytes()
    assert json.loads(recorded)["verdict"] == "PASS"
    # The run's own verdict, shown as written; verdict.json (under the signed digest) is not touched.
    assert main(["report", str(run), "--no-html", "--exit-code"]) == 0
    assert (run / "verdict.json").read_bytes() == recorded and "PASS  run" in capsys.readouterr().out
    # Judged again by a stricter config's criteria: FAIL, rewritten; the exit code only when asked.
    strict = tmp_path / "strict.toml"
    strict.write_text(f'[run]\noutput_dir = "{tmp_path}"\n[criteria]\nchecks = ["requests > 1e9"]\n')
    assert main(["report", str(run), "--config", str(strict), "--rejudge", "--no-report"]) == 0
    rejudged = json.loads((run / "verdict.json").read_text())
    assert rejudged["verdict"] == "FAIL" and any(c["expr"] == "requests > 1e9" for c in rejudged["criteria"])
    assert main(["report", str(run), "--no-report", "--exit-code"]) == 1  # the verdict now on record
    out = capsys.readouterr().out
    assert out.count("FAIL  run") == 2


def test_a_run_without_gpu_telemetry_draws_only_what_it_measured(tmp_path: Path) -> None:
    from soakd.testing import recorded_run_dir

    run = recorded_run_dir(tmp_path, "server", data=H200)
    meta = json.loads((run / "meta.json").read_text())
    meta["config"]["telemetry"]["collectors"] = ["host", "engine"]
    (run / "meta.json").write_text(json.dumps(meta))
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    line = page.split('id="not-recorded"', 1)[1].split("</p>", 1)[0]
    # The three GPU panels under one reason, said once; no box or figure for any of them.
    off = "the gpu collector was not enabled (telemetry.collectors)"
    assert line.count(off) == 1 and line.index("SM clock") < line.index("GPU temperature") < line.index(off)
    assert 'id="plot-sm_clock" class="plot"' not in page and 'id="plot-throughput" class="plot"' in page
    assert "not read: the gpu collector was off" in page


def test_judging_again_keeps_how_the_run_stopped(tmp_path: Path) -> None:
    run = control_run(tmp_path)
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    # A run the systemd unit stopped (exit 0 recorded): still judged on the work done, still 0.
    summary |= {"stopped_early": True, "stopped_by": "SIGTERM", "error": "", "replay_began": True}
    summary.pop("interrupted", None)
    summary_path.write_text(json.dumps(summary))
    (run / "verdict.json").write_text(json.dumps({"verdict": "PASS", "exit_code": 0, "stopped_early": True}))
    assert main(["report", str(run), "--rejudge"]) == 0
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["stopped_by"] == "SIGTERM" and verdict["exit_code"] == 0
    (duration,) = [c for c in verdict["criteria"] if c["name"] == "duration_completed_s"]
    assert duration["informational"] and duration["passed"]
    page = (run / "report.html").read_text()  # the banner says it was stopped; the line is no PASS
    assert "(stopped early by SIGTERM at " in page and ">info</td>" in page
    # An older run: its summary says `interrupted` (only a stop signal set it) and no `error`, its
    # verdict's exit_code was PASS/FAIL's. An operator's stop still, exiting as `soakd run` does (4).
    summary = {k: v for k, v in summary.items() if k not in ("stopped_early", "stopped_by", "replay_began")}
    summary_path.write_text(json.dumps({**summary, "interrupted": True}))
    (run / "verdict.json").write_text(json.dumps({"verdict": "FAIL", "exit_code": 1, "interrupted": True}))
    assert main(["report", str(run), "--rejudge", "--no-report"]) == 0
    verdict = json.loads((run / "verdict.json").read_text())
    (duration,) = [c for c in verdict["criteria"] if c["name"] == "duration_completed_s"]
    assert duration["informational"] and duration["passed"] and verdict["stopped_early"]
    assert verdict["exit_code"] == 4 and verdict["stopped_by"] in ("SIGTERM", "a stop signal")
    # ...and one that ended early on its own (its `error` said why) still fails the duration line.
    summary_path.write_text(json.dumps({**summary, "interrupted": True, "error": "engine: it died"}))
    assert main(["report", str(run), "--rejudge", "--no-report"]) == 0
    verdict = json.loads((run / "verdict.json").read_text())
    (duration,) = [c for c in verdict["criteria"] if c["name"] == "duration_completed_s"]
    assert not duration["passed"] and duration["detail"] == "ended early: engine: it died"
    assert verdict["verdict"] == "FAIL" and verdict["exit_code"] == 3
