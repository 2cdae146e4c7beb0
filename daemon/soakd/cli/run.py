"""`soakd run`: one soak from the command line, its summary printed and its exit code the verdict's."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from soakd import console
from soakd.cli.common import engine_overrides, hardware_lines, load_config, reading_overrides, trace_arg
from soakd.errors import EXIT_ERROR
from soakd.files import json_text
from soakd.stopsignals import StopSignals


def command(args: argparse.Namespace) -> int:
    # Before anything else: a stop signal in any phase, this one included, stops the run with its verdict
    # (soakd.stopsignals), never the default death.
    signals = StopSignals()
    signals.install()
    try:
        return _run(args, signals)
    finally:
        signals.restore()


def _run(args: argparse.Namespace, signals: StopSignals) -> int:
    from soakd.app import Soak
    from soakd.progress import Progress

    overrides = dict(args.overrides)
    if args.trace:
        overrides["trace.path"] = trace_arg(args.trace)
    if args.duration:
        overrides["run.duration"] = args.duration
    engine_overrides(args, overrides)
    reading_overrides(args, overrides)
    cfg = load_config(args.config, overrides)
    # Whatever the daemon or the engine creates is the service user's alone (spool, state, logs; the
    # run files are also created 0600 explicitly); systemd's UMask= applies the same outside soakd.
    os.umask(0o077)
    # The engine's output (vLLM, torch, their children) goes to the run's engine log, not the console.
    console.detach()
    show = not args.no_progress and sys.stderr.isatty()
    progress = Progress(enabled=show)
    soak = Soak(
        cfg,
        progress=progress.update,
        resume=args.resume,
        stopped_exit_code=args.stopped_exit_code,
        signals=signals,
    )
    try:
        result = asyncio.run(soak.run())
        progress.finish(result.summary)
    finally:
        progress.close()
        console.restore()
    # A signal the run did not see came after its loop ended, its verdict written.
    late = bool(signals.late)
    written = not result.verdict_error
    report = None
    # A service stop (SIGTERM) or a closed terminal (SIGHUP) is quick: the report comes later; so is a
    # stop that came once the verdict was written.
    if cfg.run.report and written and result.stopped_by not in ("SIGTERM", "SIGHUP") and not late:
        from soakd.report.finished import report_after_run

        # The run's loop is gone: a stop now cuts the report short, and the exit code is still the one
        # verdict.json records (not a KeyboardInterrupt's 130 or a default kill).
        try:
            with signals.reporting():
                report = report_after_run(result.run_dir)
        except KeyboardInterrupt:
            print("soakd: stopped while writing the report: `soakd report RUN` writes it", file=sys.stderr)
    if args.json:
        detail = result.verdict.to_dict() if written else None
        doc = {**result.summary, "verdict_detail": detail, "run_dir": str(result.run_dir)}
        print(json_text(doc, indent=2, default=str))
    else:
        print_summary(result.summary, result.run_dir, report)
        if written:
            print("\n".join(result.verdict.lines()))
    if not written:
        # The exit code never claims more than is on disk: no verdict there, no PASS or FAIL here.
        print(
            f"soakd: verdict not written ({result.verdict_error}); the spool holds the run: "
            f"`soakd report {result.run_dir}` judges it once the disk takes it",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if result.error:
        # The verdict is written (FAIL), but the run did not end normally: not a plain FAIL.
        print(f"soakd: run ended early: {result.error}", file=sys.stderr)
    # What verdict.json records: 3 ended early on its own; a stop's code (4; the systemd unit asks for
    # 0: a service stop is a clean end, a cancelled CI job must not look green); else 0 PASS / 1 FAIL.
    return result.verdict.exit_code


def print_summary(summary: dict[str, Any], run_dir: Path, report: Path | None = None) -> None:
    from soakd.progress import summary_requests, summary_tokens_per_s

    req = summary_requests(summary)
    lost = int(req.get("lost_in_flight") or 0)
    print(f"run {summary['run_id']} -> {run_dir}")
    lost_note = f" ({lost} lost in flight at restarts)" if lost else ""
    print(
        f"  requests: {req['scheduled']} scheduled, {req['completed']} completed, "
        f"{req['failed']} failed{lost_note}, {req['shed']} shed"
        + (f", {req['incomplete']} left at the end" if req.get("incomplete") else "")
        + "; "
        f"{req['output_tokens']} output tokens ({summary_tokens_per_s(summary):.1f} tok/s)"
    )
    for line in _latency_lines(req):
        print(line)
    if report is not None:
        print(f"  report: {report}")
    outside = summary.get("outside_trace") or {}
    extra = [
        f"{n} {what}"
        for what, n in (
            ("warm-up", outside.get("warmup_requests", 0)),
            ("vocabulary probe", outside.get("vocab_probe_requests", 0)),
        )
        if n
    ]
    if extra:
        print(f"  also sent, not the trace's: {', '.join(extra)} requests")
    points = ", ".join(f"{k} {v}" for k, v in summary["points"].items())
    print(f"  points: {points}")
    if summary.get("influx"):
        influx = summary["influx"]
        print(f"  influx: {influx['lines_shipped']} lines shipped, backlog {influx['backlog_lines']}")
    for line in hardware_lines(summary):
        print(line)


def _latency_lines(req: dict[str, Any]) -> list[str]:
    """TTFT as offered (the user's view) first, the server's view beside it, and the admission wait."""

    def p99(name: str) -> float | None:
        stats = req.get(name)
        value = stats.get("p99_ms") if isinstance(stats, dict) else None
        return float(value) if isinstance(value, int | float) else None

    offered, sent = p99("ttft_offered"), p99("ttft")
    if offered is None and sent is None:
        return []

    def ms(v: float | None) -> str:
        return "no data" if v is None else f"{v:,.0f} ms"

    out = [
        f"  latency: TTFT p99 as offered {ms(offered)} (from the due time), from the send {ms(sent)}; "
        f"E2E p99 as offered {ms(p99('e2e_offered'))}"
    ]
    share = req.get("admission_wait_share")
    if isinstance(share, int | float) and share > 0:
        from soakd.judge.requests import waited_share

        out.append(
            f"  admission ceiling bound: {waited_share(share)} of requests waited at replay.max_concurrency, "
            f"p99 wait {ms(p99('queue'))} (inside TTFT as offered)"
        )
    return out
