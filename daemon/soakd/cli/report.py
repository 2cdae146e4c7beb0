"""`soakd report`: a finished run's verdict (recorded, or judged again) and its sign-off report."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from soakd.cli.common import hardware_lines, load_config
from soakd.errors import EXIT_FAIL, EXIT_OK, UsageError
from soakd.files import json_text


def _report_paths(args: argparse.Namespace, run_dir: Path) -> tuple[Path | None, Path] | None:
    """Where the report goes (HTML, JSON); checked before anything is written."""
    from soakd.rundir import REPORT_HTML, REPORT_JSON

    if args.no_report and (args.html or args.report_json or args.no_html):
        raise UsageError("--no-report with --html, --report-json or --no-html: which is it?")
    if args.no_html and args.html:
        raise UsageError("--no-html with --html: which is it?")
    if args.no_report:
        return None
    html = None if args.no_html else args.html or run_dir / REPORT_HTML
    paths = (html, args.report_json or run_dir / REPORT_JSON)
    for flag, path in zip(("--html", "--report-json"), paths, strict=True):
        if path is not None and (path.is_dir() or not path.parent.is_dir()):
            raise UsageError(f"{flag} {path}: not a file in an existing folder")
    return paths


def _verify_digest(run_dir: Path, expected: str) -> int:
    from soakd.report.html import data_digest

    want = expected.strip().lower()
    if len(want) != 64 or any(c not in "0123456789abcdef" for c in want):
        raise UsageError(f"--verify-digest: expected 64 hex digits (a sha256), got {expected!r}")
    digest = data_digest(run_dir)
    same = digest["sha256"] == want
    print(
        f"{'digest ok' if same else 'digest CHANGED'}: {digest['sha256']} over {len(digest['files'])} files "
        f"({digest['bytes']} bytes) of {run_dir}"
    )
    return EXIT_OK if same else EXIT_FAIL


def command(args: argparse.Namespace) -> int:
    from soakd import config
    from soakd.judge.verdict import verdict_lines
    from soakd.report.finished import judge_again, open_run, write_sign_off
    from soakd.report.influxql import read_run
    from soakd.report.runs import find_run
    from soakd.rundir import SPOOL_DIR

    base = load_config(args.config, {}) if args.config else config.load(None, env=os.environ)
    run_dir = find_run(args.run, base.resolve(base.run.output_dir))
    if args.verify_digest is not None:
        return _verify_digest(run_dir, args.verify_digest)
    paths = _report_paths(args, run_dir)
    # Judge by the criteria the run was started with, unless asked to apply another config's.
    run = open_run(run_dir, base if args.config else None)
    if args.ship:
        from soakd.sinks.forwarder import ship_backlog

        icfg = run.config.sinks.influx
        if not icfg.enabled:
            raise UsageError("--ship needs [sinks.influx] enabled = true in the config")
        shipped, refused = asyncio.run(ship_backlog(icfg, run_dir / SPOOL_DIR))
        print(
            f"shipped {shipped} lines to InfluxDB"
            + (f"; it refused {refused} (kept in the run's spool/rejected.lp)" if refused else ""),
            file=sys.stderr,
        )
    recorded = None if args.rejudge else run.recorded_verdict()
    series = None
    if recorded is None:
        metrics, series = (
            read_run(run_dir, run.meta, run.config, from_influx=args.from_influx)
            if paths or args.from_influx
            else (None, None)
        )
        if not args.rejudge:
            print("no verdict was recorded (the run ended before writing one): judged now", file=sys.stderr)
        doc = judge_again(run, metrics).to_dict()
    else:
        doc = recorded
        if paths is not None or args.from_influx:
            _, series = read_run(run_dir, run.meta, run.config, from_influx=args.from_influx)
    if paths is not None and series is not None:
        source = "influx" if args.from_influx else "spool"
        write_sign_off(run, doc, series, *paths, source=source)
        print(f"report: {' and '.join(str(p) for p in paths if p is not None)}", file=sys.stderr)
    if args.json:
        print(json_text(doc, indent=2, default=str))
    else:
        print("\n".join(verdict_lines(doc)))
        for line in hardware_lines(run.summary):
            print(line)
    failed = doc.get("verdict") != "PASS"
    return EXIT_FAIL if args.exit_code and failed else EXIT_OK
