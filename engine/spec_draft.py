"""Speculative decoding with a draft model: a smaller model of the same tokenizer proposes each
verifying request's k tokens, greedily, just before the target's step verifies them.

The draft has its own paged KV cache with as many blocks as the target's, and a request's
draft KV lives in the blocks the target's block manager gave it (the same ids, another pool), so
the scheduler's reservations (engine.spec_decode) cover both and nothing else is allocated or
freed. The draft's KV is caught up lazily: a request remembers how far its draft KV is valid,
and its first proposal pass computes everything after that (the whole prompt the first time, one
or two tokens after a verified step), then k - 1 one-token passes follow. Positions written
with draft tokens the target rejected are beyond what stays valid and are rewritten later.
Requests that do not draft (back-off, short of ``min_tokens``, grammars) cost the draft nothing.

Drafts are only proposals: whatever the draft says, engine.spec_verify keeps exactly the tokens
the target would have produced, so the draft's numerics never change an output.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig, ParallelConfig
from engine.errors import ModelLoadError
from engine.memory import DraftFootprint, checkpoint_bytes, graph_logits_bytes, max_context_tokens
from engine.model import ModelArch
from engine.scheduler import ScheduledChunk
from engine.spec_cost import StepCosts

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftPass(ScheduledChunk):
    """One request's tokens in a drafter's pass: explicit tokens (drafts are not the request's yet),
    a row of output at the last, and no prompt logprobs."""

    tokens: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return True

    @property
    def token_ids(self) -> list[int]:
        return self.tokens

    @property
    def prompt_logprob_positions(self) -> range:
        return range(0)


def drafter_footprint(config: EngineConfig, path: Path, arch: ModelArch, max_model_len: int,
                      graphs: bool) -> DraftFootprint:
    """What a drafter of ``arch``'s layers (a draft model's, an EAGLE-3 head's one), whose checkpoint
    is ``path``, will hold beside the target, known before either loads (engine.memory)."""
    from engine.attention import create_backend
    from engine.runner import resolve_device, resolve_dtype

    device = resolve_device(config.model.device)
    dtype, block_size = resolve_dtype(config.model.dtype, device), config.cache.block_size
    backend = create_backend(config.attention_backend, device, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                             block_size, dtype, config.cache.kv_cache_dtype, log=False)
    tokens = max_context_tokens(config.scheduler.max_num_seqs, max_model_len, block_size)
    graphs = graphs and device.type == "cuda" and backend.supports_cuda_graphs
    # Its graphs take catch-up passes of 1 + k tokens a request (DraftModel).
    logits = graph_logits_bytes(config.scheduler.max_num_seqs, 1 + config.speculative_config.num_speculative_tokens,
                                arch.vocab_size)
    # On CPU only the block bytes split the pool: the weights are not budgeted there (engine.memory).
    return DraftFootprint(weights_bytes=checkpoint_bytes(path, dtype) if device.type == "cuda" else 0,
                          block_bytes=backend.bytes_per_block(dtype) * arch.num_layers,
                          gather_bytes=backend.scratch_bytes(tokens, dtype) if device.type == "cuda" else 0,
                          graphs=graphs, logits_bytes=logits if graphs else 0)


def load_draft_arch(config: EngineConfig, target: ModelArch) -> tuple[Path, ModelArch]:
    """The draft model's directory and shape, checked against the target's."""
    from engine.models_hub import resolve_model

    spec = config.speculative_config
    path = Path(resolve_model(spec.model))
    arch = ModelArch.from_dir(path)
    if arch.vocab_size > target.vocab_size:
        raise ModelLoadError(f"speculative_config.model {spec.model!r} has a vocabulary of {arch.vocab_size} "
                             f"tokens, more than the target's {target.vocab_size}: it must share its tokenizer")
    return path, arch


class DraftModel:
    """The draft model's runner and its proposals (``propose``), owned by the engine."""

    follows_target = False
    """Its KV is caught up lazily, in ``propose`` (an EAGLE-3 head's follows every step: engine.spec_eagle)."""

    def __init__(self, config: EngineConfig, path: Path, arch: ModelArch, max_model_len: int,
                 num_blocks: int, dtype: torch.dtype) -> None:
        from engine.runner import ModelRunner

        spec = config.speculative_config
        if arch.max_position_embeddings < max_model_len:
            raise ModelLoadError(f"speculative_config.model {spec.model!r} reaches {arch.max_position_embeddings} "
                                 f"positions, fewer than max_model_len ({max_model_len})")
        model = dataclasses.replace(config.model, model=spec.model, quantization=spec.quantization, gguf_file=None,
                                    dtype=str(dtype).removeprefix("torch."))
        # Whole on rank 0 under tensor parallelism: a draft's pass is small, and sharding it would
        # add a collective per layer to each of its k passes while the other ranks wait anyway.
        draft_config = dataclasses.replace(
            config, model=model, lora=None, speculative_config=None, parallel=ParallelConfig(),
            cache=dataclasses.replace(config.cache, num_kv_blocks=num_blocks, kv_cache_memory_gb=None))
        # Its graphs take catch-up passes too: the last token and the drafts kept, 1 + k tokens at most.
        self.runner = ModelRunner(draft_config, path, arch, max_model_len, graph_width=1 + spec.num_speculative_tokens)
        logger.info("draft model %s: %d layers, %d KV blocks beside the target's", path.name, arch.num_layers,
                    num_blocks)

    @property
    def kv_tensors(self) -> list[torch.Tensor]:
        return [t for kv in self.runner.kv_caches for t in kv]

    def propose(self, chunks: list, costs: StepCosts | None = None) -> None:
        """Fill each verifying chunk's ``draft_token_ids`` (placeholders, as many as it reserved)
        with the draft model's greedy tokens after the request's last token; each pass's time goes
        to ``costs`` (engine.spec_cost)."""
        passes = []
        for c in chunks:
            req, state = c.request, c.request.spec
            if state.draft_preemptions != req.timing.num_preemptions:  # its blocks were freed: nothing holds
                state.draft_preemptions, state.draft_valid = req.timing.num_preemptions, 0
            done = min(state.draft_valid, c.start)
            passes.append(DraftPass(req, done, c.start + 1 - done, 0, req.token_ids[done:c.start + 1]))
        live = list(zip(chunks, passes))
        if costs is not None:
            costs.observe_rows(len(live))
        for j in range(max(len(c.draft_token_ids) for c in chunks)):
            t0 = time.perf_counter()
            token_of = self.runner.greedy([p for _, p in live])
            if costs is not None:  # by tokens: a first pass also catches up on what the draft missed
                costs.draft.observe(sum(p.num_tokens for _, p in live), time.perf_counter() - t0)
            following = []
            for c, p in live:
                c.draft_token_ids[j] = tok = token_of[id(p)]
                if j + 1 < len(c.draft_token_ids):
                    following.append((c, DraftPass(c.request, c.start + 1 + j, 1, 0, [tok])))
                else:  # its last draft token's KV is never needed: the target verifies it
                    c.request.spec.draft_valid = c.start + len(c.draft_token_ids)
            live = following
