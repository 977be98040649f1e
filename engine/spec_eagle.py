"""Speculative decoding with an EAGLE-3 head (engine.model.eagle3): drafts from the target's own
hidden states, one decoder layer deep.

At position i the head reads token i + 1 and the target's streams at i, so it can only follow the
target: after each step (``catch_up``), every position the target computed and kept goes through
the head, with the tokens that follow it (the prompt's, the sampled and the accepted ones). That
writes the head's KV (its own one-layer pool, in the blocks the target's block manager gave the
request, like a draft model's: engine.spec_draft) and leaves the head's output at each request's
last position on the request (engine.spec_decode's draft state). Before the next step
(``propose``), the LM head turns that output into the first draft of each request that drafts, and
drafts 2..k chain the head's own output, one token a pass. The target's streams are never stored: a
request uses them in the step that made them.

Positions that draft tokens the target rejected wrote are rewritten by the next catch-up. A
prefix-cache hit reuses the head's KV of the blocks it shares, written by the request that
computed them; at a block's last position that KV read the token that request had next, which
may differ: drafts are only proposals (engine.spec_verify keeps exactly the target's tokens).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention import create_backend
from engine.attention.block_table import BlockTable
from engine.attention.metadata import build_step_inputs, order_chunks
from engine.config import EngineConfig
from engine.model import ModelArch
from engine.model.eagle3 import Eagle3Arch, load_eagle3
from engine.model.layers import amx_supported, cpu_prepack_supported
from engine.request import RequestStatus
from engine.scheduler import ScheduledChunk
from engine.spec_cost import StepCosts
from engine.spec_decode import draft_state
from engine.spec_draft import DraftPass

logger = logging.getLogger(__name__)


def load_head_arch(config: EngineConfig, target: ModelArch) -> tuple[Path, Eagle3Arch]:
    """The head's directory and shape, checked against the target's."""
    from engine.models_hub import resolve_model

    path = Path(resolve_model(config.speculative_config.model))
    return path, Eagle3Arch.from_dir(path, target)


class Eagle3Drafter:
    """The head, its KV pool and block table, and the target model whose streams and embedding it reads."""

    follows_target = True
    """Each step's kept positions go through the head right after the step (``catch_up``)."""

    def __init__(self, config: EngineConfig, runner, path: Path, ea: Eagle3Arch) -> None:
        """``runner``: the target's, built with ``aux_layers=ea.aux_layers``."""
        layer = ea.layer
        self.device, self.block_size = runner.device, runner.block_size
        self.backend = create_backend(config.attention_backend, runner.device, layer.num_heads, layer.num_kv_heads,
                                      layer.head_dim, runner.block_size, runner.dtype, config.cache.kv_cache_dtype)
        self.head = load_eagle3(path, ea, self.backend, runner.dtype, runner.device, runner.max_model_len)
        if cpu_prepack_supported(runner.device, runner.dtype):  # unpacked, its small GEMMs cost 3-4x more
            self.head.prepack(config.scheduler.max_num_seqs, amx_supported(runner.device, runner.dtype))
        self.target = runner.model
        table = runner.whole_embedding  # under tensor parallelism the target's own is split by vocabulary
        self.embed = self.target.embed_tokens if table is None else functools.partial(F.embedding, weight=table)
        self.kv_cache = self.backend.allocate_cache(runner.num_blocks + 1, runner.dtype, runner.device)
        if runner.device.type == "cuda":  # sized once, as the target's: counted in the memory budget
            self.backend.reserve(runner.max_context_tokens, runner.dtype, runner.device)
        self.block_table = BlockTable(config.scheduler.max_num_seqs, -(-runner.max_model_len // runner.block_size),
                                      runner.device, pad_block=runner.num_blocks)
        logger.info("EAGLE-3 head %s: reads the inputs of target layers %s, draft vocabulary %d, %d KV blocks "
                    "beside the target's", path.name, list(ea.aux_layers), ea.draft_vocab_size, runner.num_blocks)

    @property
    def kv_tensors(self) -> list[torch.Tensor]:
        return list(self.kv_cache)

    def _run(self, passes: list[DraftPass], hidden: torch.Tensor) -> tuple[list, torch.Tensor]:
        """One pass of the head over ``passes`` (already in ``order_chunks``' order, ``hidden`` row for
        row): (the passes, the head's output at each one's last position)."""
        sampling, ids, positions, meta, logits_idx = build_step_inputs(passes, self.block_size, self.device,
                                                                       self.block_table)
        self.backend.plan(meta)
        out = self.head(ids, hidden, positions, self.kv_cache, meta, self.embed)
        return sampling, out.index_select(0, logits_idx[:len(sampling)])

    @torch.inference_mode()
    def catch_up(self, chunks: list[ScheduledChunk], rows: dict[int, int]) -> None:
        """After a step: the positions each chunk computed and kept, through the head. ``rows``: each
        chunk's first row in the target's streams of that step (``ModelRunner.aux_rows``). A request
        read to its last token keeps the head's output there: its first draft, if it drafts, comes
        from it (the LM head runs then, for drafting requests only)."""
        streams = self.target.aux_out
        passes, first, index = [], {}, []
        for c in chunks:
            req = c.request
            if req.status is not RequestStatus.RUNNING or req.params.pooling is not None:
                continue
            n = min(c.num_tokens, len(req.token_ids) - 1 - c.start)  # positions whose next token is known
            if n > 0:
                p = DraftPass(req, c.start, n, 0, req.token_ids[c.start + 1:c.start + 1 + n])
                passes.append(p)
                first[id(p)] = rows[id(c)]
        if not passes:
            return
        order = order_chunks(passes)[0]
        for p in order:
            index.extend(range(first[id(p)], first[id(p)] + p.num_tokens))
        hidden = streams.index_select(0, torch.tensor(index, device=streams.device))
        sampling, last = self._run(order, hidden)
        for p, out in zip(sampling, last):
            req = p.request
            if p.start + p.num_tokens == req.num_tokens - 1:
                draft_state(req, True).head_ready(req, out)

    @torch.inference_mode()
    def propose(self, chunks: list, costs: StepCosts | None = None) -> None:
        """Fill each verifying chunk's ``draft_token_ids`` (as many as it reserved): the first draft
        from the head's output at the last catch-up, each further one from a pass over the one before."""
        t0 = time.perf_counter()
        live = [(c, c.request.spec.head_hidden) for c in chunks]
        if costs is not None:
            costs.observe_rows(len(chunks))
        j = 0
        while live:
            if j > 0:  # the head over draft j - 1 (at its position), chaining its own output
                passes = {}
                for c, out in live:
                    p = DraftPass(c.request, c.start + j - 1, 1, 0, [c.draft_token_ids[j - 1]])
                    passes[id(p)] = (c, p, out)
                order = order_chunks([p for _, p, _ in passes.values()])[0]
                sampling, last = self._run(order, torch.stack([passes[id(p)][2] for p in order]))
                live = [(passes[id(p)][0], out) for p, out in zip(sampling, last)]
            tokens = self.head.draft_tokens(torch.stack([out for _, out in live])).tolist()
            if costs is not None:
                costs.draft.observe(len(live), time.perf_counter() - t0)
            for (c, _), tok in zip(live, tokens):
                c.draft_token_ids[j] = tok
            j += 1
            live = [(c, out) for c, out in live if j < len(c.draft_token_ids)]
            t0 = time.perf_counter()
