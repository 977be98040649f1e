"""Reference attention in plain torch: CPU (and any device), the semantics of FlashAttention varlen.

Cache layout ``[kv_heads, num_blocks * block_size, head_dim]`` (heads outermost), so that
gathering a request's blocks yields per-head contiguous keys that feed ``bmm`` without a
second copy. Decodes are batched in groups of similar KV length (planned once per step in
``plan``) so padding stays small; prefill chunks run one request at a time (compute-bound,
and there are few per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata

# Cost of one extra decode group, in padded KV tokens: a group adds a few kernel launches
# per layer, which on CPU take about as long as gathering and attending over ~512 tokens.
GROUP_OVERHEAD_TOKENS = 512


def plan_decode_groups(kv_lens: list[int], overhead: int = GROUP_OVERHEAD_TOKENS) -> list[tuple[int, int, int]]:
    """Split KV lengths sorted in decreasing order into contiguous groups minimising
    padded tokens + ``overhead`` per group (exact dynamic programme; B is at most a few hundred)."""
    n = len(kv_lens)
    if n == 0:
        return []
    best = [0] + [1 << 62] * n     # best[j]: cost of grouping the first j requests
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * kv_lens[i] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    j = n
    while j > 0:
        i = cut[j]
        groups.append((i, j, kv_lens[i]))
        j = i
    return groups[::-1]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    verify_graphs = False  # its chunks after a prefix take their lengths from the host (``kv_lens``)

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        self._scratch: list[torch.Tensor | None] = [None, None]
        self._groups: list[tuple[int, int, int]] = []

    def plan(self, meta: AttentionMetadata) -> None:
        self._groups = plan_decode_groups(meta.kv_lens[:meta.num_decodes])

    def cache_shape(self, num_blocks):
        return self.num_kv_heads, num_blocks * self.block_size, self.head_dim

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        for cache, new in zip(kv_cache, (k, v)):
            cache.index_copy_(1, meta.slot_mapping, new.transpose(0, 1))

    def scratch_bytes(self, max_tokens, dtype):
        return max_tokens * self.token_bytes(dtype)

    def reserve(self, max_tokens, dtype, device):
        need = self.num_kv_heads * max_tokens * self.head_dim
        self._scratch = [torch.empty(need, dtype=dtype, device=device) for _ in range(2)]

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, which: int) -> torch.Tensor:
        """``[kv_heads, len(blocks) * block_size, d]`` holding the listed blocks, in order.

        Written into a scratch buffer kept across calls (one per K and V): a fresh multi-MB
        allocation per layer would be mmap'd and page-faulted in on every step."""
        h, _, d = cache.shape
        n = blocks.numel()
        need = h * n * self.block_size * d
        scratch = self._scratch[which]
        if scratch is None or scratch.numel() < need or scratch.dtype != cache.dtype or scratch.device != cache.device:
            scratch = torch.empty(max(need, 2 * (scratch.numel() if scratch is not None else 0)),
                                  dtype=cache.dtype, device=cache.device)
            self._scratch[which] = scratch
        out = scratch[:need].view(h, n, self.block_size * d)
        torch.index_select(cache.view(h, -1, self.block_size * d), 1, blocks, out=out)
        return out.view(h, n * self.block_size, d)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        self.write_kv(k, v, kv_cache, meta)
        k_cache, v_cache = kv_cache
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for first, end, max_len in self._groups:
            out[first:end] = self._decode_group(q[first:end], k_cache, v_cache, meta, first, end, max_len)
        s = meta.num_decodes
        for i in range(meta.num_decodes, len(meta.query_lens)):
            n = meta.query_lens[i]
            out[s:s + n] = self._prefill(q[s:s + n], k[s:s + n], v[s:s + n], k_cache, v_cache, meta, i)
            s += n
        return out

    def _decode_group(self, q, k_cache, v_cache, meta, first, end, max_len):
        g, hkv, d = end - first, self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        nb = -(-max_len // self.block_size)
        blocks = meta.block_table[first:end, :nb].reshape(-1).long()
        keys = self._gather(k_cache, blocks, 0).view(hkv * g, nb * self.block_size, d)
        values = self._gather(v_cache, blocks, 1).view(hkv * g, nb * self.block_size, d)
        qh = q.view(g, hkv, group, d).transpose(0, 1).reshape(hkv * g, group, d)
        scores = torch.bmm(qh, keys.transpose(1, 2)).mul_(self.scale)
        lens = meta.seqlens_k[first:end]
        pad = torch.arange(nb * self.block_size, device=q.device)[None, :] >= lens[:, None]
        scores.view(hkv, g, group, -1).masked_fill_(pad[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.bmm(probs, values)  # [hkv * g, group, d]
        return ctx.view(hkv, g, group, d).transpose(0, 1).reshape(g, self.num_heads * d)

    def _prefill(self, q, k, v, k_cache, v_cache, meta, i):
        n = q.shape[0]
        kv_len = meta.kv_lens[i]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if kv_len == n:  # no earlier context: attend to the new tokens only, plain causal
            out = F.scaled_dot_product_attention(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                                 is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            nb = -(-kv_len // self.block_size)
            blocks = meta.block_table[i, :nb].long()
            keys = self._gather(k_cache, blocks, 0)[:, :kv_len].unsqueeze(0)
            values = self._gather(v_cache, blocks, 1)[:, :kv_len].unsqueeze(0)
            # query j sits at position (kv_len - n + j) and sees keys up to it
            pos_q = torch.arange(kv_len - n, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= pos_q[:, None]
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
