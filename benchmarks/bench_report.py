"""Sign-off report on a long run: how big report.html and report.json get, and how long `soakd report`
takes, for a synthetic 8 h spool at 1 s points.

Run by hand:  .venv/bin/python benchmarks/bench_report.py [--hours 8] [--rps 10] [--gpus 1] [--json]
              [--keep DIR] [--no-browser]

1. A run directory is written: meta.json (the default config, planned --hours), summary.json, and a
   spool in 8 MiB segments with, every second, one point per GPU of `gpu`, `throttle` and `gpu_events`,
   one `engine`, `spec_decode` (3 draft positions), `control`, `replay`, `host`, `throttle` (host) and
   7 `collector` points (the mix of the H200 live soak), `allocator` every 5 s, and `--rps` `requests`
   records a second (TTFT/TPOT drawn lognormal). Every 2 h a 10-minute power-cap episode (clock down,
   power at the limit, throttle_* events, a downscale and an upscale); one re-capture with an engine
   rebuild. Non-report measurements are the real H200 lines with their time replaced, so the spool's
   size and the lines the reader skips are realistic.
2. `soakd report RUN` runs in this process (the CLI's main), timed in phases through its own
   functions: reading and folding the spool, building the series, drawing and writing the report.
3. With Chromium present (and not --no-browser), the page is opened headless and timed to its
   screenshot (load, layout and paint of every inline SVG).

Reported: spool lines and bytes, each phase's seconds, peak RSS, report.html / report.json bytes,
points per plot series, the browser's time.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from soakd.config import load
from soakd.metric import FieldValue, Sample, parse_line
from soakd.sinks.spool import segment_name

ROOT = Path(__file__).resolve().parents[1]
LIVE = ROOT / "tests" / "data" / "h200" / "live_soak" / "spool.lp.gz"
SEGMENT_BYTES = 8 << 20
RUN_ID = "20261201T000000Z-bench-report"


def _templates() -> dict[str, list[Sample]]:
    """Real H200 points of the measurements the report does not read (their size is what matters)."""
    out: dict[str, list[Sample]] = {}
    with gzip.open(LIVE, "rt", encoding="utf-8") as fh:
        for line in fh:
            s = parse_line(line.rstrip("\n"))
            if s.measurement in ("host", "collector", "gpu_events", "replay", "scheduler", "throttle"):
                out.setdefault(s.measurement, []).append(s)
    return out


def _points(hours: float, rps: float, gpus: int, t0: int, rng: random.Random) -> Iterator[Sample]:
    tpl = _templates()
    collectors = tpl["collector"][:7]
    tags = {"run_id": RUN_ID, "host": "bench"}
    seconds = int(hours * 3600)
    yield Sample(
        "events", {"message": "soak starting", "planned_s": float(seconds)}, t0, {**tags, "kind": "run_start"}
    )
    episode_every, episode_len = 7200, 600
    ceiling = 32
    for i in range(seconds):
        t = t0 + i * 10**9 + 1000
        into = i % episode_every
        throttled = i >= 600 and 1800 <= into < 1800 + episode_len
        for g in range(gpus):
            mhz = 1400 + rng.randint(-60, 60) if throttled else 1980
            power = 699.0 + rng.random() if throttled else 450.0 + 80 * rng.random()
            fields: dict[str, FieldValue] = {
                "sm_mhz_min": mhz - rng.randint(0, 40) if throttled else 1980,
                "sm_mhz_mean": float(mhz),
                "sm_mhz_max": 1980,
                "sm_clock_ratio": mhz / 1980,
                "power_w_mean": power,
                "power_w_max": min(700.0, power + 5),
                "power_limit_w": 700.0,
                "temp_c_max": 58 if throttled else 45 + rng.randint(0, 3),
                "hbm_temp_c_max": 52 if throttled else 40 + rng.randint(0, 2),
                "thermal_margin_c": 30.0,
                "mem_total_bytes": 150754820096,
                "mem_used_bytes": 120_000_000_000,
                "reasons_or": 4 if throttled else 0,
                "reason_sw_power_cap_share": 1.0 if throttled else 0.0,
                "util_gpu_mean": 100.0,
                "samples": 10,
                "interval_s": 1.0,
            }
            yield Sample("gpu", fields, t, {**tags, "gpu": str(g)})
            yield Sample(
                "throttle", {"state": 1 if throttled else 0, "throttled_s": 0.0}, t, {**tags, "gpu": str(g)}
            )
            yield Sample("gpu_events", tpl["gpu_events"][0].fields, t, {**tags, "gpu": str(g)})
        if into == 1800 and i >= 600:
            for g in range(gpus):
                yield Sample(
                    "events",
                    {"gpu": float(g), "reasons": "sw_power_cap", "message": f"GPU {g}: ok -> throttled"},
                    t + 1,
                    {**tags, "kind": "throttle_enter"},
                )
            yield Sample(
                "events", {"message": "downscale", "to_limit": 24.0}, t + 2, {**tags, "kind": "downscale"}
            )
            ceiling = 24
        if into == 1800 + episode_len and i >= 600:
            for g in range(gpus):
                yield Sample(
                    "events",
                    {"gpu": float(g), "message": f"GPU {g}: throttled -> ok"},
                    t + 1,
                    {**tags, "kind": "throttle_leave"},
                )
            yield Sample(
                "events", {"message": "upscale", "to_limit": 32.0}, t + 2, {**tags, "kind": "upscale"}
            )
            ceiling = 32
        if i == seconds // 2:
            yield Sample(
                "events", {"message": "re-capture CUDA graphs (done)"}, t + 3, {**tags, "kind": "recapture"}
            )
            yield Sample("events", {"message": "engine rebuilt"}, t + 4, {**tags, "kind": "engine_rebuild"})
        gen = rng.randint(1500, 2500) // (2 if throttled else 1)
        steps = rng.randint(300, 500)
        yield Sample(
            "engine",
            {
                "generation_tokens": gen,
                "interval_s": 1.0,
                "steps": steps,
                "cg_steps": steps,
                "cg_graph_steps": steps - rng.randint(0, 40),
                "running_mean": 12.0,
                "kv_cache_usage_mean": 0.2,
                "prompt_tokens": 4000,
            },
            t,
            {**tags, "config": "abc"},
        )
        drafts = rng.randint(300, 400)
        spec: dict[str, FieldValue] = {"drafts": drafts, "draft_tokens": 3 * drafts, "interval_s": 1.0}
        accepted_total = 0
        for p in range(3):
            acc = int(drafts * (0.95 - 0.1 * p - (0.05 if i > seconds // 2 else 0)))
            spec[f"accepted_pos{p}"] = acc
            spec[f"draft_tokens_pos{p}"] = drafts
            spec[f"acceptance_rate_pos{p}"] = acc / drafts
            accepted_total += acc
        spec["accepted"] = accepted_total
        spec["acceptance_rate"] = accepted_total / (3 * drafts)
        if i > 60:
            spec["acceptance_drift"] = -0.05 if i > seconds // 2 else 0.0
        yield Sample("spec_decode", spec, t, {**tags, "config": "abc"})
        yield Sample("control", {"ceiling": ceiling, "actions": 0, "throttled": int(throttled)}, t, {**tags})
        if i % 5 == 0:
            yield Sample(
                "allocator",
                {"fragmentation": 0.001 + 0.0001 * (i / seconds), "reserved_bytes": 44832915456},
                t,
                {**tags, "worker": "0"},
            )
        for name in ("host", "replay"):
            yield Sample(name, tpl[name][i % len(tpl[name])].fields, t, {**tags})
        yield Sample("throttle", {"state": 0, "throttled_s": 0.0}, t, {**tags, "scope": "host"})
        for c in collectors:
            yield Sample(
                "collector", c.fields, t, {**tags, **{k: v for k, v in c.tags.items() if k == "collector"}}
            )
        n = int(rps) + (1 if rng.random() < rps - int(rps) else 0)
        for k in range(n):
            ttft = math.exp(rng.gauss(math.log(0.02), 0.5)) * (3 if throttled else 1)
            tpot = math.exp(rng.gauss(math.log(0.003), 0.3))
            out = rng.randint(16, 256)
            yield Sample(
                "requests",
                {
                    "index": i * 100 + k,
                    "loop": 0,
                    "turn": 0,
                    "lateness_s": 0.001 * rng.random(),
                    "queue_s": 1e-5,
                    "input_tokens": 300,
                    "input_tokens_trace": 300,
                    "output_tokens": out,
                    "output_tokens_expected": out,
                    "due_ns": t - 10**8,
                    "ttft_s": ttft,
                    "tpot_s": tpot,
                    "itl_mean_s": tpot,
                    "e2e_s": ttft + out * tpot,
                },
                t + 10 + k,
                {**tags, "status": "ok"},
            )
    yield Sample("events", {"message": "replay ended"}, t0 + seconds * 10**9, {**tags, "kind": "run_end"})


def write_run(root: Path, hours: float, rps: float, gpus: int) -> dict[str, Any]:
    run = root / RUN_ID
    (run / "spool").mkdir(parents=True)
    t0 = 1_796_000_000 * 10**9
    rng = random.Random(1)  # noqa: S311 (synthetic test data, repeatable)
    index, size, lines, total = 1, 0, 0, 0
    fh = (run / "spool" / segment_name(index)).open("w", encoding="utf-8")
    try:
        for s in _points(hours, rps, gpus, t0, rng):
            line = s.to_line()
            if line is None:
                continue
            data = line + "\n"
            if size + len(data) > SEGMENT_BYTES:
                fh.close()
                index += 1
                size = 0
                fh = (run / "spool" / segment_name(index)).open("w", encoding="utf-8")
            fh.write(data)
            size += len(data)
            total += len(data)
            lines += 1
    finally:
        fh.close()
    config = load(None).model_dump(mode="json")
    config["run"]["duration"] = hours * 3600
    config["telemetry"]["collectors"] = ["host", "engine", "allocator", "gpu"]
    meta = {"run_id": RUN_ID, "host": "bench", "started_utc": "2026-12-01T00:00:00+00:00", "config": config}
    (run / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    summary = {"run_id": RUN_ID, "ran_s": hours * 3600, "interrupted": False}
    (run / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    return {"run": run, "lines": lines, "bytes": total, "segments": index}


def _timed(fn: Any, key: str, times: dict[str, float]) -> Any:
    def wrapper(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            times[key] = times.get(key, 0.0) + time.perf_counter() - start

    return wrapper


def report(run: Path) -> dict[str, Any]:
    """`soakd report RUN` in this process, its phases timed by wrapping the functions it calls."""
    from soakd import cli
    from soakd.report import html, runs
    from soakd.report.series import SeriesBuilder

    times: dict[str, float] = {}
    originals = (runs.fold_run, SeriesBuilder.build, html.render_html, html.write_private)
    runs.fold_run = _timed(runs.fold_run, "read_and_fold_s", times)
    SeriesBuilder.build = _timed(SeriesBuilder.build, "build_series_s", times)  # type: ignore[method-assign]
    html.render_html = _timed(html.render_html, "draw_html_s", times)
    html.write_private = _timed(html.write_private, "write_s", times)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the verdict's printout: not a result here
            code = cli.main(["--log-level", "warning", "report", str(run)])
    finally:
        runs.fold_run, SeriesBuilder.build, html.render_html, html.write_private = originals  # type: ignore[method-assign]
    times["total_s"] = time.perf_counter() - start
    doc = json.loads((run / "report.json").read_text())
    longest = max(
        (len(s["t"]) for p in doc["data"]["panels"].values() for s in p["series"]),
        default=0,
    )
    return {
        "exit_code": code,
        **{k: round(v, 2) for k, v in times.items()},
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "html_bytes": (run / "report.html").stat().st_size,
        "json_bytes": (run / "report.json").stat().st_size,
        "bucket_s": doc["data"]["bucket_s"],
        "latency_bucket_s": doc["data"]["latency_bucket_s"],
        "most_points_in_a_series": longest,
        "events": len(doc["data"]["events"]),
        "verdict": doc["verdict"]["verdict"],
    }


def browser(page: Path, work: Path) -> dict[str, Any] | None:
    binary = (
        "/usr/lib/chromium/chromium"
        if Path("/usr/lib/chromium/chromium").is_file()
        else shutil.which("chromium")
    )
    if not binary:
        return None
    argv = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={work / 'profile'}",
        "--window-size=1200,6000",
        f"--screenshot={work / 'shot.png'}",
        page.as_uri(),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return {
        "chromium_load_and_screenshot_s": round(time.perf_counter() - start, 2),
        "exit_code": proc.returncode,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--hours", type=float, default=8.0)
    ap.add_argument("--rps", type=float, default=10.0, help="request records per second")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="write the run here and keep it (default: a temp folder)")
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_report_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        made = write_run(root, args.hours, args.rps, args.gpus)
        spool = {
            "hours": args.hours,
            "rps": args.rps,
            "gpus": args.gpus,
            "lines": made["lines"],
            "bytes": made["bytes"],
            "segments": made["segments"],
            "write_s": round(time.perf_counter() - t, 1),
        }
        result = {"spool": spool, "report": report(made["run"])}
        if not args.no_browser:
            result["browser"] = browser(made["run"] / "report.html", root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for section, values in result.items():
            print(
                f"{section}: " + (", ".join(f"{k} {v}" for k, v in values.items()) if values else "skipped")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
