"""Generate a synthetic trace for users with no recorded traffic, deterministically from a seed.

Arrivals come from `[trace.arrivals]` (Poisson, gamma burstiness or constant, under an optional diurnal
rate profile; see traces/arrivals.py); the first request is at 0 and the last before `duration`.
Prompt and answer lengths are lognormal (sigma 0.6) with the configured means, rounded and clipped to
[1, max], so most requests are near the mean with a long tail, as in real traffic.

A share `prefix_share` of the conversations opens with the first `prefix_blocks` blocks of one of a small
pool of "system prompts" (block ids 0 .. pool*prefix_blocks-1), so the engine's prefix cache has
something to hit; a prompt shorter than that prefix is a prefix of the system prompt. Every other block
gets a fresh id.

A share `session_share` of the arrivals start a multi-turn session instead of a single request: the
number of turns is geometric with mean `turns_mean` (at most `turns_max`); each later turn's prompt is
the previous prompt, the previous answer and a new user message (lognormal, mean
`turn_input_tokens_mean`), its blocks extending the previous turn's, and it arrives an exponential think
time (mean `arrivals.think_time`) after the previous one. Turns after `duration` are dropped.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from soakd.config import ArrivalConfig, SyntheticTraceConfig
from soakd.traces.arrivals import arrivals_until
from soakd.traces.model import RequestSpec, blocks_needed

PROMPT_POOL = 4  # distinct system prompts; few enough that each one is reused often
_SIGMA = 0.6


def synthesize(cfg: SyntheticTraceConfig, arrivals: ArrivalConfig, seed: int) -> list[RequestSpec]:
    """The requests of a synthetic trace, in arrival order: the same list for the same config and seed."""
    # default_rng rejects negative seeds; the modulo keeps every non-negative seed as it is.
    rng = np.random.default_rng(seed % 2**64)
    starts = arrivals_until(arrivals, seed, cfg.duration)
    n = len(starts)
    inputs = _lengths(rng, cfg.input_tokens_mean, cfg.input_tokens_max, n)
    outputs = _lengths(rng, cfg.output_tokens_mean, cfg.output_tokens_max, n)
    shared = rng.random(n) < cfg.prefix_share
    prompts = rng.integers(0, PROMPT_POOL, size=n)
    multi = rng.random(n) < cfg.session_share
    # Geometric turn counts with the configured mean (>= 1), capped.
    p = 1.0 / cfg.turns_mean
    turn_counts = np.minimum(rng.geometric(p, size=n), cfg.turns_max)

    block_size = cfg.block_size
    next_id = PROMPT_POOL * cfg.prefix_blocks
    out: list[tuple[float, int, int, RequestSpec]] = []
    for i in range(n):
        input_tokens = int(inputs[i])
        blocks = blocks_needed(input_tokens, block_size)
        prefix = min(cfg.prefix_blocks, blocks) if shared[i] else 0
        first = int(prompts[i]) * cfg.prefix_blocks
        hash_ids = tuple(range(first, first + prefix)) + tuple(range(next_id, next_id + blocks - prefix))
        next_id += blocks - prefix
        output_tokens = int(outputs[i])
        t = float(starts[i])
        session = f"s{i}" if multi[i] and turn_counts[i] > 1 else ""
        turns = int(turn_counts[i]) if session else 1
        for turn in range(turns):
            if turn:
                t += float(rng.exponential(arrivals.think_time)) if arrivals.think_time else 0.0
                if t >= cfg.duration:
                    break
                user = int(_lengths(rng, cfg.turn_input_tokens_mean, cfg.input_tokens_max, 1)[0])
                input_tokens = min(input_tokens + output_tokens + user, cfg.input_tokens_max)
                output_tokens = int(_lengths(rng, cfg.output_tokens_mean, cfg.output_tokens_max, 1)[0])
                needed = blocks_needed(input_tokens, block_size)
                fresh = needed - min(len(hash_ids), needed)
                hash_ids = hash_ids[:needed] + tuple(range(next_id, next_id + fresh))
                next_id += fresh
            spec = RequestSpec(
                index=0,
                arrival_s=t,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                block_size=block_size,
                hash_ids=hash_ids,
                session=session,
                turn=turn,
            )
            out.append((t, i, turn, spec))
    out.sort(key=lambda item: item[:3])
    return [replace(s, index=k) for k, (_, _, _, s) in enumerate(out)]


def _lengths(rng: np.random.Generator, mean: int, maximum: int, n: int) -> npt.NDArray[np.int64]:
    """Lognormal token counts with the given mean (before clipping), clipped to [1, maximum]."""
    mu = math.log(mean) - _SIGMA**2 / 2  # the lognormal's mean is exp(mu + sigma^2 / 2)
    values = np.rint(rng.lognormal(mu, _SIGMA, size=n))
    return np.clip(values, 1, maximum).astype(np.int64)
