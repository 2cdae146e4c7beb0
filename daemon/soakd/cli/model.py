"""`soakd model`: the tiny test model and the weightless shapes of real ones."""

from __future__ import annotations

import argparse
import json

from soakd.errors import EXIT_OK, UsageError


def command(args: argparse.Namespace) -> int:
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
