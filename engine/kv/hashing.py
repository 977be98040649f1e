"""The chained block hash: the one definition shared by the prefix cache and the router.

A full block's digest is sha256(parent digest || its token ids as little-endian uint32),
so it covers every token before it, and every host and process computes the same bytes.
The engine keys its cache by the full 32-byte digest (no collision can be constructed);
only ``routing_key`` truncates it, to a 63-bit int the router compares with replicas'
digests, where a collision costs a routing choice, never another request's KV.
"""

from __future__ import annotations

import hashlib
import struct
from functools import lru_cache
from typing import Sequence

from engine.errors import InvalidRequestError

DIGEST_SIZE = 32
ROOT_HASH = hashlib.sha256(b"slotserve/kv-prefix/v1").digest()  # parent of the first block


@lru_cache(maxsize=64)
def _packer(n: int):
    return struct.Struct(f"<{n}I").pack


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The digest of a block holding ``token_ids`` after the prefix whose digest is ``parent_hash``."""
    if not isinstance(parent_hash, bytes) or len(parent_hash) != DIGEST_SIZE:
        raise ValueError(f"parent_hash must be a {DIGEST_SIZE}-byte digest, got {parent_hash!r:.80}")
    try:
        packed = _packer(len(token_ids))(*token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    return hashlib.sha256(parent_hash + packed).digest()


MAX_CACHE_SALT_CHARS = 256
PREFIX_DIGEST_ENTRIES = 4096
"""Routing keys a replica publishes of its newest cached blocks (``prefix_digest``), for the router
to match prompts against: 4,096 keys (32 KiB) cover a replica's working set of shared prefixes."""


def salted_root(root: bytes, cache_salt: str) -> bytes:
    """The first parent of a chain salted with ``cache_salt`` (vLLM's per-request field): requests of
    different salts never share a cached block, so a client cannot probe another's prompts through
    ``cached_tokens``; requests of one salt share as usual."""
    if not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                  f"characters, got {cache_salt!r:.80}")
    return hashlib.sha256(root + b"salt" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def routing_key(digest: bytes) -> int:
    """The non-negative 63-bit int a digest travels as in routing stats."""
    return int.from_bytes(digest[:8], "big") >> 1


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                        root: bytes = ROOT_HASH) -> list[bytes]:
    """Digests of the full blocks of ``token_ids``, in order (the partial tail is not hashed).
    ``root``: the chain's first parent (a LoRA adapter's own, ``engine.lora.AdapterInfo.root_hash``)."""
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    hashes: list[bytes] = []
    parent = root
    for i in range(n_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def prefix_routing_keys(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                        root: bytes = ROOT_HASH) -> list[int]:
    """``routing_key`` of each of ``prefix_block_hashes``: what the router looks up."""
    return [routing_key(h) for h in prefix_block_hashes(token_ids, block_size, max_blocks, root)]
