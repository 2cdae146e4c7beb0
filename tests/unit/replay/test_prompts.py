"""Prompt synthesis: exact lengths, shared prefixes where the trace shares blocks, reproducible anywhere."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from soakd.replay.prompts import PromptSynth
from soakd.traces import RequestSpec

VOCAB = 32000


def spec(
    input_tokens: int, hash_ids: tuple[int, ...] = (), index: int = 0, block_size: int = 512
) -> RequestSpec:
    return RequestSpec(
        index=index,
        arrival_s=0.0,
        input_tokens=input_tokens,
        output_tokens=1,
        block_size=block_size,
        hash_ids=hash_ids,
    )


SPECS = [
    spec(900, (3, 4)),
    spec(700, (3, 5), index=1),
    spec(1300, index=2),
    spec(20, (9, 10), index=3, block_size=16),
]

_CHILD = """
import json, sys
from soakd.replay.prompts import PromptSynth
from soakd.traces import RequestSpec
specs = [RequestSpec(**d) for d in json.loads(sys.argv[1])]
p = PromptSynth(32000, 1234, reserved_ids={0, 2})
print(json.dumps([p.prompt_ids(s, salt=3) for s in specs]))
"""


def test_prompts_are_identical_across_processes() -> None:
    arg = json.dumps(
        [
            {
                "index": s.index,
                "arrival_s": 0.0,
                "input_tokens": s.input_tokens,
                "output_tokens": 1,
                "block_size": s.block_size,
                "hash_ids": list(s.hash_ids),
            }
            for s in SPECS
        ]
    )
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, arg], env=env, check=True, capture_output=True, text=True
        )
        outputs.append(json.loads(done.stdout))
    p = PromptSynth(VOCAB, 1234, reserved_ids={0, 2})
    here = [p.prompt_ids(s, salt=3) for s in SPECS]
    assert outputs[0] == outputs[1] == here
    assert [len(ids) for ids in here] == [s.input_tokens for s in SPECS]


@pytest.mark.parametrize("n", [1, 3, 4, 511, 512, 513, 1024, 1500])
def test_length_is_exactly_input_tokens(n: int) -> None:
    p = PromptSynth(VOCAB, 0)
    blocks = tuple(range(-(-n // 512)))
    assert len(p.prompt_ids(spec(n, blocks))) == n
    assert len(p.prompt_ids(spec(n))) == n


def test_equal_hash_ids_give_equal_prefixes_and_different_ids_differ() -> None:
    p = PromptSynth(VOCAB, 0)
    a = p.prompt_ids(spec(900, (3, 4)))
    b = p.prompt_ids(spec(700, (3, 5), index=9))
    assert a[:512] == b[:512]
    assert a[512:700] != b[512:700]
    # The index does not matter when the blocks are named.
    assert p.prompt_ids(spec(900, (3, 4), index=5)) == a
    assert p.prompt_ids(spec(512, (4,)))[:388] == a[512:]


def test_partial_last_block_is_a_prefix_of_the_full_block() -> None:
    p = PromptSynth(VOCAB, 0)
    full = p.prompt_ids(spec(1024, (3, 4)))
    part = p.prompt_ids(spec(600, (3, 4)))
    assert len(part) == 600
    assert part == full[:600]


def test_requests_without_hash_ids_are_unique_to_their_index() -> None:
    p = PromptSynth(VOCAB, 0)
    a = p.prompt_ids(spec(1300, index=5))
    assert p.prompt_ids(spec(1300, index=5)) == a
    assert p.prompt_ids(spec(1300, index=6))[:512] != a[:512]
    # Their id space is not the hash ids': index 5 is not block 5.
    assert p.prompt_ids(spec(512, (5,)))[:512] != a[:512]
    # The tail past the first block is new content, not a copy of the first block.
    assert a[512:1024] != a[:512]


def test_reserved_ids_never_appear() -> None:
    vocab = 50
    reserved = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 49, 1000}
    p = PromptSynth(vocab, 0, reserved_ids=reserved)
    seen: set[int] = set()
    for i in range(40):
        seen.update(p.prompt_ids(spec(700, (i, 1000 + i))))
        seen.update(p.prompt_ids(spec(300, index=i)))
    assert not seen & reserved
    assert seen <= set(range(vocab))
    # Everything not reserved is still in use: the exclusion is exact, not a narrower range.
    assert seen == set(range(10, 49))


def test_all_ids_reserved_is_refused() -> None:
    with pytest.raises(ValueError, match="reserved"):
        PromptSynth(3, 0, reserved_ids=[0, 1, 2])


def test_salt_and_seed_change_the_content() -> None:
    p = PromptSynth(VOCAB, 0)
    base = p.prompt_ids(spec(600, (3, 4)))
    assert p.prompt_ids(spec(600, (3, 4)), salt=0) == base
    assert p.prompt_ids(spec(600, (3, 4)), salt=1)[:512] != base[:512]
    assert p.prompt_ids(spec(600), salt=1) != p.prompt_ids(spec(600), salt=2)
    assert PromptSynth(VOCAB, 1).prompt_ids(spec(600, (3, 4)))[:512] != base[:512]
    assert PromptSynth(VOCAB, -1).prompt_ids(spec(600, (3, 4)))[:512] != base[:512]


def test_blocks_repeat_short_phrases() -> None:
    ids = PromptSynth(VOCAB, 0).prompt_ids(spec(512, (3,)))
    # 8 phrases of at most 8 tokens: at most 64 distinct tokens where i.i.d. draws would give ~508.
    assert len(set(ids)) <= 64
    # A 4-gram lies within one phrase (<= 8*5) or across two (<= 8*8*3): at most 232 of 509 distinct.
    grams = {tuple(ids[i : i + 4]) for i in range(len(ids) - 3)}
    assert len(grams) <= 232


def test_cache_is_bounded_and_does_not_change_content() -> None:
    small = PromptSynth(VOCAB, 0, cache_blocks=2)
    none = PromptSynth(VOCAB, 0, cache_blocks=0)
    first = [small.prompt_ids(spec(600, (i, i + 1))) for i in range(10)]
    assert len(small._cache) == 2
    assert not none._cache
    # Evicted blocks come back identical.
    assert [small.prompt_ids(spec(600, (i, i + 1))) for i in range(10)] == first
    assert [none.prompt_ids(spec(600, (i, i + 1))) for i in range(10)] == first


def test_a_cached_block_holds_only_its_own_tokens() -> None:
    """Blocks drawn together for one request are cached each as its own array: a view into the
    request's draw would keep the whole draw alive, and the cache's bound counts blocks' own tokens."""
    p = PromptSynth(VOCAB, 0)
    p.prompt_ids(spec(100 * 16, tuple(range(100)), block_size=16))
    assert len(p._cache) == 100 and p._cached_tokens == 1600
    assert all(block.base is None and not block.flags.writeable for block in p._cache.values())


def test_hash_ids_that_do_not_cover_the_prompt_are_refused() -> None:
    p = PromptSynth(VOCAB, 0)
    with pytest.raises(ValueError, match="do not cover"):
        p.prompt_ids(spec(600, (1,)))
    with pytest.raises(ValueError, match="do not cover"):
        p.prompt_ids(spec(100, (1, 2)))


@pytest.mark.parametrize("hash_ids", [(), (7, 8, 9)])
@pytest.mark.parametrize("limit", [1, 511, 512, 513, 1500, 5000])
def test_a_limited_prompt_is_the_full_prompts_head(hash_ids: tuple[int, ...], limit: int) -> None:
    p = PromptSynth(32_000, seed=4)
    full = p.prompt_ids(spec(1500, hash_ids))
    assert p.prompt_ids(spec(1500, hash_ids), limit=limit) == full[:limit]


def test_a_huge_row_sent_to_a_short_context_builds_only_what_is_sent() -> None:
    # 2^25 tokens in 2^15 blocks: built whole that is 33M ids (over a GB as a list) before the clip.
    n = 1 << 25
    big = spec(n, tuple(range(n // 1024)), block_size=1024)
    ids = PromptSynth(32_000, seed=4).prompt_ids(big, limit=4096)
    assert len(ids) == 4096 and ids == PromptSynth(32_000, seed=4).prompt_ids(
        spec(4096, (0, 1, 2, 3), block_size=1024)
    )


# The sha256 of GOLDEN_SPECS' prompts as soakd has synthesized them since the phrase scheme began: a
# replay of a trace must send the same bytes in every version, or runs of one trace stop being
# comparable (prefix-cache hits, n-gram acceptance). A faster implementation must leave it unchanged.
GOLDEN_SPECS = [
    *SPECS,
    spec(1100, (10, 11, 12), index=4),  # three full-size blocks drawn in one request
    spec(1100, index=5),  # unique content, three blocks
    spec(700, (10, 13), index=6),  # one block from the cache, one drawn
    spec(57, (7, 8, 7, 9, 7), index=7, block_size=13),  # a size not a multiple of a phrase, ids repeated
    spec(3, index=8, block_size=1),
]
GOLDEN_SHA256 = "90123f5be73512ffa2f7b7cef7004019478d9b9cb4493470303bfdb7ef51e0f9"


@pytest.mark.parametrize("native", [True, False], ids=["native-where-built", "numpy"])
def test_prompts_are_the_bytes_every_earlier_version_sent(native: bool) -> None:
    p = PromptSynth(VOCAB, 1234, reserved_ids={0, 2}, native=native)
    prompts = [p.prompt_ids(s, salt=3) for s in GOLDEN_SPECS]
    uncached = PromptSynth(VOCAB, 1234, reserved_ids={0, 2}, cache_blocks=0, native=native)
    again = [uncached.prompt_ids(s, salt=3) for s in GOLDEN_SPECS]
    assert prompts == again
    assert [len(ids) for ids in prompts] == [s.input_tokens for s in GOLDEN_SPECS]
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    assert digest == GOLDEN_SHA256
