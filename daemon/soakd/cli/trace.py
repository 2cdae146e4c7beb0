"""`soakd trace`: inspect, convert, synthesise and record traces."""

from __future__ import annotations

import argparse
from typing import Any

from soakd.cli.common import load_config, reading_overrides, refuse_existing, trace_arg
from soakd.errors import EXIT_OK, UsageError
from soakd.files import json_text


def command(args: argparse.Namespace) -> int:
    handlers = {
        "inspect": _trace_inspect,
        "convert": _trace_convert,
        "synth": _trace_synth,
        "record": _trace_record,
    }
    return handlers[args.trace_command](args)


def _open_cli_trace(args: argparse.Namespace) -> Any:
    from soakd.traces import open_trace

    overrides = dict(args.overrides)
    overrides["trace.path"] = trace_arg(args.file)
    if args.format:
        overrides["trace.format"] = args.format
    reading_overrides(args, overrides)
    cfg = load_config(args.config, overrides)
    return open_trace(cfg.trace, cfg.resolve, cfg.run.seed, cfg.replay)


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

    refuse_existing(args.out, args.force)
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

    refuse_existing(args.out, args.force)
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
    cfg = load_config(args.config, overrides)
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
