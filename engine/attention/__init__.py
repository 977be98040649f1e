"""Attention backends, chosen once at start-up from a registry of lazy factories.

- ``torch``: the reference, any device and dtype (engine.attention.torch_ref).
- ``cpu``: a C++ kernel that reads the paged cache in place, built on first use (engine.attention.cpu).
- ``varlen``: FlashAttention-2 as shipped in torch (``torch.nn.attention.varlen``), paged in
  place; block size a multiple of 256.
- ``flash``: the flash-attn 2 package, paged in place; block size a multiple of 256.
- ``fa3``: FlashAttention-3 (``flash_attn_interface``), paged in place, any block size; Hopper.
- ``triton``: a Triton kernel, paged in place, any block size and dtype (CUDA; its source also
  runs on CPU under ``TRITON_INTERPRET=1``, which is how CI tests it).

Every backend reads K/V blocks in place: none gathers a request's context per layer.
``auto`` takes, on CUDA, the first of fa3, flash, varlen, triton that can run on the dtype
and block size (FlashAttention kernels are float16/bfloat16 only); on CPU, the ``cpu`` kernel where a C++
compiler can build it; else torch. The choice and why are logged.

``kv_cache_dtype="int8"`` (K/V quantized per token and head, engine/csrc/kv_layout.h) is read by
the ``cpu`` backend only; asking for it elsewhere is an error that says so.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.config import KV_CACHE_DTYPES

logger = logging.getLogger(__name__)
HALF = (torch.float16, torch.bfloat16)


def _torch_backend():
    from engine.attention.torch_ref import TorchAttentionBackend
    return TorchAttentionBackend


def _cpu_backend():
    from engine.attention.cpu import CpuAttentionBackend
    return CpuAttentionBackend


def _varlen_backend():
    from engine.attention.varlen import VarlenAttentionBackend
    return VarlenAttentionBackend


def _triton_backend():
    from engine.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend


def _flash_backend():
    from engine.attention.flash import FlashAttentionBackend
    return FlashAttentionBackend


def _fa3_backend():
    from engine.attention.fa3 import FA3AttentionBackend
    return FA3AttentionBackend


@dataclass(frozen=True)
class BackendSpec:
    factory: Callable[[], type]
    needs: str
    """What it takes to run, for the error when it cannot."""


BACKENDS = {
    "torch": BackendSpec(_torch_backend, "nothing beyond torch (any device, any dtype, any block_size)"),
    "cpu": BackendSpec(_cpu_backend, "a CPU device, a C++ compiler and ninja (it builds on first use); "
                                     "float32/bfloat16/float16, head_dim a multiple of 16, any block_size"),
    "varlen": BackendSpec(_varlen_backend, "a CUDA build of torch whose torch.nn.attention.varlen.varlen_attn "
                                           "takes block_table, a CUDA device, float16/bfloat16, head_dim a "
                                           "multiple of 8 up to 256 and block_size a multiple of 256"),
    "triton": BackendSpec(_triton_backend, "Triton (it comes with CUDA builds of torch; pip install triton), a CUDA "
                                           "device and head_dim up to 256; any dtype and block_size"),
    "flash": BackendSpec(_flash_backend, "the flash-attn package (pip install 'slotserve[gpu]'), a CUDA device, "
                                         "float16/bfloat16 and block_size a multiple of 256"),
    "fa3": BackendSpec(_fa3_backend, "FlashAttention-3 (module flash_attn_interface, built from flash-attention's "
                                     "hopper/ folder), a Hopper GPU (compute capability 9.x) and float16/bfloat16; "
                                     "any block_size"),
}
AUTO_ORDER = ("fa3", "flash", "varlen", "triton")
WHY = {
    "fa3": "FlashAttention-3 reads the paged cache in place at any block size",
    "flash": "flash-attn 2 reads the paged cache in place (block_size a multiple of 256)",
    "varlen": "torch's FlashAttention-2 varlen kernel reads the paged cache in place (block_size a multiple of 256)",
    "triton": "the Triton kernel reads the paged cache in place at any block size",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def backend_problem(name: str, device: torch.device, dtype: torch.dtype, block_size: int,
                    head_dim: int) -> str | None:
    """Why backend ``name`` cannot run here, or None when it can."""
    if name == "torch":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"it runs on the CPU, not {device.type}"
        if head_dim % 16:
            return f"head_dim must be a multiple of 16, got {head_dim}"
        from engine.cpu_kernels import compiler_problem
        return compiler_problem()
    if device.type != "cuda":
        return f"it needs a CUDA device, not {device.type}"
    if name == "triton":
        if not _installed("triton"):
            return "Triton is not installed"
        return None if head_dim <= 256 else f"head_dim must be at most 256, got {head_dim}"
    if dtype not in HALF:
        return f"FlashAttention kernels take float16/bfloat16, not {str(dtype).removeprefix('torch.')}"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim must be a multiple of 8 up to 256, got {head_dim}"
    if name == "varlen":
        from engine.attention.varlen import pages_in_place, torch_varlen_kernel
        kernel = torch_varlen_kernel()
        if kernel is None:
            return f"torch {torch.__version__} has no varlen_attn"
        return None if pages_in_place(kernel, block_size, True) else (
            f"block_size must be a multiple of 256 and this torch's varlen_attn must take block_table, "
            f"got block_size {block_size}")
    if name == "flash":
        if not _installed("flash_attn"):
            return "the flash-attn package is not installed"
        if block_size % 256:
            return f"block_size must be a multiple of 256 for flash-attn's paged KV, got {block_size}"
        return None
    if name == "fa3":
        if not _installed("flash_attn_interface"):
            return "FlashAttention-3 (flash_attn_interface) is not installed"
        major, minor = torch.cuda.get_device_capability(device)
        return None if major == 9 else f"FlashAttention-3 needs compute capability 9.x, this GPU is {major}.{minor}"
    raise ValueError(f"attention_backend must be one of {['auto', *BACKENDS]}, got {name!r}")


def int8_problem(block_size: int) -> str | None:
    """Why the cpu kernel cannot read an int8 cache here (beyond what it needs anyway), or None."""
    from engine.cpu_features import cpu_flags
    if "avx512_vnni" not in cpu_flags():
        return "the CPU lacks AVX-512 VNNI (int8 dot products)"
    if block_size % 16:
        return f"block_size must be a multiple of 16 (keys are scored 16 at a time), got {block_size}"
    return None


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int,
                    head_dim: int, kv_cache_dtype: str = "auto") -> tuple[str, str]:
    """(backend name, why it was chosen). Raises ValueError when ``name`` cannot run here."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "int8":
        if name not in ("auto", "cpu"):
            raise ValueError(f"kv_cache_dtype 'int8' is read by the cpu attention backend only, not {name!r}")
        problem = backend_problem("cpu", device, dtype, block_size, head_dim) or int8_problem(block_size)
        if problem is not None:
            raise ValueError(f"kv_cache_dtype 'int8' needs the cpu attention backend, which cannot run here: "
                             f"{problem}. It needs {BACKENDS['cpu'].needs}, AVX-512 VNNI and block_size a "
                             f"multiple of 16")
        return "cpu", "reads the int8 paged cache in place"
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {['auto', *BACKENDS]}, got {name!r}")
        problem = backend_problem(name, device, dtype, block_size, head_dim)
        if problem is not None:
            raise ValueError(f"attention_backend {name!r} cannot run here: {problem}. "
                             f"It needs {BACKENDS[name].needs}")
        return name, "asked for"
    if device.type == "cpu":
        problem = backend_problem("cpu", device, dtype, block_size, head_dim)
        if problem is None:
            return "cpu", "reads the paged cache in place"
        return "torch", f"the cpu kernel cannot be built: {problem}"
    if device.type != "cuda":
        return "torch", f"the reference backend on {device.type}"
    skipped = []
    for candidate in AUTO_ORDER:
        problem = backend_problem(candidate, device, dtype, block_size, head_dim)
        if problem is None:
            return candidate, WHY[candidate] + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{candidate}: {problem}")
    return "torch", "no FlashAttention kernel can run: " + "; ".join(skipped)


def create_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, dtype: torch.dtype = torch.float32,
                   kv_cache_dtype: str = "auto", log: bool = True) -> AttentionBackend:
    resolved, why = resolve_backend(name, device, dtype, block_size, head_dim, kv_cache_dtype)
    extra = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {}
    backend = BACKENDS[resolved].factory()(num_heads, num_kv_heads, head_dim, block_size, **extra)
    if log:  # a drafter's footprint builds one only to size its blocks (engine.spec_draft)
        logger.info("attention backend: %s (asked: %s; %s, %s, KV cache %s, block_size %d): %s", resolved, name,
                    device, str(dtype).removeprefix("torch."), kv_cache_dtype, block_size, why)
    return backend


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "KV_CACHE_DTYPES", "backend_problem", "create_backend",
           "resolve_backend"]
