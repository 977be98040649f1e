"""What this CPU can do, read once from the kernel's CPU flags (Linux) or torch's capability."""

from __future__ import annotations

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
