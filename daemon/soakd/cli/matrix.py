"""`soakd matrix`: the ablation matrix, its variants run one after another."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from soakd.cli.common import load_config, trace_arg
from soakd.errors import EXIT_FAIL, EXIT_OK, UsageError
from soakd.files import json_text


def command(args: argparse.Namespace) -> int:
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
        overrides["trace.path"] = trace_arg(args.trace)
    if args.duration:
        overrides["run.duration"] = args.duration
    # Every variant's config is checked before the first engine starts.
    planned = plan(spec, config_path, overrides, matrix_file=args.matrix)
    cfg = load_config(config_path, overrides)
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
