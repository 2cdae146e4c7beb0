"""The command line's grammar: every subcommand, its flags and their types, in one argparse parser that
raises UsageError (one line, exit 2) where argparse would print usage and exit."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from soakd import __version__
from soakd.errors import EXIT_STOPPED, UsageError


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
