"""FlashAttention-2 through torch alone: ``torch.nn.attention.varlen.varlen_attn`` (CUDA).

Cache layout ``[num_blocks, block_size, kv_heads, head_dim]``. The step's new K/V are
written by slot mapping. First prefill chunks attend to their own K/V; requests that read
cached context (decodes, chunks after a cached prefix) use the paged kernel, which needs a
torch whose ``varlen_attn`` takes ``block_table`` and ``seqused_k`` and a ``block_size`` that
is a multiple of 256 (FlashAttention-2's page size); other block sizes go to the Triton
backend (engine.attention.triton_backend). Causal is ``window_size=(-1, 0)``, aligned
bottom-right: query ``j`` of a chunk of ``n`` over ``L`` keys sees keys ``<= L - n + j``. GQA
through ``enable_gqa`` where this torch has it, else K/V heads repeated for first chunks.
Capabilities are read off the signature, not the version.
"""

from __future__ import annotations

import inspect

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata

PAGED_BLOCK_MULTIPLE = 256
CAUSAL = (-1, 0)


def torch_varlen_kernel():
    """``varlen_attn`` of this torch, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def kernel_features(kernel) -> tuple[bool, bool]:
    """(takes ``enable_gqa``, takes ``block_table`` and ``seqused_k``)."""
    params = inspect.signature(kernel).parameters
    return "enable_gqa" in params, "block_table" in params and "seqused_k" in params


def pages_in_place(kernel, block_size: int, gqa: bool) -> bool:
    """Whether the kernel reads the paged cache in place (no GQA needs no repeat of the pool)."""
    takes_gqa, takes_pages = kernel_features(kernel)
    return takes_pages and block_size % PAGED_BLOCK_MULTIPLE == 0 and (takes_gqa or not gqa)


class VarlenAttentionBackend(AttentionBackend):
    name = "varlen"
    graph_context_buckets = False

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, kernel=None):
        """``kernel``: a function with ``varlen_attn``'s signature (default: torch's)."""
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        kernel = kernel if kernel is not None else torch_varlen_kernel()
        if kernel is None:
            raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn")
        self._group = num_heads // num_kv_heads
        if not pages_in_place(kernel, block_size, self._group > 1):
            raise ValueError(f"varlen_attn reads a paged cache only with block_table and seqused_k, at block "
                             f"sizes that are multiples of {PAGED_BLOCK_MULTIPLE} (got {block_size}), and with "
                             "enable_gqa for grouped-query heads")
        self._attn = kernel
        self._gqa, _ = kernel_features(kernel)
        self._step: dict = {}

    def plan(self, meta: AttentionMetadata) -> None:
        g = meta.num_gathered
        split = meta.gathered_tokens
        step = {"g": g, "split": split, "max_q": max(meta.query_lens[:g], default=0),
                "max_k": max(meta.kv_lens[:g], default=0), "fresh_max": max(meta.query_lens[g:], default=0)}
        if g < len(meta.query_lens):
            step["fresh_cu"] = meta.cu_seqlens_q[g:] - split
        self._step = step

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        self.write_kv(k, v, kv_cache, meta)
        k_cache, v_cache = kv_cache
        step = self._step
        g, split = step["g"], step["split"]
        if g == len(meta.query_lens):
            return self._context(q, k_cache, v_cache, meta).view(q.shape[0], -1)
        if g == 0:
            return self._fresh(q, k, v).view(q.shape[0], -1)
        out = torch.empty_like(q)
        out[:split] = self._context(q[:split], k_cache, v_cache, meta)
        out[split:] = self._fresh(q[split:], k[split:], v[split:])
        return out.view(q.shape[0], -1)

    def _context(self, q, k_cache, v_cache, meta):
        """Requests [0, g): causal over their cached context (which now holds the new tokens)."""
        step, g = self._step, self._step["g"]
        return self._call(q, k_cache, v_cache, meta.cu_seqlens_q[:g + 1], meta.cu_seqlens_k[:g + 1], step["max_q"],
                          step["max_k"], seqused_k=meta.seqlens_k[:g], block_table=meta.block_table[:g])

    def _fresh(self, q, k, v):
        """First chunks: causal over their own new K/V, no cache read."""
        cu, n = self._step["fresh_cu"], self._step["fresh_max"]
        return self._call(q, k, v, cu, cu, n, n)

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, **paged):
        kw = dict(scale=self.scale, window_size=CAUSAL, **paged)
        if self._group > 1:
            if self._gqa:
                kw["enable_gqa"] = True
            else:  # an older torch (first chunks only): every query head gets its own copy of its K/V head
                k, v = k.repeat_interleave(self._group, 1), v.repeat_interleave(self._group, 1)
        return self._attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
