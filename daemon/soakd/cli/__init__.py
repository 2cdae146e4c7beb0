"""argv -> command: `main` parses the arguments (cli.parser), calls the command's module (one per
subcommand: run, report, compare, matrix, check, trace, telemetry, probe, model) and maps errors to exit
codes.

Exit codes: 0 PASS (or success), 1 FAIL (or a check that did not answer), 2 bad input, 3 aborted: the run
ended early on its own (engine failure, an `abort_on` criterion, a changed trace) or an internal error,
4 stopped by a signal before its end (SIGINT, SIGTERM, SIGHUP; drained, verdict of the work done written,
marked stopped early; the systemd unit passes `--stopped-exit-code 0`, a service stop being a clean end).
A run whose verdict.json cannot be written (a full disk) exits 3: the exit code never claims more than is
on disk. verdict.json records the code its run returns.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import structlog

from soakd.cli import check, compare, matrix, model, probe, report, run, telemetry, trace
from soakd.cli.parser import build_parser
from soakd.errors import EXIT_ERROR, EXIT_INPUT, EngineError, InputError, SinkError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run.command,
    "report": report.command,
    "check": check.command,
    "compare": compare.command,
    "matrix": matrix.command,
    "model": model.command,
    "trace": trace.command,
    "telemetry": telemetry.command,
    "probe": probe.command,
}
"""Each subcommand's function, by the name the parser gives it."""


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
        return COMMANDS[args.command](args)
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
