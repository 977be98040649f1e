"""GPU memory budget: what the engine holds besides the KV pool, and the pool from what remains.

Under ``gpu_memory_utilization`` x the GPU's memory go: the weights, the peak activations
of the largest step (measured by running one dummy step of ``max_num_batched_tokens``
first-chunk tokens over ``max_num_seqs`` requests, sampler included), the CUDA-graph pool
(decode steps are smaller than that step, so its peak bounds the pool), the attention
backend's gather buffers, and memory outside torch's allocator (CUDA context, other
processes). With speculative decoding, a drafter (a draft model or an EAGLE-3 head) sits on the
same GPU: its weights and buffers are counted before the target's pool is sized, and its own
pool, of as many blocks as the target's, shares what remains block for block. The KV pool gets
the rest, capped where every slot already holds a full-length request. The arithmetic is a
pure function, tested on CPU; the measuring needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

GIB = 1 << 30
INT_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8}
"""Bytes an element of a safetensors integer type: they load as they are stored (packed INT4 too)."""


def graph_logits_bytes(max_num_seqs: int, width: int, vocab_size: int) -> int:
    """The step graphs' float32 logits buffer: a row per token of the widest captured step
    (engine.cuda_graphs; ``width`` tokens a row)."""
    return max_num_seqs * width * vocab_size * 4


@dataclass(frozen=True)
class DraftFootprint:
    """What a drafter will hold on the target's GPU, known before either is loaded."""

    weights_bytes: int
    """Its checkpoint's tensors at the dtype it runs in (``checkpoint_bytes``)."""
    block_bytes: int
    """One block of its KV pool across its layers: the pool has as many blocks as the target's."""
    gather_bytes: int = 0
    """Its attention backend's step buffers (``AttentionBackend.scratch_bytes``)."""
    graphs: bool = False
    """It captures decode graphs. Their pool is bounded by the target's largest-step peak (a
    drafter is smaller than its target and captures steps of a few tokens a row): the budget counts it
    again, with the graphs' logits buffer (``logits_bytes``)."""
    logits_bytes: int = 0


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
    draft: DraftFootprint | None = None
    """The drafter beside the target, if any."""

    @property
    def allowed_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def draft_bytes(self) -> int:
        """The drafter's weights, step buffers and graph pool."""
        if self.draft is None:
            return 0
        d = self.draft
        return d.weights_bytes + d.gather_bytes + (self.activation_bytes + d.logits_bytes if d.graphs else 0)

    @property
    def kv_bytes(self) -> int:
        """What the KV pools get: the target's, and the drafter's beside it."""
        return (self.allowed_bytes - self.weights_bytes - self.activation_bytes - self.graph_pool_bytes
                - self.gather_bytes - self.other_bytes - self.draft_bytes)

    def num_blocks(self, ceiling: int) -> int:
        """KV blocks that fit, at most ``ceiling``; ValueError naming the option when under 2."""
        per_block = self.block_bytes + (0 if self.draft is None else self.draft.block_bytes)
        blocks = min(max(self.kv_bytes, 0) // per_block, ceiling)
        if blocks < 2:
            raise ValueError(f"gpu_memory_utilization {self.utilization} leaves no room for a KV pool: "
                             f"{self.describe()}; raise gpu_memory_utilization, lower max_num_batched_tokens, "
                             f"max_num_seqs or max_model_len, or set enforce_eager")
        return blocks

    def describe(self) -> str:
        parts = [("allowed", self.allowed_bytes), ("weights", self.weights_bytes),
                 ("activations", self.activation_bytes), ("graphs", self.graph_pool_bytes),
                 ("gather", self.gather_bytes), ("other", self.other_bytes), ("KV", max(self.kv_bytes, 0))]
        if self.draft is not None:
            parts.insert(-1, ("drafter", self.draft_bytes))
        return ", ".join(f"{name} {b / GIB:.2f} GiB" for name, b in parts)


def checkpoint_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes of a safetensors checkpoint's tensors once loaded, floating ones in ``dtype``, read from
    the files' headers. A quantized checkpoint loads smaller than this: an upper bound then."""
    from safetensors import safe_open

    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numel = 1
                for n in piece.get_shape():
                    numel *= n
                kind = piece.get_dtype()
                total += numel * (size if kind.startswith(("F", "BF")) else INT_BYTES.get(kind, 8))
    return total


def max_context_tokens(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Most context tokens one step can read: every slot at full length, rounded to blocks."""
    return max_num_seqs * -(-max_model_len // block_size) * block_size


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
