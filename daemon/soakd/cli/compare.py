"""`soakd compare`: two runs side by side."""

from __future__ import annotations

import argparse
import sys

from soakd.cli.common import load_config
from soakd.errors import EXIT_FAIL, EXIT_OK, UsageError
from soakd.files import json_text


def command(args: argparse.Namespace) -> int:
    from soakd.report.compare import compare_runs, lines
    from soakd.report.runs import find_run

    base = load_config(args.config, {})
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
