"""Model runner: turns a scheduler step into packed tensors, runs the model, samples.

Step inputs are packed without padding: decodes first (sorted by KV length, so the torch
backend can batch them in length groups), then prefill chunks. The slot mapping is computed
with tensor ops from positions and the block table, not per token in Python.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, create_backend
from engine.config import EngineConfig
from engine.model import ModelArch, load_model
from engine.parallel import ParallelGroup
from engine.request import Request
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_GB = 2.0
GPU_MEMORY_FRACTION = 0.85
# Cost of one extra decode group, in padded KV tokens: a group adds a few kernel launches
# per layer, which on CPU take about as long as gathering and attending over ~512 tokens.
GROUP_OVERHEAD_TOKENS = 512


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # float32 on CPU: exact against the HF oracle and not slower for small models here.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


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


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, arch: ModelArch, max_model_len: int,
                 group: ParallelGroup | None = None) -> None:
        self.config = config
        self.group = group or ParallelGroup()
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        tp = self.group.world_size
        self.backend = create_backend(config.attention_backend, self.device, arch.num_heads // tp,
                                      max(1, arch.num_kv_heads // tp), arch.head_dim, self.block_size)
        self.model = load_model(model_path, arch, self.group, self.backend, self.dtype, self.device, max_model_len)
        self.num_layers = arch.num_layers
        self.num_blocks = self._pool_size(max_model_len)
        self.kv_caches = [self.backend.allocate_cache(self.num_blocks, self.dtype, self.device)
                          for _ in range(arch.num_layers)]
        self.sampler = Sampler()
        self.profile = config.profile

    def _pool_size(self, max_model_len: int) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.backend.bytes_per_block(self.dtype) * self.num_layers
        if cache.kv_cache_memory_gb is not None:
            budget = cache.kv_cache_memory_gb * (1 << 30)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * GPU_MEMORY_FRACTION
        else:
            budget = DEFAULT_CPU_KV_GB * (1 << 30)
        # No use holding more than every slot at full length (plus room for cached prefixes).
        ceiling = 2 * self.config.scheduler.max_num_seqs * -(-max_model_len // self.block_size)
        blocks = min(int(budget // per_block), ceiling)
        if blocks < 2:
            raise ValueError(f"KV cache budget {budget / (1 << 30):.3f} GiB holds fewer than 2 blocks "
                             f"of {per_block} bytes; raise kv_cache_memory_gb or num_kv_blocks")
        logger.info("KV pool: %d blocks of %d tokens (%.2f GiB)", blocks, self.block_size,
                    blocks * per_block / (1 << 30))
        return blocks

    # ------------------------------------------------------------------ one step
    def prepare(self, chunks: list[ScheduledChunk]):
        """Order chunks and build the packed inputs; returns (ordered chunks, tensors...)."""
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -(c.start + 1))
        prefills = [c for c in chunks if c.num_tokens != 1]
        order = decodes + prefills
        dev = self.device
        bs = self.block_size
        query_lens = [c.num_tokens for c in order]
        kv_lens = [c.start + c.num_tokens for c in order]
        ids: list[int] = []
        starts: list[int] = []
        for c in decodes:
            ids.append(c.request.token_ids[c.start])
        for c in prefills:
            ids.extend(c.request.token_ids[c.start:c.start + c.num_tokens])
        starts = [c.start for c in order]
        max_blocks = max(-(-kv // bs) for kv in kv_lens)
        table = [c.request.block_ids[:max_blocks] + [0] * (max_blocks - min(len(c.request.block_ids), max_blocks))
                 for c in order]
        i32 = dict(dtype=torch.int32, device=dev)
        q_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        row_of_token = torch.repeat_interleave(torch.arange(len(order)), q_lens_t)
        cu_q = torch.zeros(len(order) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=cu_q[1:])
        positions = torch.tensor(starts, dtype=torch.int64)[row_of_token] + (
            torch.arange(len(ids)) - cu_q[:-1][row_of_token])
        block_table = torch.tensor(table, dtype=torch.int64)
        slots = block_table[row_of_token, positions // bs] * bs + positions % bs
        kv_t = torch.tensor(kv_lens, dtype=torch.int64)
        cu_k = torch.zeros(len(order) + 1, dtype=torch.int64)
        torch.cumsum(kv_t, 0, out=cu_k[1:])
        sample_rows = [i for i, c in enumerate(order) if c.samples]
        logits_indices = (cu_q[1:] - 1)[sample_rows] if sample_rows else torch.zeros(0, dtype=torch.int64)
        meta = AttentionMetadata(
            cu_seqlens_q=cu_q.to(**i32), cu_seqlens_k=cu_k.to(**i32), seqlens_k=kv_t.to(**i32),
            block_table=block_table.to(**i32), slot_mapping=slots.to(dev), max_seqlen_q=max(query_lens),
            max_seqlen_k=max(kv_lens), num_decodes=len(decodes), query_lens=query_lens, kv_lens=kv_lens,
            decode_groups=plan_decode_groups(kv_lens[:len(decodes)]))
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        sampling_reqs = [order[i].request for i in sample_rows]
        return sampling_reqs, input_ids, positions.to(dev), meta, logits_indices.to(dev)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], timings: dict[str, float] | None = None):
        """Run one step; returns (requests that sampled, their tokens, their logprobs)."""
        t0 = time.perf_counter()
        reqs, input_ids, positions, meta, logits_idx = self.prepare(chunks)
        t1 = time.perf_counter()
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
        if timings is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        if not reqs:
            tokens, logprobs = [], []
        else:
            tokens, logprobs = self.sampler(logits, SamplingBatch.build(reqs, self.device))
        t3 = time.perf_counter()
        if timings is not None:
            timings["prepare"] = timings.get("prepare", 0.0) + (t1 - t0)
            timings["forward"] = timings.get("forward", 0.0) + (t2 - t1)
            timings["sample"] = timings.get("sample", 0.0) + (t3 - t2)
        return reqs, tokens, logprobs
