"""The long-context trace of the control matrix's `longctx` scenario (run.sh): Mooncake rows, Poisson
arrivals, each prompt one of `--docs` long shared documents (cached by vLLM's prefix cache after its
first use) and a question of its own, outputs of a few hundred tokens.

Why this shape makes a smaller batch pay under a TPOT limit: a decode step reads every running
sequence's whole context from the KV cache, so its time grows with the batch times the context
(~6k tokens x 147 KB a token on a Qwen3-8B shape: ~0.9 GB a sequence a step, against 16 GB of weights),
while the tokens a second barely move (each step carries more sequences but takes longer). Several
documents, not one: one document's KV is ~23 MB a layer, small enough that the L2 cache would serve it
to every sequence of the batch at once and hide the cost. The documents are shared, so prefill stays a
few hundred tokens a request and the KV cache holds every sequence of a 64-batch.

    python benchmarks/h200_matrix/longctx_trace.py /tmp/longctx.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BLOCK = 512  # Mooncake's block: one hash id per 512 prompt tokens


def rows(
    *,
    seconds: float,
    rate: float,
    docs: int,
    doc_blocks: int,
    question: tuple[int, int],
    outputs: tuple[int, int],
    seed: int,
) -> list[dict[str, object]]:
    rng = random.Random(seed)  # noqa: S311 (a benchmark's arrivals, not a secret)
    out: list[dict[str, object]] = []
    t = 0.0
    next_id = docs * doc_blocks  # ids below are the documents' blocks
    while t < seconds:
        doc = rng.randrange(docs)
        q = rng.randint(*question)
        ids = [*range(doc * doc_blocks, (doc + 1) * doc_blocks), next_id]
        next_id += 1
        out.append(
            {
                "timestamp": round(t * 1000),
                "input_length": doc_blocks * BLOCK + q,
                "output_length": rng.randint(*outputs),
                "hash_ids": ids,
            }
        )
        t += rng.expovariate(rate)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seconds", type=float, default=230.0)
    ap.add_argument("--rate", type=float, default=12.0, help="requests/s")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-blocks", type=int, default=11, help="512-token blocks a document")
    ap.add_argument("--seed", type=int, default=31)
    args = ap.parse_args()
    got = rows(
        seconds=args.seconds,
        rate=args.rate,
        docs=args.docs,
        doc_blocks=args.doc_blocks,
        question=(100, 500),
        outputs=(200, 400),
        seed=args.seed,
    )
    args.out.write_text("".join(json.dumps(r) + "\n" for r in got), encoding="utf-8")
    print(f"{args.out}: {len(got)} requests over {args.seconds:.0f} s")


if __name__ == "__main__":
    main()
