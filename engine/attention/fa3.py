"""FlashAttention-3 backend (Hopper): one paged call per layer, any page size.

``flash_attn_interface.flash_attn_with_kvcache`` takes packed queries (``cu_seqlens_q``),
per-request KV lengths (``cache_seqlens``) and the block table (``page_table``), so decodes,
first chunks and chunks after a cached prefix all run in one kernel call, reading the
pages in place. Causal is aligned bottom-right. Cache layout
``[num_blocks, block_size, kv_heads, head_dim]``. Imported lazily: FlashAttention-3 is built
from flash-attention's ``hopper/`` folder and runs on compute capability 9.x.
"""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata


class FA3AttentionBackend(AttentionBackend):
    name = "fa3"
    graph_context_buckets = False

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, kernel=None):
        """``kernel``: a function with FlashAttention-3's ``flash_attn_with_kvcache`` signature."""
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        if kernel is None:
            from flash_attn_interface import flash_attn_with_kvcache as kernel
        self._attn = kernel

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        self.write_kv(k, v, kv_cache, meta)
        k_cache, v_cache = kv_cache
        out = self._attn(q, k_cache, v_cache, cache_seqlens=meta.seqlens_k, page_table=meta.block_table,
                         cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
                         softmax_scale=self.scale, causal=True)
        return out.view(q.shape[0], -1)
