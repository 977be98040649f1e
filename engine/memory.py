"""GPU memory budget: what the engine holds besides the KV pool, and the pool from what remains.

Under ``gpu_memory_utilization`` x the GPU's memory go: the weights, the peak activations
of the largest step (measured by running one dummy step of ``max_num_batched_tokens``
first-chunk tokens over ``max_num_seqs`` requests, sampler included), the CUDA-graph pool
(decode steps are smaller than that step, so its peak bounds the pool), the attention
backend's gather buffers, and memory outside torch's allocator (CUDA context, other
processes). The KV pool gets the rest, capped where every slot already holds a full-length
request. The arithmetic is a pure function, tested on CPU; the measuring needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int
    utilization: float
    weights_bytes: int
    activation_bytes: int
    graph_pool_bytes: int
    gather_bytes: int
    other_bytes: int
    """In use outside torch's allocator: the CUDA context, libraries, other processes."""
    block_bytes: int
    """One KV block across all layers (K and V)."""

    @property
    def allowed_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return (self.allowed_bytes - self.weights_bytes - self.activation_bytes - self.graph_pool_bytes
                - self.gather_bytes - self.other_bytes)

    def num_blocks(self, ceiling: int) -> int:
        """KV blocks that fit, at most ``ceiling``; ValueError naming the option when under 2."""
        blocks = min(max(self.kv_bytes, 0) // self.block_bytes, ceiling)
        if blocks < 2:
            raise ValueError(f"gpu_memory_utilization {self.utilization} leaves no room for a KV pool: "
                             f"{self.describe()}; raise gpu_memory_utilization, lower max_num_batched_tokens, "
                             f"max_num_seqs or max_model_len, or set enforce_eager")
        return blocks

    def describe(self) -> str:
        parts = [("allowed", self.allowed_bytes), ("weights", self.weights_bytes),
                 ("activations", self.activation_bytes), ("graphs", self.graph_pool_bytes),
                 ("gather", self.gather_bytes), ("other", self.other_bytes), ("KV", max(self.kv_bytes, 0))]
        return ", ".join(f"{name} {b / GIB:.2f} GiB" for name, b in parts)


def dummy_prefill(num_tokens: int, max_seqs: int, max_len: int, block_size: int) -> tuple[list, int]:
    """The largest step: first chunks of ``num_tokens`` tokens in all over up to ``max_seqs``
    requests (each at most ``max_len``), every one sampling. Returns (chunks, blocks used)."""
    from engine.tp.messages import RemoteChunk

    n = max(1, min(max_seqs, num_tokens))
    total = min(num_tokens, n * max_len)
    lens = [total // n + (1 if i < total % n else 0) for i in range(n)]
    chunks, next_block = [], 0
    for length in lens:
        need = -(-length // block_size)
        chunks.append(RemoteChunk(0, length, True, [0] * length, list(range(next_block, next_block + need))))
        next_block += need
    return chunks, next_block


def worst_case_sampling(rows: int, device: torch.device):
    """A sampling batch taking the sampler's heaviest path (top-k, top-p, min-p, random draws)."""
    from engine.sampler import SamplingBatch

    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return SamplingBatch(
        requests=[None] * rows, temperature=torch.ones(rows, **f32), top_k=torch.full((rows,), 50, **i64),
        top_p=torch.full((rows,), 0.9, **f32), min_p=torch.full((rows,), 0.05, **f32),
        seeds=torch.arange(rows, **i64), positions=torch.zeros(rows, **i64), all_greedy=False, all_random=True,
        any_top_k=True, any_top_p=True, any_min_p=True, any_penalty=False, any_min_tokens=False,
        any_logit_bias=False, any_structured=False, max_logprobs=None)


def measure_peak(step: Callable[[], object], device: torch.device) -> int:
    """Bytes ``step`` allocates at its peak beyond what was allocated before it (CUDA)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def outside_torch_bytes(device: torch.device) -> tuple[int, int]:
    """(total device bytes, bytes in use that torch's allocator does not hold)."""
    free, total = torch.cuda.mem_get_info(device)
    return total, max(total - free - torch.cuda.memory_reserved(device), 0)
