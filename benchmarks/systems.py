"""The systems under comparison: a registry of name -> runner, and the settings they all share.

A runner is ``fn(requests, settings, progress) -> metrics.SystemRun``, named as
``"module:function"`` so it is imported only in the fresh process that runs it. To add a
system, register a ``SystemSpec`` here; the harness, the JSON and the plots pick it up.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass(frozen=True)
class BenchSettings:
    """What every system is held to, so the comparison is fair."""

    model_dir: str
    max_num_seqs: int = 16
    """Slots of the engine = HF static batch size = HF continuous max_requests_per_batch."""
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    """KV block size of the engine = page size of HF continuous batching."""
    num_kv_blocks: int = 1024
    threads: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    """``int8``: slotserve's int8 KV cache, and vLLM's 8-bit one (``fp8``) for the ``vllm`` system; HF
    systems keep theirs in ``dtype``."""
    vllm_python: str | None = None
    """Interpreter of a venv with vLLM, for the ``vllm`` system (benchmarks.vllm_peer)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "threads"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def as_dict(self) -> dict:
        return asdict(self)


def kv_blocks_for(max_seq_len: int, block_size: int, max_num_seqs: int) -> int:
    """Enough blocks for every slot to hold the workload's longest request: nobody is starved of KV."""
    return max_num_seqs * math.ceil(max_seq_len / block_size) + 1


@dataclass(frozen=True)
class SystemSpec:
    name: str
    title: str
    description: str
    runner: str
    """``module:function`` of the runner."""

    def load_runner(self) -> Callable:
        module, _, func = self.runner.partition(":")
        return getattr(importlib.import_module(module), func)


SYSTEMS: dict[str, SystemSpec] = {}


def register_system(spec: SystemSpec) -> None:
    if ":" not in spec.runner:
        raise ValueError(f"runner must be 'module:function', got {spec.runner!r}")
    SYSTEMS[spec.name] = spec


register_system(SystemSpec(
    "continuous", "slotserve, continuous",
    "slotserve LLMEngine driven step by step; requests join and leave the batch every step",
    "benchmarks.engine_systems:run_continuous"))
register_system(SystemSpec(
    "static", "slotserve, static",
    "the same engine with scheduling='static': a batch is admitted only when the previous one has drained",
    "benchmarks.engine_systems:run_static"))
register_system(SystemSpec(
    "hf_generate", "HF generate, padded",
    "transformers model.generate on left-padded static batches in arrival order, each run to its longest request",
    "benchmarks.hf_peers:run_hf_generate"))
register_system(SystemSpec(
    "hf_generate_batch", "HF continuous (paged)",
    "transformers' own continuous batching (manager API: init_continuous_batching / add_request / get_result), "
    "paged cache sized like the engine's",
    "benchmarks.hf_peers:run_hf_generate_batch"))
register_system(SystemSpec(
    "async_engine", "slotserve, AsyncEngine",
    "the continuous system's engine behind AsyncEngine (its step-loop thread and asyncio streams) in the "
    "benchmark's process: what an engine replica runs, without Ray, Serve or a network",
    "benchmarks.engine_systems:run_async_engine"))
register_system(SystemSpec(
    "served", "slotserve, served (gRPC)",
    "the served application on a local Ray: gRPC streaming clients -> Serve's gRPC proxy -> Router ingress -> "
    "engine link -> one EngineReplica with the continuous system's engine options",
    "benchmarks.served_system:run_served"))
register_system(SystemSpec(
    "served_haproxy", "slotserve, via HAProxy",
    "the same application in Ray Serve's HAProxy mode: gRPC streaming clients -> HAProxy (C, one per node, "
    "following Serve's ingress replicas) -> Router ingress replica's own gRPC server -> engine link -> one EngineReplica",
    "benchmarks.served_system:run_served_haproxy"))

register_system(SystemSpec(
    "vllm", "vLLM (CPU build)",
    "vLLM's LLMEngine from its own venv (--vllm-python), stepped like the continuous system: the same "
    "requests, dtype, slots, token budget, block size and threads",
    "benchmarks.vllm_peer:run_vllm"))

BASELINE = "continuous"
DEFAULT_SYSTEMS = ("continuous", "static", "hf_generate", "hf_generate_batch", "served", "served_haproxy")


def parse_systems(text: str | None) -> list[str]:
    if not text:
        return list(DEFAULT_SYSTEMS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ValueError(f"unknown system(s) {unknown or text!r}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))
