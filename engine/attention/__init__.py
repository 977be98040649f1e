"""Attention backends, chosen once at start-up from a registry of lazy factories."""

from __future__ import annotations

import importlib.util
import logging

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def _torch_backend():
    from engine.attention.torch_ref import TorchAttentionBackend
    return TorchAttentionBackend


def _flash_backend():
    from engine.attention.flash import FlashAttentionBackend
    return FlashAttentionBackend


BACKENDS = {"torch": _torch_backend, "flash": _flash_backend}


def resolve_backend_name(name: str, device: torch.device, block_size: int) -> str:
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {['auto', *BACKENDS]}, got {name!r}")
        if name == "flash" and device.type != "cuda":
            raise ValueError("attention_backend 'flash' needs a CUDA device")
        return name
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        if block_size % 256 == 0:
            return "flash"
        logger.warning("flash-attn is installed but block_size %d is not a multiple of 256; "
                       "using the torch attention backend", block_size)
    return "torch"


def create_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int) -> AttentionBackend:
    resolved = resolve_backend_name(name, device, block_size)
    logger.info("attention backend: %s (asked: %s, device: %s)", resolved, name, device)
    return BACKENDS[resolved]()(num_heads, num_kv_heads, head_dim, block_size)


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "create_backend", "resolve_backend_name"]
