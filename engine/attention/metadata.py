"""Builds one step's packed inputs and attention metadata from the scheduled chunks.

Shared by every backend, so it is tested on CPU. Inputs are packed without padding, in the
order of ``order_chunks``. The host builds a few small integer arrays and ships them in three
copies; the block table (engine.attention.block_table) and the slot mapping are computed on
the device with tensor ops, not per token in Python.
"""

from __future__ import annotations

import itertools

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.block_table import BlockTable
from engine.host_tensors import host_tensor

def order_chunks(chunks) -> tuple[list, int, int]:
    """(ordered chunks, number of decodes, number that read cached context).

    Decodes first, by decreasing KV length (so the torch backend can batch them in length groups); then chunks after a cached prefix; then first
    chunks (``start == 0``), which attend only to their own new tokens."""
    decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -c.start)
    later = [c for c in chunks if c.num_tokens != 1 and c.start > 0]
    first = [c for c in chunks if c.num_tokens != 1 and c.start == 0]
    return decodes + later + first, len(decodes), len(decodes) + len(later)


def _pack_tokens(order) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(token ids, positions, row of each token, query lengths, KV lengths) of a mixed step."""
    ids: list[int] = []
    positions: list[int] = []
    row_of_token: list[int] = []
    for i, c in enumerate(order):
        if c.num_tokens == 1:
            ids.append(c.token_ids[0])
            positions.append(c.start)
            row_of_token.append(i)
        else:
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + c.num_tokens))
            row_of_token.extend([i] * c.num_tokens)
    return (ids, positions, row_of_token, [c.num_tokens for c in order],
            [c.start + c.num_tokens for c in order])


def build_step_inputs(chunks, block_size: int, device: torch.device, table: BlockTable | None = None,
                      drafts: bool = False):
    """Returns (chunks that sample, input_ids, positions, metadata, logits_indices).

    ``logits_indices``: a row per chunk that samples, in order, then the rows of the positions
    chunks name in ``prompt_logprob_positions`` (their logits score the next prompt token).
    ``drafts``: some chunks verify draft tokens (``speculative``): each of their positions gets a row.

    ``chunks`` are engine.scheduler.ScheduledChunk (or engine.tp's copies of them on the
    other ranks): ``start``, ``num_tokens``, ``token_ids`` (this step's), ``block_ids`` and
    ``samples`` (the chunk reaches the request's last known token, so it yields logits).
    ``table``: the runner's persistent block table (default: a throwaway one for this step).
    """
    order, num_decodes, num_gathered = order_chunks(chunks)
    if table is None:
        table = BlockTable.for_step(order, block_size, device)
    rows = table.update(order, block_size)
    b = len(order)
    if num_decodes == b:  # decode-only (most steps): one token per request
        positions = [c.start for c in order]
        ids = [c.token_ids[0] for c in order]
        row_of_token = list(range(b))
        query_lens = [1] * b
        kv_lens = [p + 1 for p in positions]
        cu_q = list(range(b + 1))
    else:
        ids, positions, row_of_token, query_lens, kv_lens = _pack_tokens(order)
        cu_q = [0, *itertools.accumulate(query_lens)]
    # Not every one-token chunk samples: the last token of a prefill cut by the step's budget does not.
    sample_rows = [i for i, c in enumerate(order) if c.samples]
    # After the sampling rows: the rows of prompt positions whose logprobs were asked for.
    prompt_rows = [cu_q[i] + q - c.start for i, c in enumerate(order)
                   for q in getattr(c, "prompt_logprob_positions", ())]
    # Three host tensors, shipped in non-blocking copies: per token, per request, cu_seqlens.
    per_token = host_tensor(torch.int64, ids, positions, row_of_token).view(3, -1)
    logit_rows = ([cu_q[i + 1] - 1 for i in sample_rows] if not drafts else
                  [r for i in sample_rows for r in (range(cu_q[i], cu_q[i + 1]) if order[i].speculative
                                                    else (cu_q[i + 1] - 1,))])
    per_request = host_tensor(torch.int64, rows, logit_rows, prompt_rows)
    lengths = host_tensor(torch.int32, cu_q, [0, *itertools.accumulate(kv_lens)], kv_lens)
    if device.type != "cpu":
        # Pinned (torch's host allocator caches the pages): a copy from pageable memory would block.
        per_token, per_request, lengths = (t.pin_memory().to(device, non_blocking=True)
                                           for t in (per_token, per_request, lengths))
    input_ids, pos, token_rows = per_token.unbind()
    block_table = table.gather(per_request[:b], -(-max(kv_lens) // block_size))
    slots = block_table[token_rows, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(
        cu_seqlens_q=lengths[:b + 1], cu_seqlens_k=lengths[b + 1:2 * b + 2], seqlens_k=lengths[2 * b + 2:],
        block_table=block_table, slot_mapping=slots, max_seqlen_q=max(query_lens), max_seqlen_k=max(kv_lens),
        num_decodes=num_decodes, query_lens=query_lens, kv_lens=kv_lens, num_gathered=num_gathered)
    return [order[i] for i in sample_rows], input_ids, pos, meta, per_request[b:]
