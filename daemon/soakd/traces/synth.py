"""Generate a synthetic trace for users with no recorded traffic, deterministically from a seed.

Arrivals are a Poisson process (exponential gaps at `rate_rps`); the first request is at 0 and the
last before `duration`. Prompt and answer lengths are lognormal (sigma 0.6) with the configured means,
rounded and clipped to [1, max], so most requests are near the mean with a long tail, as in real traffic.

A share `prefix_share` of the requests opens with the first `prefix_blocks` blocks of one of a small
pool of "system prompts" (block ids 0 .. pool*prefix_blocks-1), so the engine's prefix cache has
something to hit; a prompt shorter than that prefix is a prefix of the system prompt. Every other block
gets a fresh id, used once.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from soakd.config import SyntheticTraceConfig
from soakd.traces.model import RequestSpec, blocks_needed

PROMPT_POOL = 4  # distinct system prompts; few enough that each one is reused often
_SIGMA = 0.6


def synthesize(cfg: SyntheticTraceConfig, seed: int) -> list[RequestSpec]:
    """The requests of a synthetic trace: the same list for the same config and seed."""
    # default_rng rejects negative seeds; the modulo keeps every non-negative seed as it is.
    rng = np.random.default_rng(seed % 2**64)
    arrivals = _arrivals(rng, cfg.rate_rps, cfg.duration)
    n = len(arrivals)
    inputs = _lengths(rng, cfg.input_tokens_mean, cfg.input_tokens_max, n)
    outputs = _lengths(rng, cfg.output_tokens_mean, cfg.output_tokens_max, n)
    shared = rng.random(n) < cfg.prefix_share
    prompts = rng.integers(0, PROMPT_POOL, size=n)

    block_size = cfg.block_size
    next_id = PROMPT_POOL * cfg.prefix_blocks
    specs: list[RequestSpec] = []
    for i in range(n):
        input_tokens = int(inputs[i])
        blocks = blocks_needed(input_tokens, block_size)
        prefix = min(cfg.prefix_blocks, blocks) if shared[i] else 0
        first = int(prompts[i]) * cfg.prefix_blocks
        hash_ids = tuple(range(first, first + prefix)) + tuple(range(next_id, next_id + blocks - prefix))
        next_id += blocks - prefix
        specs.append(
            RequestSpec(
                index=i,
                arrival_s=float(arrivals[i]),
                input_tokens=input_tokens,
                output_tokens=int(outputs[i]),
                block_size=block_size,
                hash_ids=hash_ids,
            )
        )
    return specs


def _arrivals(rng: np.random.Generator, rate: float, duration: float) -> npt.NDArray[np.float64]:
    """Poisson arrival times in [0, duration), the first at 0."""
    expected = rate * duration
    chunk = int(expected + 5 * math.sqrt(expected) + 16)
    parts = [np.zeros(1)]
    last = 0.0
    while True:
        times = last + np.cumsum(rng.exponential(1.0 / rate, size=chunk))
        kept = times[times < duration]
        parts.append(kept)
        if len(kept) < chunk:
            return np.concatenate(parts)
        last = float(times[-1])


def _lengths(rng: np.random.Generator, mean: int, maximum: int, n: int) -> npt.NDArray[np.int64]:
    """Lognormal token counts with the given mean (before clipping), clipped to [1, maximum]."""
    mu = math.log(mean) - _SIGMA**2 / 2  # the lognormal's mean is exp(mu + sigma^2 / 2)
    values = np.rint(rng.lognormal(mu, _SIGMA, size=n))
    return np.clip(values, 1, maximum).astype(np.int64)
