"""Triton paged attention (CUDA): reads the paged cache in place at any block size.

Cache layout ``[num_blocks, block_size, kv_heads, head_dim]``. Requests that read cached
context (decodes, chunks after a cached prefix) go to the Triton kernel
(engine.attention.triton_paged). First chunks attend to their own new K/V with torch's
FlashAttention-2 varlen kernel where this torch has one, else the Triton kernel reads them
from the cache too. No gather, no buffer sized to the longest context: CUDA graphs need no
context buckets.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.varlen import CAUSAL, kernel_features, torch_varlen_kernel


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_context_buckets = False

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, fresh_kernel="torch"):
        """``fresh_kernel``: a ``varlen_attn``-like kernel for first chunks; ``"torch"``: torch's, if it
        has one; None: the Triton kernel takes first chunks too."""
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from engine.attention.triton_paged import paged_attention
        self._paged = paged_attention
        fresh = torch_varlen_kernel() if fresh_kernel == "torch" else fresh_kernel
        self._gqa = num_heads != num_kv_heads
        if fresh is not None and self._gqa and not kernel_features(fresh)[0]:
            fresh = None  # an older varlen_attn without enable_gqa: the Triton kernel takes first chunks too
        self._fresh_kernel = fresh
        self._step: dict = {}

    def plan(self, meta: AttentionMetadata) -> None:
        """The request of each packed query row (device ops only: capturable)."""
        rows = sum(meta.query_lens)
        lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
        requests = torch.arange(len(meta.query_lens), dtype=torch.int32, device=lens.device)
        g = meta.num_gathered
        self._step = {"rows": rows, "split": meta.gathered_tokens, "first_chunks": g,
                      "row_request": torch.repeat_interleave(requests, lens, output_size=rows),
                      "fresh_max": max(meta.query_lens[g:], default=0)}

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        self.write_kv(k, v, kv_cache, meta)
        k_cache, v_cache = kv_cache
        step = self._step
        out = torch.empty_like(q)
        # FlashAttention-2 takes first chunks in half precision; otherwise the Triton kernel reads them too.
        fresh = (self._fresh_kernel is not None and q.dtype in (torch.float16, torch.bfloat16)
                 and step["split"] < step["rows"])
        split = step["split"] if fresh else step["rows"]
        if split:
            self._paged(out[:split], q[:split], k_cache, v_cache, meta.block_table, meta.seqlens_k,
                        meta.cu_seqlens_q, step["row_request"][:split], self.scale)
        if fresh:
            g, n = step["first_chunks"], step["fresh_max"]
            cu = meta.cu_seqlens_q[g:] - meta.cu_seqlens_q[g]
            gqa = {"enable_gqa": True} if self._gqa else {}
            out[split:] = self._fresh_kernel(q[split:], k[split:], v[split:], cu, cu, n, n, scale=self.scale,
                                             window_size=CAUSAL, **gqa)
        return out.view(q.shape[0], -1)
