"""`soakd telemetry record`: raw NVML readings of every GPU to a file, without a soak."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from soakd.cli.common import refuse_existing
from soakd.errors import EXIT_OK, EngineError
from soakd.files import json_text


def command(args: argparse.Namespace) -> int:
    import resource
    import time

    import pynvml

    from soakd.collectors.nvml import LiveNvml
    from soakd.collectors.nvml_record import record

    out: Path = args.out
    refuse_existing(out, args.force)
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
