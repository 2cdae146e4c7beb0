"""What the commands share: the config as the command line loads it, the flags the run-like commands
turn into overrides, the check of an output file, a summary's hardware lines."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from soakd.errors import UsageError


def load_config(path: Path | None, overrides: dict[str, Any]) -> Any:
    from soakd import config

    if path is None and os.environ.get("SOAKD_CONFIG"):
        path = Path(os.environ["SOAKD_CONFIG"])
    return config.load(path, overrides, env=os.environ)


def engine_overrides(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    if args.target:
        if not args.target.lower().startswith(("http://", "https://")):
            raise UsageError(f"--target: expected an http:// or https:// URL, got {args.target!r}")
        overrides["engine.kind"] = "openai"
        overrides["engine.url"] = args.target
    if args.model:
        # Attached to a server, the model is the one it serves under that name (vllm bench serve's --model).
        overrides["engine.served_model" if args.target else "engine.model"] = args.model


def reading_overrides(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    if args.skip_bad_rows:
        overrides["trace.skip_bad_rows"] = True
    if args.sort:
        overrides["trace.sort"] = True


def refuse_existing(out: Path, force: bool) -> None:
    """An output file may replace a file with --force, never a directory (or what is not a file)."""
    if out.is_dir():
        raise UsageError(f"{out} is a directory: name the file to write")
    if out.exists() and not force:
        raise UsageError(f"{out} exists (use --force to replace it)")
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent} is not a folder")


def trace_arg(value: str) -> str:
    """A trace named on the command line: "bundled:NAME" as it is, a path made absolute."""
    from soakd.config import BUNDLED_PREFIX

    # Made absolute without following symlinks: a symlink loop is the trace reader's to refuse in words.
    return value if value.startswith(BUNDLED_PREFIX) else str(Path(value).absolute())


def hardware_lines(summary: dict[str, Any]) -> list[str]:
    """Throttling, other processes on the GPUs, GPU error events and the decode ceiling, as the run's
    printout and the report show them."""
    from soakd.collectors.ceiling import ceiling_line
    from soakd.report.gpus import cotenant_text, spread_text

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
        if t.get("cotenant_episodes"):
            out.append(f"  another process on {name}: {cotenant_text(t['cotenant_episodes'])}")
    for group, g in (summary.get("gpu_spread") or {}).items():
        out.append("  " + spread_text(group, g))
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
