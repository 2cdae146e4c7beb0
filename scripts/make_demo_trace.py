"""Regenerate the bundled demo trace, daemon/soakd/data/demo_trace.jsonl (Mooncake format).

About 240 requests over 120 s (Poisson, ~2 req/s), prompts of 64-900 tokens, answers of 16-128 tokens,
512-token blocks, ~60% of the requests opening with one of 4 shared "system prompt" blocks: small enough
for a tiny CPU model, with enough prefix reuse for the prefix cache to show. Deterministic: running it
again writes the same bytes (tests/unit/traces/test_traces.py checks that the bundled file is current).

    .venv/bin/python scripts/make_demo_trace.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from soakd.config import ArrivalConfig, SyntheticTraceConfig
from soakd.traces import RequestSpec, synthesize
from soakd.traces.mooncake import BLOCK_SIZE, record
from soakd.traces.synth import PROMPT_POOL

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "daemon" / "soakd" / "data" / "demo_trace.jsonl"
SEED = 20251
MIN_INPUT = 64  # below one block, so raising a prompt to this never changes its block count
MIN_OUTPUT = 16

ARRIVALS = ArrivalConfig(rate_rps=2.0)
CONFIG = SyntheticTraceConfig(
    duration=120.0,
    input_tokens_mean=360,
    input_tokens_max=900,
    output_tokens_mean=56,
    output_tokens_max=128,
    prefix_share=0.6,
    prefix_blocks=1,
    block_size=BLOCK_SIZE,
)


def demo_specs() -> list[RequestSpec]:
    """The demo requests: the synthetic trace with prompts and answers raised to the demo's minimums."""
    return [
        replace(
            spec,
            input_tokens=max(spec.input_tokens, MIN_INPUT),
            output_tokens=max(spec.output_tokens, MIN_OUTPUT),
        )
        for spec in synthesize(CONFIG, ARRIVALS, SEED)
    ]


def write_data_file(path: Path, data: bytes) -> None:
    """A packaged data file, written atomically (temp file + rename) and readable by everyone."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        # mkstemp creates the file 0600; a packaged data file must be readable by everyone.
        tmp.chmod(0o644)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_mooncake(path: Path, specs: Iterable[RequestSpec]) -> None:
    """One Mooncake JSON object per line."""
    text = "".join(json.dumps(record(spec), separators=(", ", ": ")) + "\n" for spec in specs)
    write_data_file(path, text.encode("utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description="Regenerate the bundled demo trace (Mooncake format).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write (default: %(default)s)")
    args = parser.parse_args()
    specs = demo_specs()
    write_mooncake(args.out, specs)
    shared = sum(1 for s in specs if s.hash_ids and s.hash_ids[0] < PROMPT_POOL * CONFIG.prefix_blocks)
    print(
        f"{args.out}: {len(specs)} requests over {specs[-1].arrival_s:.1f} s, "
        f"prompts {min(s.input_tokens for s in specs)}-{max(s.input_tokens for s in specs)} tokens, "
        f"answers {min(s.output_tokens for s in specs)}-{max(s.output_tokens for s in specs)} tokens, "
        f"{shared} opening with a shared block"
    )


if __name__ == "__main__":
    main()
