"""argv -> command. Parses arguments, loads the config, calls the component, maps errors to exit codes.

Exit codes: 0 PASS (or success), 1 FAIL (or a check that did not answer), 2 bad input, 3 internal error
of the engine or a sink that ended the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import structlog

from soakd import __version__
from soakd.errors import EngineError, InputError, SinkError, UsageError

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_INPUT = 2
EXIT_ERROR = 3


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, exit 2) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _override(text: str) -> tuple[str, Any]:
    """`--set key=value`, the value read as TOML (so 8, 0.5, true, "x", [1,2] all work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is taken as a string
    return key.strip(), value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="soakd", description="Endurance and telemetry daemon for LLM inference.")
    p.add_argument("--version", action="version", version=f"soakd {__version__}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="replay a trace through the engine and judge the result")
    run.add_argument("--config", type=Path, help="config file (default: built-in defaults)")
    run.add_argument("--trace", help="trace file (overrides trace.path)")
    run.add_argument("--duration", help="how long to replay, e.g. 10m, 8h (overrides run.duration)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_override,
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. replay.speed=2",
    )
    run.add_argument("--json", action="store_true", help="print the final summary as JSON on stdout")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    rep = sub.add_parser("report", help="re-judge a finished run from its spool")
    rep.add_argument("run", help="run directory or run id")
    rep.add_argument(
        "--config", type=Path, help="judge against this config's criteria (default: the run's own)"
    )
    rep.add_argument("--ship", action="store_true", help="also ship what the spool still holds to InfluxDB")
    rep.add_argument("--json", action="store_true")

    chk = sub.add_parser("check", help="validate the config and say what soakd would connect to")
    chk.add_argument("--config", type=Path)
    chk.add_argument("--trace")
    chk.add_argument("--json", action="store_true")

    model = sub.add_parser("model", help="model helpers")
    msub = model.add_subparsers(dest="model_command", required=True, parser_class=_Parser)
    tiny = msub.add_parser("tiny", help="build the tiny random-weight test model (no download)")
    tiny.add_argument("dir", type=Path)
    return p


def _load_config(path: Path | None, overrides: dict[str, Any]) -> Any:
    from soakd import config

    if path is None and os.environ.get("SOAKD_CONFIG"):
        path = Path(os.environ["SOAKD_CONFIG"])
    return config.load(path, overrides)


def _cmd_run(args: argparse.Namespace) -> int:
    from soakd.app import Soak
    from soakd.report.progress import Progress

    overrides = dict(args.overrides)
    if args.trace:
        overrides["trace.path"] = str(Path(args.trace).resolve())
    if args.duration:
        overrides["run.duration"] = args.duration
    cfg = _load_config(args.config, overrides)
    show = not args.no_progress and sys.stderr.isatty()
    progress = Progress(enabled=show)
    soak = Soak(cfg, progress=progress.update)
    try:
        result = asyncio.run(soak.run())
    finally:
        progress.close()
    if args.json:
        doc = {**result.summary, "verdict_detail": result.verdict.to_dict(), "run_dir": str(result.run_dir)}
        print(json.dumps(doc, indent=2, default=str))
    else:
        _print_summary(result.summary, result.run_dir)
        print("\n".join(result.verdict.lines()))
    if result.error:
        # The verdict is written (FAIL), but the run did not end normally: not a plain FAIL.
        print(f"soakd: run ended early: {result.error}", file=sys.stderr)
        return EXIT_ERROR
    return result.verdict.exit_code


def _print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    replay = summary["replay"]
    ran = max(float(summary["ran_s"]), 1e-9)
    print(f"run {summary['run_id']} -> {run_dir}")
    print(
        f"  requests: {replay['scheduled']} scheduled, {replay['completed']} completed, "
        f"{replay['failed']} failed, {replay['shed']} shed; "
        f"{replay['output_tokens']} output tokens ({replay['output_tokens'] / ran:.1f} tok/s)"
    )
    points = ", ".join(f"{k} {v}" for k, v in summary["points"].items())
    print(f"  points: {points}")
    if summary.get("influx"):
        influx = summary["influx"]
        print(f"  influx: {influx['lines_shipped']} lines shipped, backlog {influx['backlog_lines']}")


def _cmd_report(args: argparse.Namespace) -> int:
    from soakd import config
    from soakd.report.runs import META_FILE, find_run, judge, read_json

    base = _load_config(args.config, {}) if args.config else config.load(None)
    run_dir = find_run(args.run, base.resolve(base.run.output_dir))
    meta = read_json(run_dir / META_FILE)
    if not isinstance(meta.get("config"), dict) or "run_id" not in meta:
        raise UsageError("not a soakd run's metadata (no config or run_id)", file=run_dir / META_FILE)
    # Judge by the criteria the run was started with, unless asked to apply another config's.
    judged_by = base if args.config else config.Config.model_validate(meta["config"])
    criteria = judged_by.criteria
    summary_path = run_dir / "summary.json"
    summary = read_json(summary_path) if summary_path.exists() else {}
    planned = float(meta["config"]["run"]["duration"])
    # A run that never wrote its summary died before the end: judge it as interrupted at 0 s.
    verdict = judge(
        run_dir,
        str(meta["run_id"]),
        criteria,
        ran_s=float(summary.get("ran_s", 0.0)),
        planned_s=planned,
        interrupted=bool(summary.get("interrupted", not summary)),
    )
    if args.ship:
        shipped = asyncio.run(
            _ship(base if args.config else config.Config.model_validate(meta["config"]), run_dir)
        )
        print(f"shipped {shipped} lines to InfluxDB", file=sys.stderr)
    if args.json:
        print(json.dumps(verdict.to_dict(), indent=2, default=str))
    else:
        print("\n".join(verdict.lines()))
    return verdict.exit_code


async def _ship(cfg: Any, run_dir: Path) -> int:
    from soakd.report.runs import SPOOL_DIR
    from soakd.sinks.forwarder import Forwarder
    from soakd.sinks.influx import make_writer

    icfg = cfg.sinks.influx
    if not icfg.enabled:
        raise UsageError("--ship needs [sinks.influx] enabled = true in the config")
    writer = make_writer(icfg, os.environ)
    try:
        fwd = Forwarder(run_dir / SPOOL_DIR, writer, icfg.batch_lines)
        before = fwd.lines_shipped
        if not await fwd.drain(icfg.final_drain_timeout):
            raise SinkError(f"InfluxDB did not take the backlog: {fwd.last_error}")
        return fwd.lines_shipped - before
    finally:
        await writer.aclose()


def _cmd_check(args: argparse.Namespace) -> int:
    from soakd.checks import run_checks

    overrides = {"trace.path": str(Path(args.trace).resolve())} if args.trace else {}
    cfg = _load_config(args.config, overrides)
    results = asyncio.run(run_checks(cfg))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        for r in results:
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.name}: {r.detail}")
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAIL


def _cmd_model(args: argparse.Namespace) -> int:
    from soakd.tinymodel import build_tiny_model

    out = build_tiny_model(args.dir)
    print(f"tiny model written to {out}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    # vLLM's own INFO lines would drown soakd's; its warnings still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # stdout carries results (--json); vLLM logs to stdout by default.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from soakd.logs import configure

    try:
        args = build_parser().parse_args(argv)
        configure(args.log_level, journald_prefix="JOURNAL_STREAM" in os.environ)
        handlers = {"run": _cmd_run, "report": _cmd_report, "check": _cmd_check, "model": _cmd_model}
        return handlers[args.command](args)
    except InputError as err:
        print(f"soakd: error: {err}", file=sys.stderr)
        return EXIT_INPUT
    except (EngineError, SinkError) as err:
        print(f"soakd: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("soakd: interrupted", file=sys.stderr)
        return 130
    # Anything else is a bug or an outside failure: exit 3, never 1, which means FAIL (a normal end).
    except Exception as err:  # noqa: BLE001
        structlog.get_logger("soakd").exception("internal_error")
        print(f"soakd: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_ERROR
