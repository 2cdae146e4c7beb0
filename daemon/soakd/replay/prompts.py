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

The blocks are drawn in C where the optional extension `soakd.replay._prompts` was built at install
(the same three algorithms as plain loops, ~15x cheaper: numpy's per-block objects and small-array
calls were the main process's largest cost per request with unique prompts), else with numpy; the two
give the same ids, bit for bit (tests/unit/replay/test_prompt_blocks.py).
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from soakd.traces.model import RequestSpec, blocks_needed

try:
    from soakd.replay import _prompts  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install): numpy draws the same blocks
    _prompts = None

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
        self,
        vocab_size: int,
        seed: int,
        reserved_ids: Collection[int] = (),
        cache_blocks: int = 4096,
        *,
        native: bool = True,
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
        self.native = native and _prompts is not None
        """Whether blocks are drawn in C (`native` asks for it where the extension was built)."""

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
            flat = self._shared(spec.hash_ids[:blocks], size, salt)
        else:
            # Unique content is never seen again with this salt, so caching it would only evict prefixes.
            base = [self._seed, _natural(salt), _UNIQUE, _natural(spec.index)]
            flat = self._blocks([[*base, j] for j in range(blocks)], size).reshape(-1)
        ids: list[int] = flat[:n].tolist()
        return ids

    def _shared(self, block_ids: Sequence[int], size: int, salt: int) -> _Tokens:
        """The blocks of `block_ids` end to end: cached ones from the cache, the rest drawn together."""
        keys = [(salt, size, block_id) for block_id in block_ids]
        found: list[_Tokens | None] = []
        for key in keys:
            block = self._cache.get(key)
            if block is not None:
                self._cache.move_to_end(key)
            found.append(block)
        missing = [i for i, block in enumerate(found) if block is None]
        if missing:
            seed, salted = self._seed, _natural(salt)
            drawn = self._blocks([[seed, salted, _SHARED, _natural(block_ids[i])] for i in missing], size)
            for row, i in enumerate(missing):
                block = drawn[row]
                found[i] = block
                if self._cache_blocks and keys[i] not in self._cache:
                    # Its own copy: a view would keep every block drawn with it alive, past the bound.
                    block = found[i] = block.copy()
                    block.setflags(write=False)  # shared by every later request with this id
                    self._cache[keys[i]] = block
                    self._cached_tokens += block.size
            # Bounded in blocks and in tokens (4096 blocks of 64k tokens would be 1 GiB).
            while len(self._cache) > self._cache_blocks or self._cached_tokens > _CACHE_TOKENS:
                _, old = self._cache.popitem(last=False)
                self._cached_tokens -= old.size
        if len(found) == 1:
            return cast(_Tokens, found[0])
        return np.concatenate(cast(list[_Tokens], found))

    def _blocks(self, entropies: list[list[int]], size: int) -> _Tokens:
        """One row of `size` tokens per entropy: _PHRASES random phrases, repeated in a random order, from
        one PCG64 stream each (in C where built, else numpy; the same ids)."""
        if self.native:
            words, counts = _entropy_words(entropies)
            data = _prompts.blocks(words, counts, size, self._allowed)
            return np.frombuffer(data, dtype=np.int32).reshape(len(entropies), size)
        return self._blocks_numpy(entropies, size)

    def _blocks_numpy(self, entropies: list[list[int]], size: int) -> _Tokens:
        """_blocks with numpy: all rows gathered in one pass (numpy's per-call overhead, not the
        arithmetic, is what a block costs, and a request has several)."""
        picks_needed = -(-size // _PHRASE_MIN)
        words_at = _PHRASES  # fixed offsets into each row's raw words, so one block's layout never
        picks_at = _PHRASES + _PHRASES * _PHRASE_MAX  # depends on another's (or its own) lengths
        raw = np.stack([np.random.PCG64(e).random_raw(picks_at + picks_needed) for e in entropies])
        rows = raw.shape[0]
        span = _PHRASE_MAX - _PHRASE_MIN + 1
        lengths = _below(raw[:, :_PHRASES], span).astype(np.int64) + _PHRASE_MIN  # (rows, phrases)
        # Each row's words: only the first sum(lengths) of its _PHRASES * _PHRASE_MAX are ever indexed.
        words = self._allowed[_below(raw[:, words_at:picks_at], self._allowed.size)].reshape(-1)
        starts = np.cumsum(lengths, axis=1) - lengths  # each phrase's start within its row's words
        picks = _below(raw[:, picks_at:], _PHRASES)  # (rows, picks_needed)
        row_of = np.arange(rows)[:, None]
        lens = lengths[row_of, picks].reshape(-1)
        first = (starts[row_of, picks] + row_of * (picks_at - words_at)).reshape(-1)
        # Gather the picked phrases end to end without a Python loop: for each output token, its
        # phrase's first word plus its position within the phrase; then each row cut to `size`.
        ends = np.cumsum(lens)
        position = np.arange(int(ends[-1]))
        index = np.repeat(first - (ends - lens), lens) + position
        totals = lens.reshape(rows, -1).sum(axis=1)
        keep = position - np.repeat(np.cumsum(totals) - totals, totals) < size
        block: _Tokens = words[index[keep]].reshape(rows, size)
        return block


def _entropy_words(entropies: list[list[int]]) -> tuple[list[int], list[int]]:
    """Each entropy as numpy's SeedSequence reads it (every non-negative int as its little-endian 32-bit
    words, 0 as one word), end to end, and how many words each has."""
    words: list[int] = []
    counts: list[int] = []
    for entropy in entropies:
        start = len(words)
        for item in entropy:
            value = operator.index(item)  # a numpy integer too, as SeedSequence takes it
            if value < 1 << 32:
                words.append(value)
            else:
                rest = value
                while rest:
                    words.append(rest & 0xFFFFFFFF)
                    rest >>= 32
        counts.append(len(words) - start)
    return words, counts


def _below(raw: npt.NDArray[np.uint64], n: int) -> npt.NDArray[np.intp]:
    """Map raw 64-bit words to [0, n) by multiply-shift on the top 32 bits (bias < n / 2**32)."""
    top = raw >> np.uint64(32)
    return ((top * np.uint64(n)) >> np.uint64(32)).astype(np.intp)


def _natural(n: int) -> int:
    """A one-to-one map of any int to a non-negative one, as SeedSequence requires (zigzag)."""
    return 2 * n if n >= 0 else -2 * n - 1
