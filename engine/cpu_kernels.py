"""The engine's C++ CPU kernels (engine/csrc): paged attention, K/V writes (int8 too), AMX linear layers,
linear layers over GGUF block-quantized weights.

The library is compiled with ``-march=native`` by ``torch.utils.cpp_extension`` into
``$SLOTSERVE_CACHE/kernels`` (default ``~/.cache/slotserve/kernels``) the first time a process
needs it; the folder name hashes the sources, torch's version, the compiler flags and the
CPU's instruction sets, so a stale or foreign build is never loaded. Concurrent builds (Ray
replicas, tensor-parallel ranks) wait on one lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import time
from functools import cache
from pathlib import Path

import torch

from engine.config import cache_dir
from engine.cpu_features import cpu_flags, kernel_isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("paged_attention.cpp", "kv_write.cpp", "attention_step.cpp", "amx_linear.cpp",
                                           "gguf_linear.cpp", "gguf_linear_int8.cpp", "gguf_layers.cpp"))
HEADERS = tuple(CSRC / name for name in ("checks.h", "kv_layout.h", "score_int8.h", "values_int8.h", "vec.h",
                                           "gguf_blocks.h", "gguf_int8_avx2.h"))
# -ffast-math at compile time only: it lets the compiler vectorize reductions and expf; linked
# without it, the library does not switch the process to flush-to-zero.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def _cpu_flags() -> str:
    return " ".join(sorted(cpu_flags()))


def kernel_dir() -> Path:
    return cache_dir("kernels")


def kernel_name() -> str:
    digest = hashlib.sha256()
    sources = (source.read_bytes() for source in SOURCES + HEADERS)
    for part in (*sources, torch.__version__.encode(), " ".join(CFLAGS + LDFLAGS).encode(),
                 _cpu_flags().encode()):
        digest.update(part)
    return f"slotserve_cpu_kernels_{digest.hexdigest()[:16]}"


def compiler_problem() -> str | None:
    """Why the library cannot be built here, or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH; install g++ or set CXX)"
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


@cache
def load_kernel():
    """``torch.ops.slotserve_cpu`` (``paged_attention``, ``write_kv``, ``amx_linear``), building the
    library first if needed."""
    from torch.utils.cpp_extension import load
    name = kernel_name()
    build = kernel_dir() / name
    fresh = not (build / f"{name}.so").exists()
    if fresh:
        logger.info("building the CPU kernel library for %s (once per machine, ~15 s on 2 cores)", kernel_isa())
    build.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(build / "build.flock", "a") as held:
        # torch's own lock is a file its builder deletes when done: one killed mid-build leaves it,
        # and every later load would wait forever. An OS lock dies with its holder, so whoever
        # holds this one is the only builder, and a torch lock file it finds is stale.
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=list(CFLAGS),
             extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False, verbose=False)
    logger.info("CPU kernel library %s in %.1f s (%s)", "built" if fresh else "loaded",
                time.perf_counter() - t0, build)
    return torch.ops.slotserve_cpu


@cache
def amx_linear_problem() -> str | None:
    """Why bfloat16 linear layers cannot run on AMX tiles here, or None."""
    missing = {"amx_tile", "amx_bf16"} - cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    problem = compiler_problem()
    if problem is not None:
        return problem
    if not load_kernel().amx_ready():
        return "the kernel refused the process AMX tile state (Linux >= 5.16 grants it)"
    return None
