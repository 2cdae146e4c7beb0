"""Regenerate the bundled multi-turn trace, daemon/soakd/data/multiturn_trace.jsonl.gz (native format).

Nine minutes of chat traffic in two busy stretches with a quiet minute between them (0-300 s, nothing
300-360 s, 360-540 s): ~60 % of arrivals open a conversation of ~3 turns whose prompts carry the whole
history (so later turns hit the prefix cache), 16-token blocks (vLLM's), answers of ~512 tokens (up to
1,536) so that requests stay in the engine long enough for the batch ceiling to bind on a fast GPU. The
quiet minute is the lull that real traffic has and that `[control.recapture]` waits for. About 20
requests a second: scale it with `replay.rate_scale` (e.g. 0.05 for a CPU engine). Deterministic: the
same bytes every time (tests/unit/traces/test_traces.py checks that the bundled file is current).

    .venv/bin/python scripts/make_multiturn_trace.py [--out PATH]
"""

from __future__ import annotations

import argparse
import gzip
import io
from dataclasses import replace
from pathlib import Path

from make_demo_trace import write_data_file  # this folder: run as scripts/make_multiturn_trace.py

from soakd.config import ArrivalConfig, SyntheticTraceConfig
from soakd.traces import RequestSpec, synthesize
from soakd.traces.native import lines
from soakd.traces.synth import PROMPT_POOL

DEFAULT_OUT = (
    Path(__file__).resolve().parent.parent / "daemon" / "soakd" / "data" / "multiturn_trace.jsonl.gz"
)
SEED = 20261130
BLOCK_SIZE = 16
QUIET_FROM_S = 300.0
QUIET_TO_S = 360.0
END_S = 540.0
PREFIX_BLOCKS = 8  # a 128-token system prompt

ARRIVALS = ArrivalConfig(rate_rps=8.0, think_time=4.0)


def _config(duration: float) -> SyntheticTraceConfig:
    return SyntheticTraceConfig(
        duration=duration,
        input_tokens_mean=320,
        input_tokens_max=2048,
        output_tokens_mean=512,
        output_tokens_max=1536,
        prefix_share=0.5,
        prefix_blocks=PREFIX_BLOCKS,
        block_size=BLOCK_SIZE,
        session_share=0.6,
        turns_mean=3.0,
        turns_max=8,
        turn_input_tokens_mean=64,
    )


def multiturn_specs() -> list[RequestSpec]:
    """Both busy stretches, the second shifted past the quiet minute with its own ids and sessions."""
    first = synthesize(_config(QUIET_FROM_S), ARRIVALS, SEED)
    second = synthesize(_config(END_S - QUIET_TO_S), ARRIVALS, SEED + 1)
    # Block ids of the second stretch start above the first's, except the shared system prompts
    # (ids below the pool's end), which both stretches use: the same system prompts all day.
    offset = 1 + max((h for s in first for h in s.hash_ids), default=0)
    shared_end = PROMPT_POOL * PREFIX_BLOCKS
    out = list(first)
    for spec in second:
        out.append(
            replace(
                spec,
                arrival_s=spec.arrival_s + QUIET_TO_S,
                hash_ids=tuple(h if h < shared_end else h + offset for h in spec.hash_ids),
                session=f"b{spec.session}" if spec.session else "",
            )
        )
    return [replace(s, index=k) for k, s in enumerate(out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    text = "".join(lines(multiturn_specs(), BLOCK_SIZE)).encode()
    buf = io.BytesIO()
    # mtime=0 and no file name: the same bytes on every run.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(text)
    write_data_file(args.out, buf.getvalue())
    print(f"{args.out}: {len(text)} bytes of JSONL, {len(buf.getvalue())} gzipped")


if __name__ == "__main__":
    main()
