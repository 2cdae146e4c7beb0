"""Synthesize the prompt token ids of a trace request, identically in every process and run.

Traces carry lengths and prefix block ids, not text, so the prompt is made up block by block:

- A request with `hash_ids` gets one block of `block_size` tokens per id; block i depends only on
  (seed, salt, block_size, hash_ids[i]), so equal ids give byte-identical prefixes and the engine's
  prefix cache hits exactly where the trace says it should. The last block is partial: the first
  `input_tokens - (n-1)*block_size` tokens of that id's full block.
- A request without `hash_ids` gets content unique to (seed, salt, spec.index), from an id space
  that cannot meet the hash ids, cut to exactly `input_tokens` tokens.

Randomness comes from numpy's PCG64 bit generator seeded through a SeedSequence of those integers, read
as raw 64-bit words: numpy keeps that stream stable across processes and versions (unlike Python's
`hash()`, which is salted per process, and unlike Generator's distribution methods, which may change).

Why phrases: real text repeats itself, and n-gram speculative decoding (prompt lookup) only accepts
tokens when the prompt contains the continuation it is about to generate. I.i.d. random tokens would
show an acceptance rate near zero, which says nothing about the engine. So each block is made of 8
random "phrases" of 4-8 tokens, repeated in a random order until the block is full.

Token ids are drawn from [0, vocab_size) minus `reserved_ids` (EOS and other special tokens). Shared
blocks are kept in a bounded LRU cache (`cache_blocks` entries), because prefixes repeat. Not
thread-safe: give each thread its own PromptSynth.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

import numpy as np
import numpy.typing as npt

from soakd.traces.model import RequestSpec, blocks_needed

_PHRASES = 8  # distinct phrases per block
_PHRASE_MIN = 4  # tokens per phrase, inclusive bounds
_PHRASE_MAX = 8
# Domain tags keep the two id spaces apart: a hash id can never produce the block of a unique request.
_SHARED = 0
_UNIQUE = 1
_CACHE_TOKENS = 1 << 22  # 16 MiB of int32 token ids

_Tokens = npt.NDArray[np.int32]


class PromptSynth:
    """Deterministic prompt token ids for RequestSpecs (see the module docstring for the scheme)."""

    def __init__(
        self, vocab_size: int, seed: int, reserved_ids: Collection[int] = (), cache_blocks: int = 4096
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if cache_blocks < 0:
            raise ValueError(f"cache_blocks must be >= 0, got {cache_blocks}")
        reserved = np.array([i for i in reserved_ids if 0 <= i < vocab_size], dtype=np.int64)
        allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), reserved)
        if allowed.size == 0:
            raise ValueError(f"every token id in [0, {vocab_size}) is reserved")
        self._allowed: _Tokens = allowed.astype(np.int32)
        self._seed = _natural(seed)
        self._cache_blocks = cache_blocks
        self._cache: OrderedDict[tuple[int, int, int], _Tokens] = OrderedDict()
        self._cached_tokens = 0

    def prompt_ids(self, spec: RequestSpec, salt: int = 0, limit: int | None = None) -> list[int]:
        """Exactly `spec.input_tokens` token ids (the first `limit` of them when given); the same for the
        same (seed, salt, spec) anywhere.

        `salt` changes every block (e.g. per replay loop, to defeat the prefix cache across loops).
        `limit` builds only the blocks the clipped prompt needs: a trace row of 2^25 tokens sent to a
        model of 32k builds 32k ids, not a gigabyte of them.
        """
        size = spec.block_size
        if size < 1 or spec.input_tokens < 1:
            raise ValueError(f"request {spec.index}: block_size and input_tokens must be >= 1")
        if spec.hash_ids and not 1 <= spec.input_tokens - (len(spec.hash_ids) - 1) * size <= size:
            raise ValueError(
                f"request {spec.index}: {len(spec.hash_ids)} hash_ids of {size} tokens "
                f"do not cover {spec.input_tokens} tokens"
            )
        n = spec.input_tokens if limit is None else max(1, min(spec.input_tokens, limit))
        blocks = blocks_needed(n, size)
        if spec.hash_ids:
            parts = [self._shared(block_id, size, salt) for block_id in spec.hash_ids[:blocks]]
        else:
            # Unique content is never seen again with this salt, so caching it would only evict prefixes.
            parts = [
                self._block([self._seed, _natural(salt), _UNIQUE, _natural(spec.index), j], size)
                for j in range(blocks)
            ]
        parts[-1] = parts[-1][: n - (blocks - 1) * size]
        ids: list[int] = np.concatenate(parts).tolist()
        return ids

    def _shared(self, block_id: int, size: int, salt: int) -> _Tokens:
        key = (salt, size, block_id)
        block = self._cache.get(key)
        if block is not None:
            self._cache.move_to_end(key)
            return block
        block = self._block([self._seed, _natural(salt), _SHARED, _natural(block_id)], size)
        if self._cache_blocks:
            block.setflags(write=False)  # shared by every later request with this id
            self._cache[key] = block
            self._cached_tokens += block.size
            # Bounded in blocks and in tokens (4096 blocks of 64k tokens would be 1 GiB).
            while len(self._cache) > self._cache_blocks or self._cached_tokens > _CACHE_TOKENS:
                _, old = self._cache.popitem(last=False)
                self._cached_tokens -= old.size
        return block

    def _block(self, entropy: list[int], size: int) -> _Tokens:
        """`size` tokens: _PHRASES random phrases, repeated in a random order, from one PCG64 stream."""
        picks_needed = -(-size // _PHRASE_MIN)
        raw = np.random.PCG64(entropy).random_raw(_PHRASES + _PHRASES * _PHRASE_MAX + picks_needed)
        span = _PHRASE_MAX - _PHRASE_MIN + 1
        lengths = _below(raw[:_PHRASES], span).astype(np.int64) + _PHRASE_MIN
        # Fixed offsets into the raw words, so one block's layout never depends on another's lengths.
        word_raw = raw[_PHRASES : _PHRASES + int(lengths.sum())]
        words = self._allowed[_below(word_raw, self._allowed.size)]
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        picks = _below(raw[_PHRASES + _PHRASES * _PHRASE_MAX :], _PHRASES)
        # Gather the picked phrases end to end without a Python loop: for each output token, the
        # start of its phrase plus its position within the phrase.
        lens = lengths[picks]
        ends = np.cumsum(lens)
        offsets = np.arange(int(ends[-1])) - np.repeat(ends - lens, lens)
        index = np.repeat(starts[picks], lens) + offsets
        block: _Tokens = words[index[:size]]
        return block


def _below(raw: npt.NDArray[np.uint64], n: int) -> npt.NDArray[np.intp]:
    """Map raw 64-bit words to [0, n) by multiply-shift on the top 32 bits (bias < n / 2**32)."""
    top = raw >> np.uint64(32)
    return ((top * np.uint64(n)) >> np.uint64(32)).astype(np.intp)


def _natural(n: int) -> int:
    """A one-to-one map of any int to a non-negative one, as SeedSequence requires (zigzag)."""
    return 2 * n if n >= 0 else -2 * n - 1
