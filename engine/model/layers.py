"""Tensor-parallel-aware building blocks.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies this
rank's slice of a checkpoint tensor into it, so the checkpoint loader only routes names.
Column-parallel layers split output features (no communication); row-parallel layers split
input features and all-reduce their output; the vocabulary is split across ranks for the
embedding and the LM head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import ParallelGroup


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _check_full(loaded: torch.Tensor, dim: int, expected: int, name: str) -> None:
    """The checkpoint holds the unsharded tensor: its split dimension must be the full size."""
    if loaded.shape[dim] != expected:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}: size "
                         f"{loaded.shape[dim]} on dim {dim}, expected {expected} (does config.json match the weights?)")


def _attach(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = _attach(nn.Parameter(torch.empty(out_features, in_features), requires_grad=False),
                              self.weight_loader)
        self.bias = (_attach(nn.Parameter(torch.empty(out_features), requires_grad=False), self.weight_loader)
                     if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup) -> None:
        super().__init__(in_features, group.shard(out_features, "output features"), bias, group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _check_full(loaded, 0, size * self.group.world_size, type(self).__name__)
        _copy_checked(param, loaded.narrow(0, self.group.rank * size, size), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate and up of the MLP)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, group: ParallelGroup) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        ws, rank = self.group.world_size, self.group.rank
        offset = sum(self.out_sizes[:shard_id]) // ws
        size = self.out_sizes[shard_id] // ws
        _check_full(loaded, 0, self.out_sizes[shard_id], f"{type(self).__name__}[{shard_id}]")
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size),
                      f"{type(self).__name__}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks (KV heads replicated if fewer)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 group: ParallelGroup) -> None:
        ws = group.world_size
        self.head_dim = head_dim
        self.local_heads = group.shard(num_heads, "num_attention_heads")
        # With fewer KV heads than ranks, each rank keeps a replica of one KV head.
        self.kv_replicas = max(1, ws // num_kv_heads)
        self.local_kv_heads = max(1, num_kv_heads // ws)
        if num_kv_heads >= ws and num_kv_heads % ws:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) is not divisible by "
                             f"tensor_parallel_size ({ws})")
        out = (self.local_heads + 2 * self.local_kv_heads) * head_dim
        LinearBase.__init__(self, hidden, out, bias, group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        d, rank = self.head_dim, self.group.rank
        q_size, kv_size = self.local_heads * d, self.local_kv_heads * d
        _check_full(loaded, 0, (self.local_heads * self.group.world_size if shard_id == "q"
                                else self.local_kv_heads * self.group.world_size // self.kv_replicas) * d,
                    f"QKVParallelLinear[{shard_id}]")
        if shard_id == "q":
            dst, src = param.data.narrow(0, 0, q_size), loaded.narrow(0, rank * q_size, q_size)
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            kv_rank = rank // self.kv_replicas
            dst, src = param.data.narrow(0, offset, kv_size), loaded.narrow(0, kv_rank * kv_size, kv_size)
        _copy_checked(dst, src, f"QKVParallelLinear[{shard_id}]")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup) -> None:
        super().__init__(group.shard(in_features, "input features"), out_features, bias, group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            _copy_checked(param, loaded, "RowParallelLinear.bias")
            return
        size = param.shape[1]
        _check_full(loaded, 1, size * self.group.world_size, "RowParallelLinear")
        _copy_checked(param, loaded.narrow(1, self.group.rank * size, size), "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, group: ParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.shard_size = math.ceil(vocab_size / group.world_size)
        self.start = group.rank * self.shard_size
        self.weight = _attach(nn.Parameter(torch.empty(self.shard_size, hidden), requires_grad=False),
                              self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, config says vocab_size {self.vocab_size}")
        part = loaded[self.start:self.start + self.shard_size]
        param.data.zero_()
        _copy_checked(param.data[:part.shape[0]], part, type(self).__name__)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice, gathered to the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.group.world_size > 1:
            logits = self.group.all_gather_last_dim(logits)
        return logits[..., :self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _attach(nn.Parameter(torch.ones(size), requires_grad=False),
                              lambda p, w, s=None: _copy_checked(p, w, "RMSNorm"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
