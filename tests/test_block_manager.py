"""The paged KV block pool (engine.kv.block_manager): ref counts, prefix cache, LRU eviction.

No model and no torch: each test builds a real BlockManager over a handful of blocks and
drives it the way the scheduler does (allocate, register full blocks, match, take, free).
After every test the pool must be consistent and, since every test frees what it took,
completely free again.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

import engine.kv.block_manager as bm_module
from engine.kv.block_manager import BlockManager
from engine.kv.hashing import ROOT_HASH, hash_block, prefix_block_hashes, prefix_routing_keys, routing_key

BS = 4
COLLIDING = b"\x2a" * 32  # what a patched hash_block returns for every block


@pytest.fixture
def make_bm():
    """Factory for pools; every pool built in a test is checked for leaks when it ends."""
    pools: list[BlockManager] = []

    def make(num_blocks: int = 8, block_size: int = BS, prefix: bool = True) -> BlockManager:
        pool = BlockManager(num_blocks, block_size, prefix)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.check_invariants()
        assert all(rc == 0 for rc in pool.ref_counts), f"leaked references: {pool.ref_counts}"
        assert pool.num_free == pool.num_blocks


def fill(pool: BlockManager, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """A request computing ``tokens`` from scratch: fresh blocks, full ones published."""
    blocks = pool.allocate(pool.blocks_needed(len(tokens)))
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // pool.block_size):
        parent = pool.register_full_block(blocks[i], parent, tokens[i * pool.block_size:(i + 1) * pool.block_size])
        hashes.append(parent)
    return blocks, hashes


def matched_tokens(pool: BlockManager, tokens: list[int]) -> int:
    return len(pool.match_prefix(tokens)[0]) * pool.block_size


# ----------------------------------------------------------------------------- allocation
def test_allocate_and_free_round_trip(make_bm):
    pool = make_bm(8)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and all(0 <= b < 8 for b in blocks)
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 1]
    assert (pool.num_free, pool.num_used) == (5, 3)
    more = pool.allocate(5)
    assert not set(blocks) & set(more) and pool.num_free == 0
    pool.check_invariants()
    pool.free(blocks)
    pool.free(more)
    assert (pool.num_free, pool.num_used) == (8, 0)


def test_allocating_more_than_is_free_raises_and_changes_nothing(make_bm):
    pool = make_bm(4)
    held = pool.allocate(3)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.free(held)


def test_double_free_raises(make_bm):
    pool = make_bm(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])
    pool.check_invariants()


def test_shared_block_survives_one_owners_free(make_bm):
    pool = make_bm(4)
    tokens = [1, 2, 3, 4, 5]
    first, _ = fill(pool, tokens)
    cached, _ = pool.match_prefix(tokens + [9])
    assert cached == first[:1]
    pool.take_cached(cached)
    assert pool.ref_counts[first[0]] == 2
    pool.free(first)
    assert pool.ref_counts[first[0]] == 1 and pool.num_free == 3  # the shared block stays held
    pool.free(cached)
    assert pool.ref_counts[first[0]] == 0


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_constructor_rejects_empty_pools(num_blocks, block_size):
    with pytest.raises(ValueError, match="positive"):
        BlockManager(num_blocks, block_size)


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_rounds_up(make_bm, tokens, blocks):
    assert make_bm().blocks_needed(tokens) == blocks


def test_can_allocate_counts_reused_free_cached_blocks_once(make_bm):
    pool = make_bm(4)
    blocks, _ = fill(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    pool.free(blocks)
    cached, _ = pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert len(cached) == 2 and pool.num_free == 4
    # Taking the two cached blocks uses up two of the four free ones.
    assert pool.can_allocate(2, reusing=cached)
    assert not pool.can_allocate(3, reusing=cached)
    pool.take_cached(cached)
    assert pool.num_free == 2
    pool.free(cached)


# ----------------------------------------------------------------------------- prefix cache
def test_prefix_hit_on_shared_full_blocks(make_bm):
    pool = make_bm(8)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    blocks, hashes = fill(pool, prompt)
    assert hashes == prefix_block_hashes(prompt, BS)
    other = prompt[:8] + [99, 98, 97]
    cached, got_hashes = pool.match_prefix(other)
    assert cached == blocks[:2] and got_hashes == hashes
    pool.take_cached(cached)
    assert [pool.ref_counts[b] for b in blocks] == [2, 2, 1]
    pool.free(blocks)
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 0]
    # The survivor's blocks are still served to a third request.
    assert pool.match_prefix(other)[0] == cached
    pool.free(cached)


def test_prefix_match_stops_at_first_differing_block(make_bm):
    pool = make_bm(8)
    blocks, _ = fill(pool, list(range(12)))
    assert matched_tokens(pool, [0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12]) == 4
    assert matched_tokens(pool, [1, 1, 2, 3, 4, 5, 6, 7, 8]) == 0
    pool.free(blocks)


def test_same_block_after_a_different_prefix_does_not_hit(make_bm):
    pool = make_bm(8)
    blocks, _ = fill(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    # Block 2's tokens alone, at another position, hash differently: the chain covers the prefix.
    assert matched_tokens(pool, [5, 6, 7, 8, 0]) == 0
    pool.free(blocks)


# monkeypatch before make_bm: the pools are checked (under the patched hash) before it is undone.
def test_hash_collision_is_verified_against_tokens(monkeypatch, make_bm):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: COLLIDING)
    pool = make_bm(8)
    blocks, _ = fill(pool, [1, 2, 3, 4, 5])
    assert pool.hash_to_block == {COLLIDING: blocks[0]}
    assert pool.match_prefix([7, 7, 7, 7, 7]) == ([], [])
    assert pool.match_prefix([1, 2, 3, 4, 0]) == ([blocks[0]], [COLLIDING])
    # A colliding block of another prompt does not overwrite the cached one.
    other, _ = fill(pool, [7, 7, 7, 7, 7])
    assert pool.hash_to_block == {COLLIDING: blocks[0]} and pool.block_hash[other[0]] is None
    pool.free(blocks)
    pool.free(other)


def test_a_hit_requires_the_stored_parent(monkeypatch, make_bm):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: COLLIDING)
    pool = make_bm(8)
    [block] = pool.allocate(1)
    pool.register_full_block(block, ROOT_HASH, [1, 2, 3, 4])
    assert pool.lookup(ROOT_HASH, [1, 2, 3, 4]) == (block, COLLIDING)
    # Same digest, same tokens, another prefix before them: not this block's KV.
    assert pool.lookup(b"\x01" * 32, [1, 2, 3, 4]) == (None, COLLIDING)
    # A token-only check would serve the first block again at position 1.
    assert pool.match_prefix([1, 2, 3, 4] * 2 + [0]) == ([block], [COLLIDING])
    pool.free([block])


def _old_hash_block(parent: int, token_ids: list[int]) -> int:
    """The scheme sha256 replaced: Python's hash, masked to 63 bits."""
    return hash((parent, tuple(token_ids))) & ((1 << 63) - 1)


def test_parents_that_collided_under_the_old_hash_share_no_block(make_bm):
    p, q = 0x5107_5E4F, 0x5107_5E4F + 2**61 - 1  # hash(int) is taken mod 2**61 - 1
    tokens = [1, 2, 3, 4]
    assert _old_hash_block(p, tokens) == _old_hash_block(q, tokens)  # two prefixes, one cache entry
    parent_p, parent_q = p.to_bytes(32, "big"), q.to_bytes(32, "big")
    pool = make_bm(4)
    [block] = pool.allocate(1)
    digest = pool.register_full_block(block, parent_p, tokens)
    assert pool.lookup(parent_p, tokens) == (block, digest)
    missed, other = pool.lookup(parent_q, tokens)
    assert missed is None and other != digest and routing_key(other) != routing_key(digest)
    pool.free([block])


def test_last_prompt_token_is_never_matched(make_bm):
    pool = make_bm(8)
    prompt = list(range(8))  # exactly two full blocks
    blocks, _ = fill(pool, prompt)
    pool.free(blocks)
    cached, _ = pool.match_prefix(prompt)
    assert len(cached) == 1  # the second block holds the last token: it is computed again
    assert matched_tokens(pool, prompt + [8]) == 8


@pytest.mark.parametrize("length", range(1, 14))
def test_a_fully_cached_prompt_still_computes_a_token(make_bm, length):
    pool = make_bm(8)
    prompt = list(range(100, 100 + length))
    blocks, _ = fill(pool, prompt)
    pool.free(blocks)
    hit = matched_tokens(pool, prompt)
    assert hit == (length - 1) // BS * BS
    assert length - hit >= 1


def test_take_cached_pulls_a_free_block_off_the_lru(make_bm):
    pool = make_bm(2)
    blocks, _ = fill(pool, [1, 2, 3, 4])
    pool.free(blocks)
    assert pool.num_free == 2
    cached, _ = pool.match_prefix([1, 2, 3, 4, 5])
    pool.take_cached(cached)
    assert pool.num_free == 1
    # With the cached block held, the next allocation cannot evict it.
    fresh = pool.allocate(1)
    assert fresh != cached and pool.match_prefix([1, 2, 3, 4, 5])[0] == cached
    pool.free(fresh)
    pool.free(cached)


def test_lru_evicts_least_recently_freed_and_tails_first(make_bm):
    pool = make_bm(4, block_size=2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    a_blocks, _ = fill(pool, a)
    pool.free(a_blocks)
    b_blocks, _ = fill(pool, b)
    pool.free(b_blocks)
    assert pool.num_free == 4 and len(pool.hash_to_block) == 4

    held = [pool.allocate(1)]  # evicts a's tail, a's first block survives
    assert held[0] == [a_blocks[1]]
    assert matched_tokens(pool, a + [0]) == 2 and matched_tokens(pool, b + [0]) == 4
    held.append(pool.allocate(1))  # then a's head
    assert held[1] == [a_blocks[0]] and matched_tokens(pool, a + [0]) == 0
    held.append(pool.allocate(1))  # then b's tail
    assert held[2] == [b_blocks[1]] and matched_tokens(pool, b + [0]) == 2
    for blocks in held:
        pool.free(blocks)


def test_reusing_a_cached_prefix_refreshes_its_lru_position(make_bm):
    pool = make_bm(4, block_size=2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    a_blocks, _ = fill(pool, a)
    pool.free(a_blocks)
    b_blocks, _ = fill(pool, b)
    pool.free(b_blocks)
    hit, _ = pool.match_prefix(a + [0])
    pool.take_cached(hit)
    pool.free(hit)  # a is now the most recently used
    held = pool.allocate(2)
    assert sorted(held) == sorted(b_blocks)
    assert matched_tokens(pool, a + [0]) == 4 and matched_tokens(pool, b + [0]) == 0
    pool.free(held)


def test_plain_free_blocks_are_used_before_evicting_cached_ones(make_bm):
    pool = make_bm(4)
    cached_blocks, _ = fill(pool, [1, 2, 3, 4])
    pool.free(cached_blocks)
    held = pool.allocate(3)
    assert cached_blocks[0] not in held and matched_tokens(pool, [1, 2, 3, 4, 5]) == 4
    pool.free(held)


def test_recent_routing_keys_is_the_routing_digest(make_bm):
    pool = make_bm(8)
    prompt = list(range(50, 62))
    blocks, hashes = fill(pool, prompt)
    assert hashes == prefix_block_hashes(prompt, BS)
    keys = [routing_key(h) for h in hashes]
    assert keys == prefix_routing_keys(prompt, BS)  # the router computes the same values
    assert pool.recent_routing_keys(100) == keys
    assert pool.recent_routing_keys(2) == keys[-2:]
    assert pool.recent_routing_keys(0) == [] and pool.recent_routing_keys(-3) == []
    other, other_hashes = fill(pool, list(range(200, 204)))
    assert pool.recent_routing_keys(2) == [keys[-1], routing_key(other_hashes[0])]  # newest last
    pool.free(blocks)
    pool.free(other)
    held = pool.allocate(8)  # evicts every cached block: the digest forgets them
    assert pool.recent_routing_keys(100) == []
    pool.free(held)


def test_reset_prefix_cache_drops_only_unreferenced_blocks(make_bm):
    pool = make_bm(8)
    kept, _ = fill(pool, [1, 2, 3, 4, 5])
    dropped, _ = fill(pool, [9, 9, 9, 9, 9, 9, 9, 9])
    pool.free(dropped)
    assert pool.reset_prefix_cache() == 2
    pool.check_invariants()
    assert matched_tokens(pool, [9] * 9) == 0
    assert matched_tokens(pool, [1, 2, 3, 4, 0]) == 4  # still held, still cached
    assert pool.num_free == 6  # only the kept request's two blocks are in use
    pool.free(kept)
    assert pool.reset_prefix_cache() == 1 and pool.hash_to_block == {}


def test_disabled_prefix_caching_never_hits(make_bm):
    pool = make_bm(8, prefix=False)
    prompt = list(range(12))
    blocks, hashes = fill(pool, prompt)
    # The chain is still computed (the router digest does not depend on the cache being on).
    assert hashes == prefix_block_hashes(prompt, BS)
    assert pool.match_prefix(prompt + [1]) == ([], [])
    pool.free(blocks)
    assert pool.match_prefix(prompt + [1]) == ([], [])
    assert pool.recent_routing_keys(10) == [] and pool.hash_to_block == {}


def test_record_lookup_accumulates_queries_and_hits(make_bm):
    pool = make_bm()
    pool.record_lookup(10, 8)
    pool.record_lookup(5, 0)
    assert (pool.prefix_queries, pool.prefix_hits) == (15, 8)


def test_hash_block_is_chained_sha256_over_little_endian_ids():
    h1 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    packed = bytes.fromhex("01000000" "02000000" "03000000" "04000000")
    assert h1 == hashlib.sha256(ROOT_HASH + packed).digest() == hash_block(ROOT_HASH, (1, 2, 3, 4))
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(ROOT_HASH, [5, 6, 7, 8])
    assert prefix_block_hashes(list(range(10)), 4) == prefix_block_hashes(list(range(8)), 4)
    assert prefix_block_hashes(list(range(16)), 4, max_blocks=2) == prefix_block_hashes(list(range(8)), 4)
    assert routing_key(h1) == int.from_bytes(h1[:8], "big") >> 1 and 0 <= routing_key(b"\xff" * 32) < 2**63


@pytest.mark.parametrize("parent, tokens", [(ROOT_HASH, [-1]), (ROOT_HASH, [2**32]), (ROOT_HASH, ["a"]),
                                            (ROOT_HASH[:8], [1]), (7, [1])])
def test_hash_block_rejects_what_it_cannot_encode(parent, tokens):
    with pytest.raises(ValueError):
        hash_block(parent, tokens)


@pytest.mark.parametrize("seed", ["1", "2"])
def test_hashes_are_the_same_in_another_process(seed):
    prompt = list(range(1000, 1040))
    code = ("from engine.kv.hashing import prefix_block_hashes, prefix_routing_keys as k;"
            f"p = {prompt!r}; print(([h.hex() for h in prefix_block_hashes(p, 16)], k(p, 16)))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
    got = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert got == str(([h.hex() for h in prefix_block_hashes(prompt, 16)], prefix_routing_keys(prompt, 16)))


def test_invariant_check_catches_a_lost_block(make_bm):
    pool = make_bm(4)
    blocks = pool.allocate(1)
    pool.ref_counts[blocks[0]] = 0  # forget the owner without returning the block
    with pytest.raises(RuntimeError, match="lost blocks"):
        pool.check_invariants()
    pool.ref_counts[blocks[0]] = 1
    pool.free(blocks)


def test_a_prefix_that_keeps_being_hit_stays_in_the_digest(make_bm):
    pool = make_bm(8)
    hot, hot_hashes = fill(pool, list(range(8)))  # e.g. a shared system prompt
    pool.free(hot)
    others = [fill(pool, [100 + i] * 4)[0] for i in range(3)]
    hit, _ = pool.match_prefix(list(range(8)) + [1])
    pool.take_cached(hit)
    try:
        hot_keys = {routing_key(h) for h in hot_hashes}
        assert hot_keys <= set(pool.recent_routing_keys(2)), "the digest is what the router should hit"
    finally:
        for blocks in [hit, *others]:
            pool.free(blocks)
