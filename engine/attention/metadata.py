"""Builds one step's packed inputs and attention metadata from the scheduled chunks.

Shared by every backend, so it is tested on CPU. Inputs are packed without padding:
decodes first (sorted by decreasing KV length, so the torch backend can batch them in
length groups), then prefill chunks. The slot mapping is computed with tensor ops from
positions and the block table, not per token in Python.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata

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


def build_step_inputs(chunks, block_size: int, device: torch.device):
    """Returns (chunks that sample, input_ids, positions, metadata, logits_indices).

    ``chunks`` are engine.scheduler.ScheduledChunk (or engine.tp's copies of them on the
    other ranks): ``start``, ``num_tokens``, ``token_ids`` (this step's), ``block_ids`` and
    ``samples`` (the chunk reaches the request's last known token, so it yields logits).
    """
    decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -(c.start + 1))
    prefills = [c for c in chunks if c.num_tokens != 1]
    order = decodes + prefills
    bs = block_size
    query_lens = [c.num_tokens for c in order]
    kv_lens = [c.start + c.num_tokens for c in order]
    ids: list[int] = [c.token_ids[0] for c in decodes]
    for c in prefills:
        ids.extend(c.token_ids)
    max_blocks = max(-(-kv // bs) for kv in kv_lens)
    table = []
    for c in order:
        row = c.block_ids[:max_blocks]
        table.append(row + [0] * (max_blocks - len(row)))
    q_lens_t = torch.tensor(query_lens, dtype=torch.int64)
    row_of_token = torch.repeat_interleave(torch.arange(len(order)), q_lens_t)
    cu_q = torch.zeros(len(order) + 1, dtype=torch.int64)
    torch.cumsum(q_lens_t, 0, out=cu_q[1:])
    offsets = torch.arange(len(ids)) - cu_q[:-1][row_of_token]
    positions = torch.tensor([c.start for c in order], dtype=torch.int64)[row_of_token] + offsets
    block_table = torch.tensor(table, dtype=torch.int64)
    slots = block_table[row_of_token, positions // bs] * bs + positions % bs
    kv_t = torch.tensor(kv_lens, dtype=torch.int64)
    cu_k = torch.zeros(len(order) + 1, dtype=torch.int64)
    torch.cumsum(kv_t, 0, out=cu_k[1:])
    sample_rows = [i for i, c in enumerate(order) if c.samples]
    logits_indices = (cu_q[1:] - 1)[sample_rows] if sample_rows else torch.zeros(0, dtype=torch.int64)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        cu_seqlens_q=cu_q.to(**i32), cu_seqlens_k=cu_k.to(**i32), seqlens_k=kv_t.to(**i32),
        block_table=block_table.to(**i32), slot_mapping=slots.to(device), max_seqlen_q=max(query_lens),
        max_seqlen_k=max(kv_lens), num_decodes=len(decodes), query_lens=query_lens, kv_lens=kv_lens,
        decode_groups=plan_decode_groups(kv_lens[:len(decodes)]))
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    return [order[i] for i in sample_rows], input_ids, positions.to(device), meta, logits_indices.to(device)
