"""`soakd check`: the config validated, and what a run would use asked whether it answers."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict

from soakd.cli.common import engine_overrides, load_config, trace_arg
from soakd.errors import EXIT_FAIL, EXIT_OK


def command(args: argparse.Namespace) -> int:
    from soakd.checks import run_checks

    overrides = dict(args.overrides)
    if args.trace:
        overrides["trace.path"] = trace_arg(args.trace)
    engine_overrides(args, overrides)
    cfg = load_config(args.config, overrides)
    results = asyncio.run(run_checks(cfg))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        for r in results:
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.name}: {r.detail}")
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAIL
