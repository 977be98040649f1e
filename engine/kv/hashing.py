"""The chained block hash shared by the prefix cache and the router.

A full block's hash covers its own token ids and, through the parent hash, every
token before it, so equal hashes mean equal prefixes (verified against the tokens
on a hit, since hashes can collide). Python's hash of a tuple of ints does not
depend on PYTHONHASHSEED, so every process (replicas, routers) computes the same
values; they are masked to 63 bits so they travel as plain non-negative ints.
"""

from __future__ import annotations

from typing import Sequence

_MASK = (1 << 63) - 1
ROOT_HASH = 0x5107_5E4F  # parent of the first block


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(token_ids))) & _MASK


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """Hashes of the full blocks of ``token_ids``, in order (the partial tail is not hashed)."""
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    hashes: list[int] = []
    parent = ROOT_HASH
    for i in range(n_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
