"""Model runner: turns a scheduler step into packed tensors, runs the model, samples.

Step inputs are built by engine.attention.metadata (shared by every backend).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from engine.attention import create_backend
from engine.attention.metadata import build_step_inputs
from engine.config import EngineConfig
from engine.model import ModelArch, load_model
from engine.parallel import ParallelGroup
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_GB = 2.0
GPU_MEMORY_FRACTION = 0.85


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


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, arch: ModelArch, max_model_len: int,
                 group: ParallelGroup | None = None, device: str | None = None,
                 agree_blocks: Callable[[int, int], int] | None = None) -> None:
        """``group``/``device``: this rank's place and device (default: alone, ``config.model.device``).
        ``agree_blocks(blocks, param_bytes)``: with tensor parallelism, the KV pool size every
        rank can hold (each sizes its own from its memory)."""
        self.config = config
        self.group = group or ParallelGroup()
        self.device = torch.device(device) if device is not None else resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        heads = self.group.heads(arch.num_heads, arch.num_kv_heads)
        self.backend = create_backend(config.attention_backend, self.device, heads.q_count, heads.kv_count,
                                      arch.head_dim, self.block_size)
        self.model = load_model(model_path, arch, self.group, self.backend, self.dtype, self.device, max_model_len)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.num_layers = arch.num_layers
        blocks = self._pool_size(max_model_len)
        self.num_blocks = agree_blocks(blocks, self.param_bytes) if agree_blocks is not None else blocks
        self.kv_caches = [self.backend.allocate_cache(self.num_blocks, self.dtype, self.device)
                          for _ in range(arch.num_layers)]
        self.sampler = Sampler()
        self.send_step: Callable[[list], None] | None = None
        """Rank 0 with tensor parallelism: hands each step to the other ranks before running it."""

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
    def prepare(self, chunks: list):
        return build_step_inputs(chunks, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], timings: dict[str, float] | None = None):
        """Run one step; returns (requests that sampled, their tokens, their logprobs)."""
        t0 = time.perf_counter()
        if self.send_step is not None:
            self.send_step(chunks)
        tb = time.perf_counter()
        sampling, input_ids, positions, meta, logits_idx = self.prepare(chunks)
        reqs = [c.request for c in sampling]
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
            if self.send_step is not None:
                timings["tp_broadcast"] = timings.get("tp_broadcast", 0.0) + (tb - t0)
            timings["prepare"] = timings.get("prepare", 0.0) + (t1 - tb)
            timings["forward"] = timings.get("forward", 0.0) + (t2 - t1)
            timings["sample"] = timings.get("sample", 0.0) + (t3 - t2)
        return reqs, tokens, logprobs

    @torch.inference_mode()
    def follow(self, chunks: list) -> None:
        """A step rank 0 scheduled, on another tensor-parallel rank: the same inputs and the same
        collectives; the logits go to rank 0, which samples."""
        _, input_ids, positions, meta, logits_idx = self.prepare(chunks)
        self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
