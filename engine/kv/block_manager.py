"""The paged KV block pool: ref counts, per-request block tables, automatic prefix caching.

No torch here: the pool hands out block ids; the runner owns the tensors they index.

Prefix caching: once a block is full, its chained sha256 digest (engine.kv.hashing) is
registered with its parent digest and the tokens it holds. A later request whose prompt
starts with the same tokens takes a reference on those blocks instead of recomputing them.
A hit requires the digest, the tokens and the parent digest to match, so a request is only
ever served KV computed for its own prefix. Blocks nobody references stay cached on an LRU
list and are evicted (digest dropped) only when the pool needs them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from engine.kv.hashing import ROOT_HASH, hash_block, routing_key


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_parent: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}  # full digests, in order of last use
        # Free blocks holding no cached prefix: taken first. A stack, so recently freed
        # (cache-warm) blocks are reused first.
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks still holding a cached prefix, least recently used first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0     # prompt tokens served from the cache

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_invariants(self) -> None:
        """Raise if any block is lost or double-counted (used by tests after every scenario)."""
        free = set(self._free_plain) | set(self._free_cached)
        if len(free) != len(self._free_plain) + len(self._free_cached):
            raise RuntimeError("a block is on both free lists or twice on one")
        used = {b for b, rc in enumerate(self.ref_counts) if rc > 0}
        if free & used:
            raise RuntimeError(f"blocks both free and referenced: {sorted(free & used)[:8]}")
        if len(free) + len(used) != self.num_blocks:
            raise RuntimeError(f"lost blocks: free {len(free)} + used {len(used)} != total {self.num_blocks}")
        for h, b in self.hash_to_block.items():
            if self.block_hash[b] != h:
                raise RuntimeError(f"hash index points at block {b} that holds another hash")
            if hash_block(self.block_parent[b], self.block_tokens[b]) != h:
                raise RuntimeError(f"block {b} is indexed under a digest its parent and tokens do not give")

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, parent_hash: bytes, token_ids: Sequence[int]) -> tuple[int | None, bytes]:
        """The cached block holding ``token_ids`` right after the prefix ``parent_hash`` (None on
        a miss), and the digest of that block."""
        chunk = tuple(token_ids)
        h = hash_block(parent_hash, chunk)
        b = self.hash_to_block.get(h)
        if b is not None and (self.block_tokens[b] != chunk or self.block_parent[b] != parent_hash):
            b = None
        return b, h

    def match_prefix(self, token_ids: Sequence[int], root: bytes = ROOT_HASH) -> tuple[list[int], list[bytes]]:
        """Cached full blocks covering the longest prefix of ``token_ids`` (not taken yet).
        ``root``: the chain's first parent (a LoRA adapter's own, engine.lora.adapter).

        At most ``len(token_ids) - 1`` tokens are matched: the last prompt token is always
        computed so the request gets logits to sample from. Returns (block ids, their digests).
        """
        if not self.enable_prefix_caching:
            return [], []
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = root
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            b, h = self.lookup(parent, token_ids[i * bs:(i + 1) * bs])
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def take_cached(self, blocks: Sequence[int]) -> None:
        """Add a reference to blocks returned by match_prefix."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                self._free_cached.pop(b)
            self.ref_counts[b] += 1
            # A hit refreshes the hash's place in the digest: popular prefixes stay advertised.
            h = self.block_hash[b]
            self.hash_to_block[h] = self.hash_to_block.pop(h)

    def register_full_block(self, block: int, parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
        """Publish a block that just became full; returns its digest (the next block's parent)."""
        chunk = tuple(token_ids)
        h = hash_block(parent_hash, chunk)
        if not self.enable_prefix_caching:
            return h
        if self.block_hash[block] is None and h not in self.hash_to_block:
            self.block_hash[block] = h
            self.block_parent[block] = parent_hash
            self.block_tokens[block] = chunk
            self.hash_to_block[h] = block
        return h

    def recent_routing_keys(self, max_entries: int) -> list[int]:
        """Routing keys of the most recently used cached blocks (newest last): the routing digest."""
        if max_entries <= 0:
            return []
        keys = list(self.hash_to_block)
        return [routing_key(h) for h in keys[-max_entries:]]

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, num_new_blocks: int, reusing: Sequence[int] = ()) -> bool:
        """Whether ``num_new_blocks`` fresh blocks fit after taking the cached ``reusing`` ones."""
        reclaimed = sum(1 for b in reusing if self.ref_counts[b] == 0)
        return self.num_free - reclaimed >= num_new_blocks

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free_plain:
                b = self._free_plain.pop()
            else:
                b, _ = self._free_cached.popitem(last=False)
                self._evict(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        self.block_parent[block] = None
        self.block_tokens[block] = None

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block. Tail blocks go to the LRU end first, so a
        request's shared prefix outlives its private suffix."""
        for b in reversed(blocks):
            rc = self.ref_counts[b]
            if rc <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] = rc - 1
            if rc == 1:
                if self.block_hash[b] is not None:
                    self._free_cached[b] = None
                else:
                    self._free_plain.append(b)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody references; returns how many were dropped."""
        dropped = list(self._free_cached)
        for b in dropped:
            self._evict(b)
            self._free_plain.append(b)
        self._free_cached.clear()
        return len(dropped)
