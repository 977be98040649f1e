"""The attention backend contract, with FlashAttention's varlen semantics.

A step's query tokens are packed into one ``[num_tokens, heads, head_dim]`` tensor; request
``i`` owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, and attends causally to its first
``seqlens_k[i]`` cached tokens (its earlier context plus the new ones), whose KV lives in the
blocks listed in ``block_table[i]``. New K/V are first written to the cache at
``slot_mapping`` (``block * block_size + offset`` per new token). Every backend computes
exactly this; only the memory layout of its cache and the kernels differ.

Requests come in three runs (engine.attention.metadata.order_chunks): decodes (one query
token, by decreasing KV length, so the torch backend can batch them in length groups),
then chunks after a cached prefix, then first chunks (``start == 0``). The first
``num_gathered`` requests read context from the cache; the rest only their own new K/V.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor   # [B + 1] int32
    cu_seqlens_k: torch.Tensor   # [B + 1] int32
    seqlens_k: torch.Tensor      # [B] int32: context + new tokens
    block_table: torch.Tensor    # [B, max_blocks] int32; entries past a request's blocks are 0
    slot_mapping: torch.Tensor   # [num_tokens] int64
    max_seqlen_q: int
    max_seqlen_k: int
    num_decodes: int             # requests [0, num_decodes) have exactly one query token
    # Host-side copies, so backends can plan without device syncs.
    query_lens: list[int]
    kv_lens: list[int]
    num_gathered: int = -1
    """Requests [0, num_gathered) attend to cached context; the rest are first chunks. -1: all."""

    def __post_init__(self) -> None:
        if self.num_gathered < 0:
            self.num_gathered = len(self.query_lens)

    @property
    def gathered_tokens(self) -> int:
        """Query tokens of the requests that read cached context (they come first)."""
        return sum(self.query_lens[:self.num_gathered])


class AttentionBackend(ABC):
    name: str = "abstract"
    supports_cuda_graphs: bool = True
    """Decode steps can be captured: no host sync and no allocation that outlives a step."""
    verify_graphs: bool = True
    """Steps verifying drafts can be captured too: every row padded to the same query length, chunks after
    a cached prefix read ``seqlens_k`` on the device (engine.cuda_graphs.verify_metadata)."""
    graph_context_buckets: bool = True
    """Captured decode work grows with the longest context (a gather or a padded batch), so
    graphs are keyed by context length too; paged kernels read only the pages they need."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim ** -0.5

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's K (and V) cache: ``[num_blocks, block_size, kv_heads, head_dim]``, FlashAttention's
        paged layout (backends with another layout override this and ``write_kv``)."""
        return num_blocks, self.block_size, self.num_kv_heads, self.head_dim

    def allocate_cache(self, num_blocks: int, dtype: torch.dtype,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V cache tensors for one layer (``cache_shape``)."""
        shape = self.cache_shape(num_blocks)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata) -> None:
        """The step's new K/V into their slots (``slot_mapping``)."""
        for cache, new in zip(kv_cache, (k, v)):
            cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, new)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` -> ``[T, heads * d]``; writes k/v to the cache."""

    def plan(self, meta: AttentionMetadata) -> None:
        """Once per step, before the layers: work every layer shares (device ops only)."""

    def scratch_bytes(self, max_tokens: int, dtype: torch.dtype) -> int:
        """Bytes of the buffers ``reserve(max_tokens)`` takes (counted in the memory budget)."""
        return 0

    def reserve(self, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        """Size step buffers once for up to ``max_tokens`` context tokens per step, so they never
        grow later (a CUDA graph keeps the addresses it was captured with)."""

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        """KV bytes one block takes in one layer (K and V)."""
        return self.block_size * self.token_bytes(dtype)

    def token_bytes(self, dtype: torch.dtype) -> int:
        """K plus V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()
