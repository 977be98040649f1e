"""Rotary position embeddings (rotate-half convention), incl. linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.arch import ModelArch


def _inv_freq(arch: ModelArch) -> torch.Tensor:
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    params = dict(arch.rope_scaling)
    kind = arch.rope_type
    if kind == "linear":
        inv = inv / float(params["factor"])
    elif kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # Long wavelengths are scaled down by `factor`, short ones kept, the band between blended.
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_len / low, inv / factor, inv)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(medium, blended, inv)
    return inv.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, _inv_freq(arch))
        # cos/sin tables indexed by position: one gather per step instead of trig per token.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
