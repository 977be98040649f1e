"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels; replaying them as one captured graph
takes the host out of the step. Graphs are captured at start for each (batch bucket,
context bucket): the step's rows are padded up to the batch bucket, and its longest
context picks the context bucket (the torch backend's padded batch grows with it; the
paged kernels of every other backend need one context bucket). Inputs live in static buffers:
token ids, positions, block-table rows and, with LoRA, each row's adapter slot; the block table,
slot mapping, KV lengths and cu_seqlens are derived on the device inside the graph. Padding rows
read and write only the scratch block, which the block manager never hands out. Steps with a
prefill chunk, or that fit no bucket, run eagerly. Without capture (CPU, tests) the same static path runs eagerly.

With speculative decoding, steps that verify drafts (engine.spec_verify) have graphs of their own, one
more width: every row is padded to 1 + k query tokens (its last token, its drafts, then padding), and
padding tokens write the scratch block. A row's real queries attend exactly what they would eagerly;
padding queries only read what is there, and their logits are dropped.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.block_table import BlockTable

logger = logging.getLogger(__name__)

SMALL_BATCHES = (1, 2, 4, 8)
BATCH_STEP = 8
SMALLEST_CONTEXT = 256


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8, and ``max_num_seqs`` itself."""
    out = [b for b in SMALL_BATCHES if b < max_num_seqs]
    out += range(SMALL_BATCHES[-1] + BATCH_STEP, max_num_seqs, BATCH_STEP)
    return sorted(set(out) | {max_num_seqs})


def context_buckets(max_model_len: int, smallest: int = SMALLEST_CONTEXT) -> list[int]:
    """Powers of two from ``smallest`` below ``max_model_len``, then ``max_model_len``."""
    out = []
    c = smallest
    while c < max_model_len:
        out.append(c)
        c *= 2
    return out + [max_model_len]


def smallest_fit(buckets: list[int], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True, order=True)
class GraphKey:
    batch: int
    context: int
    lora: bool = False
    """A LoRA engine's steps with an adapter row (they read every slot); steps without one skip LoRA."""
    width: int = 1
    """Query tokens a row: 1 in decode steps, 1 + k in steps verifying up to k drafts a row."""


def decode_metadata(table: BlockTable, rows: torch.Tensor, positions: torch.Tensor, context: int,
                    block_size: int) -> AttentionMetadata:
    """Metadata of a padded decode batch, from device tensors only (so it can be captured).

    Row ``i`` decodes the token at ``positions[i]`` of the request in block-table row
    ``rows[i]``; padding rows point at the table's pad row (the scratch block) and position 0."""
    b = rows.shape[0]
    block_table = table.gather(rows, -(-context // block_size))
    seqlens = (positions + 1).int()
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device=rows.device)
    cu_k[1:] = torch.cumsum(seqlens, 0)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=rows.device)
    blocks = block_table.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    slots = blocks.long() * block_size + positions % block_size
    return AttentionMetadata(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqlens_k=seqlens, block_table=block_table,
                             slot_mapping=slots, max_seqlen_q=1, max_seqlen_k=context, num_decodes=b,
                             query_lens=[1] * b, kv_lens=[context] * b, num_gathered=b)


def verify_metadata(table: BlockTable, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, width: int,
                    context: int, block_size: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of a padded verification batch, from device tensors only.

    Row ``i`` has ``width`` query tokens at positions ``starts[i]`` on, of which the first ``lens[i]``
    are real (the request's last token and its drafts, whose slots the scheduler reserved); the others,
    and padding rows (``lens`` 0), write the scratch block. Keys run to ``starts[i] + width``, so each
    query sits at its own position (causal, aligned bottom-right) whatever the row's real length."""
    b = rows.shape[0]
    block_table = table.gather(rows, -(-context // block_size))
    offsets = torch.arange(width, device=rows.device)
    positions = starts[:, None] + offsets
    seqlens = (starts + width).int()
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device=rows.device)
    cu_k[1:] = torch.cumsum(seqlens, 0)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=rows.device) * width
    slots = block_table.gather(1, positions // block_size).long() * block_size + positions % block_size
    scratch = table.table[table.pad_row, 0].long() * block_size
    slots = torch.where(offsets[None, :] < lens[:, None], slots, scratch)
    meta = AttentionMetadata(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqlens_k=seqlens, block_table=block_table,
                             slot_mapping=slots.reshape(-1), max_seqlen_q=width, max_seqlen_k=context,
                             num_decodes=0, query_lens=[width] * b, kv_lens=[context] * b, num_gathered=b)
    return positions.reshape(-1), meta


class DecodeGraphs:
    def __init__(self, forward: Callable, backend: AttentionBackend, kv_caches: list, table: BlockTable,
                 block_size: int, max_num_seqs: int, max_model_len: int, vocab_size: int,
                 device: torch.device, lora_step=None, widths: tuple[int, ...] = (1,), streams_of=None) -> None:
        self.forward = forward
        """Called like the model: eager modules, or the compiled decoder (captured the same way)."""
        self.backend = backend
        self.kv_caches = kv_caches
        self.table = table
        self.block_size = block_size
        self.lora_step = lora_step
        """engine.lora.layers.LoRAStep of a LoRA engine: graphs read every slot, each row's from the buffer."""
        self.batches = batch_buckets(max_num_seqs)
        self.contexts = context_buckets(max_model_len) if backend.graph_context_buckets else [max_model_len]
        self.streams_of = streams_of
        """The model whose ``aux_out`` streams an EAGLE-3 head reads after each step (engine.spec_eagle):
        kept in a buffer of the graphs', since a replay rewrites the captured tensors, not the attribute."""
        self._streams: torch.Tensor | None = None
        self.widths = sorted(set(widths) | {1})
        """1, and 1 + k for an engine verifying up to k drafts a row (engine.spec_decode)."""
        top, wide = self.batches[-1], self.widths[-1]
        # Inference tensors, as eager steps' inputs are: a compiled model guards on the difference.
        with torch.inference_mode():
            # ids, positions, table rows, adapter slots (-1: none)
            self._inputs = torch.zeros(4, top, dtype=torch.int64, device=device)
            self._inputs[2], self._inputs[3] = table.pad_row, -1
            # verification: per row, its real tokens, then its drafts (the first token is in _inputs)
            self._drafts = torch.zeros(top, wide, dtype=torch.int64, device=device)
        self._sample_all = torch.arange(top * wide, device=device)
        self._logits = torch.empty(top * wide, vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}

    @property
    def keys(self) -> list[GraphKey]:
        variants = (False, True) if self.lora_step is not None else (False,)
        return [GraphKey(b, c, lora, w) for w in self.widths for b in self.batches for c in self.contexts
                for lora in variants]

    def key_for(self, chunks) -> GraphKey | None:
        """The bucket a step fits, else None (it runs eagerly): a decode-only step, or one whose chunks
        of several tokens come after a cached context (verifying drafts, a drafter catching up)."""
        if not chunks:
            return None
        width = max(c.num_tokens for c in chunks)
        if width > 1 and any(c.num_tokens > 1 and c.start == 0 for c in chunks):
            return None  # a first chunk: eagerly, where backends attend to its own keys only
        width = smallest_fit(self.widths, width)
        batch = smallest_fit(self.batches, len(chunks))
        context = smallest_fit(self.contexts, max(c.start for c in chunks) + (width or 1))
        lora = self.lora_step is not None and any(c.lora_slot >= 0 for c in chunks)
        return None if None in (width, batch, context) else GraphKey(batch, context, lora, width)

    def run(self, chunks, key: GraphKey) -> torch.Tensor:
        """Logits of a step that fits ``key``: a row per chunk that samples, at its last token, in chunk
        order (a row per position of a chunk verifying drafts, as engine.spec_verify.draft_rows lists them)."""
        rows = self.table.update(chunks, self.block_size)
        pad = key.batch - len(chunks)
        host = torch.tensor([[c.token_ids[0] for c in chunks] + [0] * pad, [c.start for c in chunks] + [0] * pad,
                             rows + [self.table.pad_row] * pad, [c.lora_slot for c in chunks] + [-1] * pad],
                            dtype=torch.int64)
        self._inputs[:, :key.batch].copy_(host, non_blocking=True)
        w = key.width
        if w > 1:
            drafts = [[c.num_tokens, *c.token_ids[1:], *[0] * (w - c.num_tokens)] for c in chunks] + [[0] * w] * pad
            self._drafts[:key.batch, :w].copy_(torch.tensor(drafts, dtype=torch.int64), non_blocking=True)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self._forward(key)
        if self.streams_of is not None:  # row i's tokens from i x width on (``aux_rows``)
            self.streams_of.aux_out = self._streams[:key.batch * w]
        picked = [i * w + j for i, c in enumerate(chunks) if c.samples
                  for j in (range(c.num_tokens) if c.speculative else (c.num_tokens - 1,))]
        if picked == list(range(len(chunks))):
            return self._logits[:len(chunks)]
        return self._logits[torch.tensor(picked).to(self._logits.device, non_blocking=True)]

    def _forward(self, key: GraphKey) -> None:
        ids, positions, rows, lora_slots = self._inputs[:, :key.batch]
        tokens = key.batch * key.width
        if key.width == 1:
            meta = decode_metadata(self.table, rows, positions, key.context, self.block_size)
        else:
            drafts = self._drafts[:key.batch, :key.width]
            positions, meta = verify_metadata(self.table, rows, positions, drafts[:, 0], key.width, key.context,
                                              self.block_size)
            ids = torch.cat([ids[:, None], drafts[:, 1:]], dim=1).reshape(-1)
            lora_slots = lora_slots.repeat_interleave(key.width)  # a row's tokens under the row's adapter
        if key.lora:
            self.lora_step.set(lora_slots, self.lora_step.max_loras)
        elif self.lora_step is not None:
            self.lora_step.set(None)
        self.backend.plan(meta)
        try:
            logits = self.forward(ids, positions, self.kv_caches, meta, self._sample_all[:tokens])
        finally:  # nothing of the graph's buffers stays in the host state an eager step could read
            if self.lora_step is not None:
                self.lora_step.set(None)
        self._logits[:tokens].copy_(logits)
        if self.streams_of is not None:
            streams = self.streams_of.aux_out
            if self._streams is None:  # the first call is a warm-up, outside any capture
                self._streams = streams.new_empty(self._logits.shape[0], streams.shape[1])
            self._streams[:tokens].copy_(streams)

    def capture(self) -> None:
        """Capture every bucket, largest first so later graphs reuse the shared pool's memory."""
        started = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = None
        for key in sorted(self.keys, reverse=True):
            self._inputs[0, :key.batch] = 0
            self._inputs[1, :key.batch] = 0
            self._inputs[2, :key.batch] = self.table.pad_row
            self._inputs[3, :key.batch] = -1
            self._drafts[:key.batch] = 0
            self._forward(key)  # warm-up: lazy library set-up must not happen inside a capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(key)
            pool = graph.pool()
            self._graphs[key] = graph
        torch.cuda.synchronize()
        logger.info("captured %d step graphs (batches %s, contexts %s, query widths %s) in %.1f s, pool %.0f MiB",
                    len(self._graphs), self.batches, self.contexts, self.widths, time.perf_counter() - started,
                    (torch.cuda.memory_reserved() - before) / 2**20)
