"""Tensor-parallel group: who this process is among the ranks of one replica.

At world size 1 every collective is the identity, so the TP-aware layers cost nothing.
With more ranks, torch.distributed carries the collectives: NCCL on CUDA (the ranks of a
replica share NVLink), gloo on CPU so the same code is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    world_size: int = 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        torch.distributed.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's even share of ``total``; uneven splits are a config error."""
        if total % self.world_size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.world_size})")
        return total // self.world_size


def init_parallel_group(rank: int, world_size: int, init_method: str | None = None,
                        backend: str | None = None) -> ParallelGroup:
    """Join (or create) the process group of one replica's TP ranks."""
    if world_size > 1 and not torch.distributed.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return ParallelGroup(rank=rank, world_size=world_size)
