"""Prompt blocks drawn in C (replay/_prompts.c) are numpy's, bit for bit: any seed, salt, block id (the
big ones numpy's SeedSequence reads as several words included), vocabulary, reserved ids and size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from soakd.replay import prompts
from soakd.replay.prompts import PromptSynth, _entropy_words
from soakd.traces import RequestSpec

pytestmark = pytest.mark.skipif(prompts._prompts is None, reason="the prompt extension is not built")

BIG = st.integers(min_value=-(1 << 100), max_value=1 << 100)


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.integers(min_value=1, max_value=300_000),
    reserved=st.sets(st.integers(min_value=0, max_value=40), max_size=8),
    seed=BIG,
    salt=BIG,
    size=st.integers(min_value=1, max_value=700),
    hash_ids=st.lists(BIG, max_size=4),
    index=BIG,
    cut=st.integers(min_value=0, max_value=699),
)
def test_c_blocks_equal_numpys(
    vocab: int,
    reserved: set[int],
    seed: int,
    salt: int,
    size: int,
    hash_ids: list[int],
    index: int,
    cut: int,
) -> None:
    if len(reserved & set(range(vocab))) == vocab:
        return  # every id reserved: refused either way (test_prompts)
    blocks = max(1, len(hash_ids))
    tokens = (blocks - 1) * size + 1 + cut % size  # the last block partial, as traces have it
    spec = RequestSpec(index, 0.0, tokens, 1, size, tuple(hash_ids))
    c = PromptSynth(vocab, seed, reserved, native=True)
    py = PromptSynth(vocab, seed, reserved, native=False)
    assert c.native and not py.native
    assert c.prompt_ids(spec, salt=salt) == py.prompt_ids(spec, salt=salt)


def test_entropy_words_are_seedsequences() -> None:
    entropies = [[0, 1, (1 << 32) - 1], [1 << 32, (1 << 64) + 5], [np.int64(7)]]
    words, counts = _entropy_words(entropies)
    assert counts == [3, 5, 1]
    assert words == [0, 1, (1 << 32) - 1, 0, 1, 5, 0, 1, 7]
    coerce = getattr(np.random.bit_generator, "_coerce_to_uint32_array", None)
    if coerce is not None:  # numpy's own reading of the same entropy, where this numpy exposes it
        assert words == [int(w) for e in entropies for w in coerce(e)]


def test_bad_arguments_are_refused_not_read() -> None:
    allowed = np.arange(10, dtype=np.int32)
    ext = prompts._prompts
    with pytest.raises(ValueError, match="counts do not match"):
        ext.blocks([1, 2], [3], 4, allowed)
    with pytest.raises(ValueError, match="counts do not match"):
        ext.blocks([1, 2, 3], [2], 4, allowed)  # a word left over
    with pytest.raises(ValueError, match="above 2"):
        ext.blocks([1 << 32], [1], 4, allowed)
    with pytest.raises(ValueError, match="size must be"):
        ext.blocks([1], [1], 0, allowed)
    with pytest.raises(ValueError, match="size must be"):
        ext.blocks([1], [1], 1 << 40, allowed)  # refused before anything is allocated
    with pytest.raises(ValueError, match="int32 buffer"):
        ext.blocks([1], [1], 4, np.zeros(0, dtype=np.int32))
    with pytest.raises(ValueError, match="int32 buffer"):
        ext.blocks([1], [1], 4, np.arange(10, dtype=np.int64))  # not read as twice as many int32
    with pytest.raises(ValueError, match="int32 buffer"):
        ext.blocks([1], [1], 4, memoryview(np.arange(10, dtype=np.int32).tobytes())[1:])  # bytes, not int32
    misaligned = np.frombuffer(bytearray(44), dtype=np.int32, offset=1, count=10)
    assert not misaligned.flags.aligned
    with pytest.raises(ValueError, match="aligned int32"):
        ext.blocks([1], [1], 4, misaligned)
    with pytest.raises(OverflowError):
        ext.blocks([-1], [1], 4, allowed)
    got = np.frombuffer(ext.blocks([1, 2], [1, 1], 5, allowed), dtype=np.int32)
    assert got.shape == (10,) and set(got.tolist()) <= set(range(10))
