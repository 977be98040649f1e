"""CPU attention that reads the paged cache in place: a small C++ kernel (engine.cpu_kernels).

Cache layouts: V ``[num_blocks, kv_heads, block_size, head_dim]`` and K the same with its last
two dimensions swapped (``[.., head_dim, block_size]``). One head's block is one contiguous run
of memory, which the hardware prefetcher streams (measured ~15 % faster than the CUDA backends'
``[num_blocks, block_size, kv_heads, head_dim]`` for a decode step); transposed keys let the
kernel score W keys per vector instruction with no horizontal sums (5-10 % faster per layer
than keys stored like values). Decodes and short chunks after a cached prefix go to the kernel
(``engine/csrc/paged_attention.cpp``), which walks each request's block table: no per-layer
gather, no padding to the longest context. First chunks attend to their own new K/V with torch's
fused CPU flash-attention (SDPA, causal), one call per request: they are compute-bound. So are
long chunks after a prefix, which get their context copied out of the cache and go to SDPA too.
The same library writes each step's K/V into its slots: ``index_put_`` on the head-major view
cost ~10x the kernel's time.

``kv_cache_dtype="int8"``: each head's block holds its values as int8 and a float32 scale per token
(``[num_blocks, kv_heads, block_size * (head_dim + 4)]``, engine/csrc/kv_layout.h): 68 bytes a
token and head at head_dim 64 against 128 in bfloat16, so a decode step reads about half the
bytes and the pool holds nearly twice the tokens. Scores are int8 dot products (AVX-512 VNNI,
engine/csrc/score_int8.h) of the keys and the query quantized per head, and the values are summed
under int16 weights (engine/csrc/values_int8.h). First chunks still attend
to their own K/V unquantized (as vLLM's 8-bit caches do); everything read back from the cache is
the quantized value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.cpu_kernels import load_kernel

SCALE_BYTES = 4
"""An int8 cache's float32 scale per token and head (engine/csrc/kv_layout.h)."""

SDPA_MIN_ROWS = 48
"""Chunks after a cached prefix with at least this many query rows go to torch's fused kernel, not
the paged kernel (measured: the paged kernel wins at 16 rows, loses 1.5x at 64 and 3x at 400)."""


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    supports_cuda_graphs = False
    graph_context_buckets = False

    batch_invariant = False
    """Every row of every step through the paged kernel, which computes each query row alone in one
    order: a row's output is then the same bits whatever its chunk, its batch or a cached prefix. The
    runner sets it where linear layers round activations to int8 (engine.model.quant.make_batch_invariant):
    SDPA and the kernel differ by float32 ulps, and one rounding flipped by them grows, layer by layer,
    into percent-sized hidden-state differences (a prefix hit then changed greedy text, issue 47).
    Chunks of up to ~512 rows run as fast or faster on the kernel; a 2048-row first chunk takes 1.4x
    SDPA's attention time (80 against 56 ms a layer, one thread of the 2-core AVX-512 host), a 512-row
    chunk after 1536 cached tokens 1.2x (37 against 31 ms)."""

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, kv_cache_dtype="auto"):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        ops = load_kernel()
        self._kernel, self._write = ops.paged_attention, ops.write_kv
        self.quantized = kv_cache_dtype == "int8"

    def cache_shape(self, num_blocks):
        if self.quantized:  # K and V alike
            return num_blocks, self.num_kv_heads, self.block_size * (self.head_dim + SCALE_BYTES)
        return num_blocks, self.num_kv_heads, self.block_size, self.head_dim

    def allocate_cache(self, num_blocks, dtype, device):
        if self.quantized:
            return tuple(torch.zeros(self.cache_shape(num_blocks), dtype=torch.int8, device=device) for _ in "kv")
        k = torch.zeros(num_blocks, self.num_kv_heads, self.head_dim, self.block_size, dtype=dtype, device=device)
        return k, torch.zeros(self.cache_shape(num_blocks), dtype=dtype, device=device)

    def token_bytes(self, dtype):
        if self.quantized:
            return 2 * self.num_kv_heads * (self.head_dim + SCALE_BYTES)
        return super().token_bytes(dtype)

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        self._write(*kv_cache, k, v, meta.slot_mapping)

    def decode_step_index(self, meta: AttentionMetadata) -> list[torch.Tensor]:
        """What ``slotserve_cpu::attention`` (engine/csrc/attention_step.cpp) reads for a decode-only
        step (any step when ``batch_invariant``: one kernel call serves it), which it serves in C++ as
        ``forward`` would; nothing for any other step."""
        if meta.num_decodes != len(meta.query_lens) and not self.batch_invariant:
            return []
        return [meta.slot_mapping, meta.cu_seqlens_q, meta.seqlens_k, meta.block_table]

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        self.write_kv(k, v, kv_cache, meta)
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
        d, lens = meta.num_decodes, meta.query_lens
        if d == len(lens) or self.batch_invariant:  # decode-only (most steps) or exact: one kernel call
            self._kernel(out, q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqlens_k, meta.block_table, self.scale)
            return out.view(q.shape[0], -1)
        if d:
            self._kernel(out[:d], q[:d], k_cache, v_cache, meta.cu_seqlens_q[:d + 1], meta.seqlens_k[:d],
                         meta.block_table[:d], self.scale)
        s = d
        for i in range(d, len(lens)):
            n = lens[i]
            if i >= meta.num_gathered:  # a first chunk: its own keys only
                out[s:s + n] = self._sdpa(q[s:s + n], k[s:s + n], v[s:s + n], None)
            elif n < SDPA_MIN_ROWS:  # a short chunk after a cached prefix
                self._kernel(out[s:s + n], q[s:s + n], k_cache, v_cache, meta.cu_seqlens_q.new_tensor([0, n]),
                             meta.seqlens_k[i:i + 1], meta.block_table[i:i + 1], self.scale)
            else:
                out[s:s + n] = self._after_prefix(q[s:s + n], k_cache, v_cache, meta.block_table[i], meta.kv_lens[i])
            s += n
        return out.view(q.shape[0], -1)

    def _sdpa(self, q, k, v, mask):
        """Attention of ``q`` ``[n, heads, head_dim]`` over ``k``/``v`` ``[keys, kv_heads, head_dim]``:
        causal from the first key without ``mask``, else ``mask`` ``[n, keys]``. Inputs go in as
        ``[1, heads, tokens, head_dim]``: torch's fused CPU kernel takes 4-D inputs only (3-D ones fall
        back to the unfused math path, 3-10x slower)."""
        q1, k1, v1 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return F.scaled_dot_product_attention(q1, k1, v1, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                              enable_gqa=True)[0].transpose(0, 1)

    def _after_prefix(self, q, k_cache, v_cache, blocks, length: int):
        """A long chunk after a cached prefix: its context copied out of the cache, then torch's fused
        kernel with a causal mask aligned bottom-right. The paged kernel scores one query row at a
        time, which a long chunk makes compute-bound (400 rows over 1,900 keys: ~20 -> ~7 ms a layer)."""
        n = q.shape[0]
        keys, values = self.read_context(k_cache, v_cache, blocks, length, q.dtype)
        mask = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
        return self._sdpa(q, keys, values, mask)

    def read_context(self, k_cache, v_cache, blocks, length: int, dtype: torch.dtype):
        """A request's first ``length`` cached keys and values, ``[length, kv_heads, head_dim]`` each in
        ``dtype`` (an int8 cache's values times their tokens' scales)."""
        table = blocks[:-(-length // self.block_size)].long()
        k_blocks, v_blocks = k_cache[table], v_cache[table]
        if self.quantized:
            n, heads, d, bs = len(table), self.num_kv_heads, self.head_dim, self.block_size
            k_scale, v_scale = (b[..., d * bs:].contiguous().view(torch.float32) for b in (k_blocks, v_blocks))
            # K values are [head_dim / 4, block_size, 4] of int8 + 128: back to [head_dim, block_size]
            keys = k_blocks[..., :d * bs].view(torch.uint8).view(n, heads, d // 4, bs, 4).transpose(3, 4)
            k_blocks = (keys.reshape(n, heads, d, bs).float() - 128) * k_scale[:, :, None, :]
            # V values are [block_size / 2, head_dim, 2]: back to [block_size, head_dim]
            values = v_blocks[..., :d * bs].view(n, heads, bs // 2, d, 2).transpose(3, 4)
            v_blocks = values.reshape(n, heads, bs, d).float() * v_scale[..., None]
        # K blocks are [kv_heads, head_dim, block_size], V blocks [kv_heads, block_size, head_dim].
        keys = k_blocks.permute(0, 3, 1, 2).reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        values = v_blocks.permute(0, 2, 1, 3).reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        return keys.to(dtype), values.to(dtype)
