"""`soakd probe`: the hardware profile and the model's decode ceiling."""

from __future__ import annotations

import argparse

from soakd.errors import EXIT_OK, UsageError
from soakd.files import json_text


def command(args: argparse.Namespace) -> int:
    from soakd.probe import probe, probe_lines

    if args.model is not None and not args.model.is_dir():
        raise UsageError(f"--model {args.model}: not a folder")
    doc = probe(model_dir=args.model, measure_copy=not args.no_copy, load_format=args.load_format)
    if args.json:
        print(json_text(doc, indent=2, default=str))
    else:
        print("\n".join(probe_lines(doc)))
    return EXIT_OK
