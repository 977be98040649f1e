"""Paged attention in Triton: reads K/V blocks in place at any block size (CUDA; CPU under the interpreter).

One program per (query row, KV head) attends the row's ``G`` query heads over the first
``seen`` tokens of its request (causal, aligned bottom-right), walking the block table in
tiles of ``BLOCK_N`` positions with an online softmax. A tile may span blocks, so the block
size need not be a power of two or divide the tile. Decodes, chunks after a cached prefix
and first chunks all fit this one kernel; the backend (engine.attention.triton_backend) sends
first chunks to torch's FlashAttention-2 varlen kernel where it has one.

The same source runs on CPU tensors under ``TRITON_INTERPRET=1`` (read when this module is
imported), which is how CI executes it on machines without a GPU (float32, small shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention(out_ptr, q_ptr, k_ptr, v_ptr, block_table_ptr, seqlens_k_ptr, cu_seqlens_q_ptr,
                     row_request_ptr, scale,
                     stride_q_row, stride_q_head, stride_o_row, stride_o_head,
                     stride_k_block, stride_k_token, stride_k_head, stride_table,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                     IEEE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(row_request_ptr + row)
    q_first = tl.load(cu_seqlens_q_ptr + request)
    q_len = tl.load(cu_seqlens_q_ptr + request + 1) - q_first
    seen = tl.load(seqlens_k_ptr + request) - q_len + (row - q_first) + 1

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, seen, BLOCK_N):
        pos = start + n
        valid = pos < seen
        block = tl.load(block_table_ptr + request * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        rows = block.to(tl.int64) * stride_k_block + (pos % BLOCK_SIZE) * stride_k_token + kv_head * stride_k_head
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, seqlens_k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    row_request: torch.Tensor, scale: float, block_n: int = 64) -> torch.Tensor:
    """``out[r] = attention of q[r]`` for every packed row ``r`` (``[rows, heads, head_dim]``); caches
    ``[num_blocks, block_size, kv_heads, head_dim]``; ``row_request[r]``: the request of row ``r``."""
    rows, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if rows == 0:
        return out
    _paged_attention[(rows, kv_heads)](
        out, q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, row_request, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32)
    return out
