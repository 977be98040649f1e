"""What this CPU can do, read once from the kernel's CPU flags (Linux) or torch's capability."""

from __future__ import annotations

import os
import platform
from functools import cache

import torch

FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""Instruction sets with bfloat16 dot products: there bfloat16 halves the bytes read per
token at full speed; without them bfloat16 is emulated and several times slower than float32."""


@cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset({torch.backends.cpu.get_cpu_capability().lower()})


def fast_bf16() -> bool:
    return any(flag in cpu_flags() for flag in FAST_BF16_FLAGS)


KERNEL_ISAS = (("amx", ("amx_tile", "amx_bf16")), ("avx512-vnni", ("avx512f", "avx512_vnni")),
               ("avx512", ("avx512f",)), ("avx2", ("avx2", "fma")))
"""The C++ kernels' (engine/csrc, built with -march=native) widest path the flags allow, widest first:
AMX tiles for bfloat16 linear layers, AVX-512 VNNI for int8 KV caches, 16 or 8 float lanes."""


def kernel_isa() -> str:
    flags = cpu_flags()
    return next((name for name, needs in KERNEL_ISAS if all(flag in flags for flag in needs)), "scalar")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_cpu() -> dict:
    """The host kind every figure and log traces to: the CPU, the kernels' ISA, torch's, and the
    dtype ``auto`` picks on CPU, with why."""
    bf16 = [flag for flag in FAST_BF16_FLAGS if flag in cpu_flags()]
    why = (f"{', '.join(bf16)}: bfloat16 dot products in hardware" if bf16 else
           f"no {' or '.join(FAST_BF16_FLAGS)}: bfloat16 would be emulated, several times slower")
    return {"cpu": _cpu_model(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "kernel_isa": kernel_isa(),
            "torch_isa": torch.backends.cpu.get_cpu_capability().lower(),
            "cpu_default_dtype": "bfloat16" if bf16 else "float32", "dtype_why": why}


def describe_host() -> str:
    """``host_cpu`` in a line, for the logs."""
    h = host_cpu()
    return (f"{h['cpu']}, {h['cores']} cores; C++ kernels: {h['kernel_isa']}, torch: {h['torch_isa']}; "
            f"dtype auto on CPU: {h['cpu_default_dtype']} ({h['dtype_why']})")
