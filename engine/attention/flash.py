"""flash-attn 2 backend (CUDA): paged KV read in place through ``block_table``.

Cache layout ``[num_blocks, block_size, kv_heads, head_dim]``. flash-attn 2's paged KV needs
``block_size`` to be a multiple of 256. Imported lazily: flash-attn only builds where CUDA
is present (the ``gpu`` extra).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata

FLASH_BLOCK_MULTIPLE = 256


class FlashAttentionBackend(AttentionBackend):
    name = "flash"
    graph_context_buckets = False

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, kernels=None):
        """``kernels``: (``flash_attn_varlen_func``, ``flash_attn_with_kvcache``); default flash-attn's."""
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(f"block_size must be a multiple of {FLASH_BLOCK_MULTIPLE} for the flash "
                             f"attention backend, got {block_size}")
        if kernels is None:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
            kernels = flash_attn_varlen_func, flash_attn_with_kvcache
        self._varlen, self._with_kvcache = kernels

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        self.write_kv(k, v, kv_cache, meta)
        k_cache, v_cache = kv_cache
        nd = meta.num_decodes
        out = torch.empty_like(q)
        if nd:
            # One query token per request: the kvcache kernel reads the pages in place.
            out[:nd] = self._with_kvcache(
                q[:nd].unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seqlens_k[:nd],
                block_table=meta.block_table[:nd], softmax_scale=self.scale, causal=True).squeeze(1)
        if nd < len(meta.query_lens):
            cu_q = meta.cu_seqlens_q[nd:] - meta.cu_seqlens_q[nd]
            cu_k = meta.cu_seqlens_k[nd:] - meta.cu_seqlens_k[nd]
            out[nd:] = self._varlen(
                q[nd:], k_cache, v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                softmax_scale=self.scale, causal=True, block_table=meta.block_table[nd:])
        return out.view(q.shape[0], -1)
