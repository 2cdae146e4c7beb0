"""argv -> command. Parses arguments, loads the config, calls the component, maps errors to exit codes.

Exit codes: 0 PASS (or success), 1 FAIL (or a check that did not answer), 2 bad input, 3 aborted: the run
ended early on its own (engine failure, an `abort_on` criterion, a changed trace) or an internal error,
4 stopped by a signal before its end (SIGINT, SIGTERM, SIGHUP; drained, verdict of the work done written,
marked stopped early; the systemd unit passes `--stopped-exit-code 0`, a service stop being a clean end).
A run whose verdict.json cannot be written (a full disk) exits 3: the exit code never claims more than is
on disk. verdict.json records the code its run returns.

Over 500 lines because it holds the parser of every subcommand and their printing, one function each; the
work lives in the modules they call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import structlog

from soakd import __version__, console
from soakd.errors import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_INPUT,
    EXIT_OK,
    EXIT_STOPPED,
    EngineError,
    InputError,
    SinkError,
    UsageError,
)
from soakd.files import json_text
from soakd.stopsignals import StopSignals

log = structlog.get_logger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, exit 2) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _override(text: str) -> tuple[str, Any]:
    """`--set key=value`, the value read as TOML (so 8, 0.5, true, "x", [1,2] all work)."""
    from soakd.config import parse_value

    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), parse_value(raw)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{key.strip()}: {err}") from None


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (a count that sizes a list or a buffer)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high:,}, got {value:,}")
        return value

    return parse


def _duration(text: str) -> float:
    from soakd.units import parse_duration

    try:
        # A bare number on the command line is seconds ("85"), like "85s".
        seconds = parse_duration(float(text) if text.replace(".", "", 1).isdigit() else text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return seconds


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return value


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "console", "json", "journald")


def _log_level_everywhere(parser: argparse.ArgumentParser) -> None:
    """`--log-level` and `--log-format` after the subcommand too (`soakd run --log-level debug`), not
    only before it; the top level's default stands unless a subcommand is given one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                sub.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS)
                sub.add_argument("--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS)
                _log_level_everywhere(sub)


def _described_everywhere(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's `--help` opens with a description: its own where it has one, else the line
    the list of subcommands shows for it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                sub = action.choices[choice.dest]
                if sub.description is None and choice.help:
                    # A help line is %-formatted by argparse, a description is not.
                    text = choice.help.replace("%%", "%")
                    sub.description = f"{text[0].upper()}{text[1:]}."
                _described_everywhere(sub)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="soakd",
        description="Endurance and telemetry daemon for LLM inference.",
        epilog="exit codes: 0 PASS; 1 FAIL (a criterion did not hold); 2 bad input (config, trace, "
        "arguments: one line naming file, line and key); 3 aborted (the run ended early on its own: engine "
        "failure, an abort_on criterion, a changed trace; the verdict could not be written; or an internal "
        "error); 4 stopped by SIGINT, SIGTERM or SIGHUP before its end (drained, verdict of the work done "
        "written; see run --stopped-exit-code)",
    )
    p.add_argument("--version", action="version", version=f"soakd {__version__}")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="auto: readable lines on a terminal, journal fields under journald, JSON lines otherwise",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _run_parser(sub)
    _report_parser(sub)
    _compare_parser(sub)
    _matrix_parser(sub)
    _check_parser(sub)
    _trace_parser(sub)
    _tools_parsers(sub)
    _log_level_everywhere(p)
    _described_everywhere(p)
    return p


def _run_parser(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="replay a trace through the engine and judge the result",
        description="Start the engine (or attach to a server with --target), send the trace's requests "
        "on its clock for run.duration while the collectors record GPU, host and engine telemetry, then "
        "judge the criteria: verdict.json, summary.json, meta.json and the sign-off report.html in a new "
        "run folder under run.output_dir.",
    )
    run.add_argument("--config", type=Path, help="config file (default: built-in defaults)")
    run.add_argument("--trace", help="trace file (overrides trace.path)")
    run.add_argument("--duration", help="how long to replay, e.g. 10m, 8h (overrides run.duration)")
    _engine_flags(run)
    _set_flag(run, "replay.speed=2")
    run.add_argument("--json", action="store_true", help="print the final summary as JSON on stdout")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--stopped-exit-code",
        type=_int_in(0, 255),
        default=EXIT_STOPPED,
        metavar="CODE",
        help=f"exit code of a run stopped by SIGINT/SIGTERM/SIGHUP (default {EXIT_STOPPED}; the systemd "
        "unit: 0)",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest unfinished run of this config (after a crash) instead of a new one",
    )
    _trace_reading_flags(run)


def _report_parser(sub: Any) -> None:
    rep = sub.add_parser(
        "report",
        help="a finished run's verdict and its sign-off report",
        description="Show a finished run's verdict and write its sign-off report (report.html and "
        "report.json in the run folder), from its spool or InfluxDB; --rejudge judges it again.",
    )
    rep.add_argument("run", help="run directory or run id")
    rep.add_argument(
        "--config",
        type=Path,
        help="config for the runs folder and InfluxDB; with --rejudge, its criteria (default: the run's)",
    )
    rep.add_argument(
        "--rejudge",
        action="store_true",
        help="judge the run again and rewrite verdict.json (its data digest changes); default: the "
        "verdict the run wrote",
    )
    rep.add_argument("--exit-code", action="store_true", help="exit 1 when the verdict is FAIL (default 0)")
    rep.add_argument("--ship", action="store_true", help="also ship what the spool still holds to InfluxDB")
    rep.add_argument("--json", action="store_true", help="print the verdict as JSON on stdout")
    rep.add_argument(
        "--html", type=Path, metavar="PATH", help="write the HTML report here (default RUN/report.html)"
    )
    rep.add_argument(
        "--report-json",
        type=Path,
        metavar="PATH",
        help="write the report's JSON twin here (default RUN/report.json)",
    )
    rep.add_argument("--no-report", action="store_true", help="write no report.html/report.json")
    rep.add_argument("--no-html", action="store_true", help="write report.json only (no plots drawn)")
    rep.add_argument(
        "--from-influx",
        action="store_true",
        help="read the run's points from InfluxDB ([sinks.influx], InfluxQL /query) instead of its spool",
    )
    rep.add_argument(
        "--verify-digest",
        metavar="HEX",
        help="only check the run's data digest against HEX (from a signed report): exit 0 same, 1 changed",
    )


def _check_parser(sub: Any) -> None:
    chk = sub.add_parser(
        "check",
        help="validate the config and say what soakd would connect to",
        description="Validate the config and the trace, and say what a run would use and whether each "
        "answers: the model, vLLM, the GPUs NVML sees, InfluxDB (exit 1 when one does not).",
    )
    chk.add_argument("--config", type=Path)
    chk.add_argument("--trace")
    _engine_flags(chk)
    _set_flag(chk, "engine.kind=openai (what `run --set` would use)")
    chk.add_argument("--json", action="store_true")


def _tools_parsers(sub: Any) -> None:
    """telemetry, probe, model: the tools around a soak."""
    tel = sub.add_parser("telemetry", help="GPU telemetry without a soak")
    telsub = tel.add_subparsers(dest="telemetry_command", required=True, parser_class=_Parser)
    trec = telsub.add_parser(
        "record", help="record raw NVML readings (fast and slow tier) of every GPU to a file, for replay"
    )
    trec.add_argument("--duration", type=_duration, required=True, help="how long, e.g. 90s or 10m")
    trec.add_argument("--fast-hz", type=_positive, default=10.0, help="fast-tier samples per second")
    trec.add_argument("--slow-hz", type=_positive, default=1.0, help="slow-tier samples per second")
    trec.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    trec.add_argument("out", type=Path, help="output file (.jsonl, or .jsonl.gz to compress)")

    prb = sub.add_parser(
        "probe", help="hardware profile (bandwidth, L2, PCIe, power) and the model's decode ceiling"
    )
    prb.add_argument("--model", type=Path, help="model folder (config.json + safetensors) for the ceiling")
    prb.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: weights counted from config.json, as vLLM allocates them (a shape folder always is)",
    )
    prb.add_argument("--no-copy", action="store_true", help="skip the measured device-copy bandwidth")
    prb.add_argument("--json", action="store_true")

    model = sub.add_parser("model", help="model helpers")
    msub = model.add_subparsers(dest="model_command", required=True, parser_class=_Parser)
    tiny = msub.add_parser("tiny", help="build the tiny random-weight test model (no download)")
    tiny.add_argument("dir", type=Path)
    shape = msub.add_parser(
        "shape", help="write a real model's config and tokenizer, no weights (vLLM runs it with random ones)"
    )
    shape.add_argument("name", help="a shape `soakd model shapes` lists, e.g. qwen3-8b")
    shape.add_argument("dir", type=Path)
    shape.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")
    shapes = msub.add_parser("shapes", help="list the known shapes: parameters, weight and KV-cache bytes")
    shapes.add_argument("--json", action="store_true")


_FORMATS = ["auto", "native", "mooncake", "bailian", "azure", "burstgpt", "sharegpt"]


def _trace_reading_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-bad-rows", action="store_true", help="count and leave out bad rows instead of stopping"
    )
    p.add_argument("--sort", action="store_true", help="sort a trace whose timestamps go backwards")


def _set_flag(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_override,
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config key, e.g. {example}",
    )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        metavar="URL",
        help="soak a running OpenAI-compatible server (attach mode: engine.kind = openai, engine.url = URL)",
    )
    p.add_argument(
        "--model",
        help="a hub id (Qwen/Qwen3-0.6B) or a model folder (engine.model); with --target, the served model's "
        "name (engine.served_model)",
    )


def _engine_overrides(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    if args.target:
        if not args.target.lower().startswith(("http://", "https://")):
            raise UsageError(f"--target: expected an http:// or https:// URL, got {args.target!r}")
        overrides["engine.kind"] = "openai"
        overrides["engine.url"] = args.target
    if args.model:
        # Attached to a server, the model is the one it serves under that name (vllm bench serve's --model).
        overrides["engine.served_model" if args.target else "engine.model"] = args.model


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="config file (its [trace] and [replay] sections apply)")
    _set_flag(p, "trace.arrivals.rate_rps=5")


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a number >= 0")
    return value


def _compare_parser(sub: Any) -> None:
    cmp = sub.add_parser(
        "compare",
        help="two runs side by side: metrics with deltas, verdicts, environment",
        description="Baseline A against candidate B: rates, ratios and latency percentiles with their "
        "deltas, judged better/worse/same by direction and tolerance (totals shown, not judged), the "
        "verdicts, criteria, environment and config differences. Runs of different traces are refused "
        "(--allow-unlike compares them anyway); a different length (over 10%) or engine config is "
        "warned of on the first lines.",
        epilog="exit codes: 0 compared; 1 with --fail-on-regression, a metric worse by more than PCT% "
        "or runs of different traces; 2 bad arguments, an unreadable run, or runs of different traces "
        "without --allow-unlike",
    )
    cmp.add_argument("run_a", metavar="RUN_A", help="baseline: run directory or run id")
    cmp.add_argument("run_b", metavar="RUN_B", help="candidate: run directory or run id")
    cmp.add_argument("--config", type=Path, help="config whose run.output_dir holds the run ids")
    cmp.add_argument(
        "--tolerance", type=_percent, default=5.0, metavar="PCT", help="changes within PCT%% of A are 'same'"
    )
    cmp.add_argument(
        "--fail-on-regression",
        type=_percent,
        metavar="PCT",
        help="exit 1 if any metric is worse than A by more than PCT%% (or the runs are not comparable)",
    )
    cmp.add_argument(
        "--allow-unlike",
        action="store_true",
        help="compare runs of different (or unknown) traces anyway, under a NOT COMPARABLE line",
    )
    cmp.add_argument("--json", action="store_true", help="print the comparison as one JSON document")


def _matrix_parser(sub: Any) -> None:
    mx = sub.add_parser(
        "matrix",
        help="ablation matrix: the same trace run against variants that change one thing each",
        epilog="exit codes: 0 every applicable variant ran to a verdict (PASS or FAIL); 1 a variant "
        "failed or the matrix was stopped; 2 a bad config or matrix file (nothing run)",
    )
    mx.add_argument("--config", type=Path, help="the run config every variant shares")
    mx.add_argument("--matrix", type=Path, help="matrix file ([base], [[variant]]; default: built-in)")
    mx.add_argument("--trace", help="trace file (overrides trace.path)")
    mx.add_argument("--duration", help="each variant's replay, e.g. 10m (overrides run.duration)")
    _set_flag(mx, "replay.speed=2 (every variant)")
    mx.add_argument("--out", type=Path, help="matrix directory (default: OUTPUT_DIR/matrix-<time>)")
    mx.add_argument(
        "--tolerance", type=_percent, default=5.0, metavar="PCT", help="deltas within PCT%% are 'same'"
    )
    mx.add_argument("--json", action="store_true", help="print matrix.json instead of the table")


def _trace_parser(sub: Any) -> None:
    from soakd.config import MAX_BLOCK_SIZE

    tr = sub.add_parser("trace", help="inspect, convert, generate and record traces")
    tsub = tr.add_subparsers(dest="trace_command", required=True, parser_class=_Parser)

    ins = tsub.add_parser("inspect", help="requests, rate over time, length percentiles, reuse, sessions")
    ins.add_argument("file")
    ins.add_argument("--format", choices=_FORMATS, default=None)
    ins.add_argument(
        "--buckets", type=_int_in(1, 100_000), default=24, help="time buckets for the rate over time"
    )
    ins.add_argument("--json", action="store_true")
    _trace_reading_flags(ins)
    _config_flags(ins)

    conv = tsub.add_parser(
        "convert", help="any format -> soakd's native JSONL (with --set replay.* transforms)"
    )
    conv.add_argument("file")
    conv.add_argument("out", type=Path)
    conv.add_argument("--format", choices=_FORMATS, default=None)
    conv.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _trace_reading_flags(conv)
    _config_flags(conv)

    syn = tsub.add_parser("synth", help="generate a native trace ([trace.synthetic] and [trace.arrivals])")
    syn.add_argument("out", type=Path)
    syn.add_argument("--duration", help="length of the trace, e.g. 10m")
    syn.add_argument("--rate", type=float, help="mean arrivals per second")
    syn.add_argument("--process", choices=["poisson", "gamma", "constant"])
    syn.add_argument("--burstiness", type=float, help="gamma shape: < 1 burstier, > 1 smoother")
    syn.add_argument("--diurnal-amplitude", type=float, help="0..1 swing of the rate over --diurnal-period")
    syn.add_argument("--diurnal-period", help="e.g. 24h")
    syn.add_argument("--sessions", type=float, help="share of arrivals that start a multi-turn conversation")
    syn.add_argument("--seed", type=int)
    syn.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _config_flags(syn)

    rec = tsub.add_parser("record", help="an OpenAI-compatible proxy that records real traffic as a trace")
    rec.add_argument("out", type=Path)
    rec.add_argument(
        "--listen", default="127.0.0.1:8001", help="HOST:PORT to listen on (loopback by default)"
    )
    rec.add_argument("--upstream", required=True, help="base URL of the server to pass requests to")
    rec.add_argument(
        "--block-size", type=_int_in(1, MAX_BLOCK_SIZE), default=16, help="tokens per prefix block hash"
    )
    rec.add_argument("--record-prompts", action="store_true", help="also store prompt text in the trace")
    rec.add_argument("--allow-remote", action="store_true", help="allow listening on a non-loopback address")


def _load_config(path: Path | None, overrides: dict[str, Any]) -> Any:
    from soakd import config

    if path is None and os.environ.get("SOAKD_CONFIG"):
        path = Path(os.environ["SOAKD_CONFIG"])
    return config.load(path, overrides, env=os.environ)


def _cmd_run(args: argparse.Namespace) -> int:
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
        overrides["trace.path"] = _trace_arg(args.trace)
    if args.duration:
        overrides["run.duration"] = args.duration
    _engine_overrides(args, overrides)
    _reading_overrides(args, overrides)
    cfg = _load_config(args.config, overrides)
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
        _print_summary(result.summary, result.run_dir, report)
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


def _print_summary(summary: dict[str, Any], run_dir: Path, report: Path | None = None) -> None:
    from soakd.progress import summary_requests, summary_tokens_per_s

    req = summary_requests(summary)
    lost = int(req.get("lost_in_flight") or 0)
    print(f"run {summary['run_id']} -> {run_dir}")
    lost_note = f" ({lost} lost in flight at restarts)" if lost else ""
    print(
        f"  requests: {req['scheduled']} scheduled, {req['completed']} completed, "
        f"{req['failed']} failed{lost_note}, {req['shed']} shed; "
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
    for line in _hardware_lines(summary):
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


def _hardware_lines(summary: dict[str, Any]) -> list[str]:
    """Throttling, GPU error events and the decode ceiling, as the run's printout and the report show them."""
    from soakd.collectors.ceiling import ceiling_line

    out = []
    scopes = [(f"GPU {k}", v) for k, v in (summary.get("gpu_throttle") or {}).items()]
    if summary.get("host_throttle"):
        scopes.append(("host CPUs", summary["host_throttle"]))
    for name, t in scopes:
        reasons = ", ".join(f"{k} {v:.1f} s" for k, v in t.get("per_reason_s", {}).items() if v > 0)
        out.append(
            f"  throttle, {name}: {t['throttled_s']:.1f} s throttled in {t['enters']} episode(s), "
            f"now {t['state']}" + (f"; counters: {reasons}" if reasons else "")
        )
    events = summary.get("gpu_events")
    if events:
        if events.get("listening") or events.get("totals"):
            out.append(
                f"  GPU error events: {events['xid_errors']} XID error(s), {events['xid_benign']} benign "
                f"XID(s), totals {events['totals'] or 'none'}"
            )
        else:
            out.append(f"  GPU error events: not listened for ({events.get('reason')})")
    line = ceiling_line(summary.get("decode_ceiling"))
    if line:
        out.append(line)
    return out


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


def _cmd_report(args: argparse.Namespace) -> int:
    from soakd import config
    from soakd.judge.verdict import verdict_lines
    from soakd.report.finished import judge_again, open_run, write_sign_off
    from soakd.report.influxql import read_run
    from soakd.report.runs import find_run
    from soakd.rundir import SPOOL_DIR

    base = _load_config(args.config, {}) if args.config else config.load(None, env=os.environ)
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
        for line in _hardware_lines(run.summary):
            print(line)
    failed = doc.get("verdict") != "PASS"
    return EXIT_FAIL if args.exit_code and failed else EXIT_OK


def _cmd_compare(args: argparse.Namespace) -> int:
    from soakd.report.compare import compare_runs, lines
    from soakd.report.runs import find_run

    base = _load_config(args.config, {})
    out_dir = base.resolve(base.run.output_dir)
    comp = compare_runs(find_run(args.run_a, out_dir), find_run(args.run_b, out_dir), args.tolerance)
    if not comp.comparable and not args.allow_unlike:
        # Deltas over different traffic would read as the change's doing: no table unless asked for.
        why = comp.warnings[0].removeprefix("NOT COMPARABLE: ")
        raise UsageError(f"not compared: {why}; --allow-unlike compares them anyway")
    if args.json:
        print(json_text(comp.to_dict(), indent=2, default=str))
    else:
        print("\n".join(lines(comp)))
    for warning in comp.warnings:
        print(f"soakd: warning: {warning}", file=sys.stderr)
    if args.fail_on_regression is None:
        return EXIT_OK
    worse = comp.regressions(args.fail_on_regression)
    for m in worse:
        print(
            f"soakd: regression: {m.name} worse than A by more than {args.fail_on_regression:g}%",
            file=sys.stderr,
        )
    return EXIT_FAIL if worse or not comp.comparable else EXIT_OK


def _cmd_matrix(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    from soakd.matrix import DEFAULT_MATRIX, MATRIX_MD, Matrix, load_matrix, markdown, plan

    spec = load_matrix(args.matrix) if args.matrix else DEFAULT_MATRIX
    config_path = args.config
    if config_path is None and spec.config and args.matrix is not None:
        config_path = (args.matrix.parent / spec.config).resolve()
    elif config_path is None and os.environ.get("SOAKD_CONFIG"):
        config_path = Path(os.environ["SOAKD_CONFIG"])
    overrides = dict(args.overrides)
    if args.trace:
        overrides["trace.path"] = _trace_arg(args.trace)
    if args.duration:
        overrides["run.duration"] = args.duration
    # Every variant's config is checked before the first engine starts.
    planned = plan(spec, config_path, overrides, matrix_file=args.matrix)
    cfg = _load_config(config_path, overrides)
    out = args.out or cfg.resolve(cfg.run.output_dir) / f"matrix-{datetime.now(UTC):%Y%m%dT%H%M%SZ}"
    if out.exists():
        raise UsageError(f"{out} exists: a matrix directory is never reused")
    if not out.parent.is_dir():
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    out.mkdir(mode=0o700)
    matrix = Matrix(planned, spec.baseline_name, out, config_path, args.tolerance)
    rows = matrix.run()
    if args.json:
        print(json_text(matrix.to_dict(), indent=2, default=str))
    else:
        print("\n".join(markdown(matrix)))
        print(f"\nwritten to {out / MATRIX_MD}")
    if matrix.stopped:
        print("soakd: matrix stopped before every variant ran", file=sys.stderr)
    failed = [r for r in rows if r.status in ("failed", "not run")]
    for r in failed:
        print(f"soakd: variant {r.variant}: {r.reason}", file=sys.stderr)
    return EXIT_FAIL if failed else EXIT_OK


def _cmd_check(args: argparse.Namespace) -> int:
    from soakd.checks import run_checks

    overrides = dict(args.overrides)
    if args.trace:
        overrides["trace.path"] = _trace_arg(args.trace)
    _engine_overrides(args, overrides)
    cfg = _load_config(args.config, overrides)
    results = asyncio.run(run_checks(cfg))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        for r in results:
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.name}: {r.detail}")
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAIL


def _reading_overrides(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    if args.skip_bad_rows:
        overrides["trace.skip_bad_rows"] = True
    if args.sort:
        overrides["trace.sort"] = True


def _refuse_existing(out: Path, force: bool) -> None:
    """An output file may replace a file with --force, never a directory (or what is not a file)."""
    if out.is_dir():
        raise UsageError(f"{out} is a directory: name the file to write")
    if out.exists() and not force:
        raise UsageError(f"{out} exists (use --force to replace it)")
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent} is not a folder")


def _trace_arg(value: str) -> str:
    """A trace named on the command line: "bundled:NAME" as it is, a path made absolute."""
    from soakd.config import BUNDLED_PREFIX

    # Made absolute without following symlinks: a symlink loop is the trace reader's to refuse in words.
    return value if value.startswith(BUNDLED_PREFIX) else str(Path(value).absolute())


def _open_cli_trace(args: argparse.Namespace) -> Any:
    from soakd.traces import open_trace

    overrides = dict(args.overrides)
    overrides["trace.path"] = _trace_arg(args.file)
    if args.format:
        overrides["trace.format"] = args.format
    _reading_overrides(args, overrides)
    cfg = _load_config(args.config, overrides)
    return open_trace(cfg.trace, cfg.resolve, cfg.run.seed, cfg.replay)


def _cmd_trace(args: argparse.Namespace) -> int:
    handlers = {
        "inspect": _trace_inspect,
        "convert": _trace_convert,
        "synth": _trace_synth,
        "record": _trace_record,
    }
    return handlers[args.trace_command](args)


def _trace_inspect(args: argparse.Namespace) -> int:
    from soakd.traces.inspect import inspect_lines, inspect_trace

    doc = inspect_trace(_open_cli_trace(args), args.buckets)
    if args.json:
        print(json_text(doc, indent=2))
    else:
        print("\n".join(inspect_lines(doc)))
    return EXIT_OK


def _trace_convert(args: argparse.Namespace) -> int:
    from soakd.traces.native import write_native

    _refuse_existing(args.out, args.force)
    trace = _open_cli_trace(args)
    write_native(args.out, trace, trace.summary.block_size)
    s = trace.summary
    print(
        f"{s.requests} requests ({s.format}) written to {args.out} as soakd-trace, block size {s.block_size}"
    )
    return EXIT_OK


def _trace_synth(args: argparse.Namespace) -> int:
    from soakd.traces import open_trace
    from soakd.traces.native import write_native

    _refuse_existing(args.out, args.force)
    overrides = dict(args.overrides)
    overrides["trace.format"] = "synthetic"
    flags = {
        "duration": "trace.synthetic.duration",
        "rate": "trace.arrivals.rate_rps",
        "process": "trace.arrivals.process",
        "burstiness": "trace.arrivals.burstiness",
        "diurnal_amplitude": "trace.arrivals.diurnal_amplitude",
        "diurnal_period": "trace.arrivals.diurnal_period",
        "sessions": "trace.synthetic.session_share",
        "seed": "run.seed",
    }
    for flag, key in flags.items():
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    cfg = _load_config(args.config, overrides)
    trace = open_trace(cfg.trace, cfg.resolve, cfg.run.seed, cfg.replay)
    write_native(args.out, trace, trace.summary.block_size)
    s = trace.summary
    print(f"{s.requests} requests over {s.span_s:.1f} s ({s.sessions} multi-turn sessions) -> {args.out}")
    return EXIT_OK


def _trace_record(args: argparse.Namespace) -> int:
    from soakd.traces.record import run_recorder

    host, sep, port = args.listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UsageError(f"--listen: expected HOST:PORT, got {args.listen!r}")
    if not args.upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream: expected an http:// or https:// URL, got {args.upstream!r}")
    # The recorder itself refuses an existing OUT: a recording is never overwritten.

    def ready(port: int) -> None:
        print(
            f"recording to {args.out}: listening on {host}:{port}, forwarding to {args.upstream}", flush=True
        )

    stats = run_recorder(
        host.strip("[]"),
        int(port),
        args.upstream,
        args.out,
        block_size=args.block_size,
        record_prompts=args.record_prompts,
        allow_remote=args.allow_remote,
        ready=ready,
    )
    print(
        f"{stats.recorded} of {stats.requests} requests recorded to {args.out} "
        f"({stats.failed} failed, {stats.untokenized} without prefix hashes, {stats.unusable} unusable)"
    )
    return EXIT_OK


def _cmd_telemetry(args: argparse.Namespace) -> int:
    import resource
    import time

    import pynvml

    from soakd.collectors.nvml import LiveNvml
    from soakd.collectors.nvml_record import record

    out: Path = args.out
    _refuse_existing(out, args.force)
    try:
        source = LiveNvml(pynvml)
    except pynvml.NVMLError as err:
        raise EngineError(f"NVML unavailable: {err}") from None
    t0 = time.monotonic()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        counts = record(source, args.duration, out, fast_hz=args.fast_hz, slow_hz=args.slow_hz)
    finally:
        source.close()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.monotonic() - t0
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    # The recorder's own cost: CPU seconds per wall second of sampling (the collector's overhead).
    doc = {**asdict(counts), "out": str(out), "wall_s": wall, "cpu_s": cpu, "cpu_share": cpu / wall}
    print(json_text(doc, indent=2))
    return EXIT_OK


def _cmd_probe(args: argparse.Namespace) -> int:
    from soakd.probe import probe, probe_lines

    if args.model is not None and not args.model.is_dir():
        raise UsageError(f"--model {args.model}: not a folder")
    doc = probe(model_dir=args.model, measure_copy=not args.no_copy, load_format=args.load_format)
    if args.json:
        print(json_text(doc, indent=2, default=str))
    else:
        print("\n".join(probe_lines(doc)))
    return EXIT_OK


def _cmd_model(args: argparse.Namespace) -> int:
    if args.model_command == "shape":
        return _model_shape(args)
    if args.model_command == "shapes":
        return _model_shapes(args)
    from soakd.tinymodel import build_tiny_model

    out = build_tiny_model(args.dir)
    print(f"tiny model written to {out}")
    return EXIT_OK


def _model_shape(args: argparse.Namespace) -> int:
    from soakd import shapes

    try:
        out = shapes.write_shape(args.name, args.dir, force=args.force)
    except KeyError as err:
        raise UsageError(f"NAME: {err.args[0]}") from None
    except (FileExistsError, NotADirectoryError, FileNotFoundError) as err:
        raise UsageError(f"DIR: {err}") from None
    marker = shapes.read_marker(out) or {}
    params = marker.get("params", 0) / 1e9
    print(
        f"{marker.get('shape')} written to {out}: {params:.2f}B parameters, no weights "
        "(vLLM loads it with load_format=dummy: real speed, power and memory; outputs are noise)"
    )
    return EXIT_OK


def _model_shapes(args: argparse.Namespace) -> int:
    from soakd.shapes import shape_rows

    rows = shape_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    print(f"{'name':<15} {'params':>8} {'weights':>9} {'KV/token':>10}  repo")
    for r in rows:
        mtp = "  (+MTP layer)" if r["mtp"] else ""
        print(
            f"{r['name']:<15} {r['params'] / 1e9:>7.2f}B {r['weight_bytes'] / 1e9:>7.1f}GB "
            f"{r['kv_bytes_per_token'] / 1024:>6.0f} KiB  {r['repo']}{mtp}"
        )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    # vLLM's own INFO lines would drown soakd's; its warnings still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # stdout carries results (--json); vLLM logs to stdout by default. The original stderr, not soakd's:
    # during a run that is the engine log (soakd.console).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.__stderr__")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from soakd.logs import configure

    try:
        args = build_parser().parse_args(argv)
        configure(args.log_level, fmt=args.log_format)
        handlers = {
            "run": _cmd_run,
            "report": _cmd_report,
            "check": _cmd_check,
            "compare": _cmd_compare,
            "matrix": _cmd_matrix,
            "model": _cmd_model,
            "trace": _cmd_trace,
            "telemetry": _cmd_telemetry,
            "probe": _cmd_probe,
        }
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
