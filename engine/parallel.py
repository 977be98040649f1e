"""Tensor-parallel group: who this process is among the ranks of one replica.

At world size 1 every collective is the identity, so the TP-aware layers cost nothing.
With more ranks, torch.distributed carries the collectives on ``device_group``: NCCL on
CUDA (the ranks of a replica share NVLink), gloo on CPU, so the same code is tested
without a GPU. How the ranks are started and fed lives in engine.tp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: whole KV groups (a KV head and the query heads
    that read it), or, with more ranks than KV heads, a replica of one KV head."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    group = num_heads // num_kv_heads
    if world_size <= num_kv_heads:
        # KV groups spread as evenly as they go; the first ranks take one more if uneven.
        base, extra = divmod(num_kv_heads, world_size)
        kv_count = base + (rank < extra)
        kv_start = rank * base + min(rank, extra)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    q_count = num_heads // world_size
    return HeadShard(rank * q_count, q_count, rank // (world_size // num_kv_heads), 1)


def check_tp_shapes(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                    world_size: int) -> None:
    """Raise ValueError naming the config.json field that cannot be split ``world_size`` ways."""
    def fail(name: str, value: int, why: str) -> None:
        raise ValueError(f"{name} ({value}) cannot be split over tensor_parallel_size {world_size}: {why}")

    if num_heads % num_kv_heads:
        fail("num_attention_heads", num_heads, f"not a multiple of num_key_value_heads ({num_kv_heads})")
    if world_size > num_kv_heads:
        if world_size % num_kv_heads:
            fail("num_key_value_heads", num_kv_heads, "with more ranks than KV heads, tensor_parallel_size "
                 "must be a multiple of it (each KV head is replicated on whole ranks)")
        if num_heads % world_size:
            fail("num_attention_heads", num_heads, "not divisible by tensor_parallel_size")
    if intermediate_size % world_size:
        fail("intermediate_size", intermediate_size, "not divisible by tensor_parallel_size")
    if vocab_size % world_size:
        fail("vocab_size", vocab_size, "not divisible by tensor_parallel_size")


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    world_size: int = 1
    device_group: Any = field(default=None, compare=False, repr=False)
    """The process group of the model's collectives (None: torch's default group)."""
    timings: dict[str, float] | None = field(default=None, compare=False, repr=False)
    """When given (profile=True), time spent in collectives accumulates here."""

    def _timed(self, key: str, t0: float) -> None:
        if self.timings is not None:
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        t0 = time.perf_counter()
        torch.distributed.all_reduce(x, group=self.device_group)
        self._timed("tp_all_reduce", t0)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on rank 0; None elsewhere."""
        if self.world_size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=0, group=self.device_group)
        self._timed("tp_gather", t0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's even share of ``total``; uneven splits are a config error."""
        if total % self.world_size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.world_size})")
        return total // self.world_size

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return shard_heads(num_heads, num_kv_heads, self.rank, self.world_size)
