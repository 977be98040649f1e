"""Engine configuration: frozen dataclasses, built from flat keyword options.

Every option has one home (model, cache, scheduler, parallel). ``EngineConfig.from_options``
takes the flat, vLLM-shaped keywords users know (``max_num_seqs=...``, ``block_size=...``)
and rejects unknown ones by name instead of silently dropping them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

SCHEDULING_MODES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "flash")


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(cond: bool, name: str, allowed: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """A local HF model directory, or a built-in name such as ``smollm2-135m`` (see engine.models_hub)."""
    dtype: str = "auto"
    """``auto``: bfloat16 on CUDA, float32 on CPU."""
    device: str = "auto"
    """``auto``: cuda if available, else cpu."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's ``max_position_embeddings``."""
    seed: int = 0
    """Seed for requests that do not bring their own."""

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and bool(self.model), "model", "a non-empty path or model name", self.model)
        _check(self.dtype in DTYPES, "dtype", f"one of {DTYPES}", self.dtype)
        _check(isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
               "device", "'auto', 'cpu', 'cuda' or 'cuda:N'", self.device)
        _check(_int(self.seed) and self.seed >= 0, "seed", "a non-negative integer", self.seed)
        _check(self.max_model_len is None or (_int(self.max_model_len) and self.max_model_len > 0),
               "max_model_len", "a positive integer or None", self.max_model_len)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block. Larger blocks (32-64) mean fewer gathers on CPU."""
    num_kv_blocks: int | None = None
    """Size of the block pool. None: derived from ``kv_cache_memory_gb`` (or a default)."""
    kv_cache_memory_gb: float | None = None
    """Memory budget for the pool when ``num_kv_blocks`` is not given."""
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check(_int(self.block_size) and 1 <= self.block_size <= 1024, "block_size",
               "an integer in [1, 1024]", self.block_size)
        _check(self.num_kv_blocks is None or (_int(self.num_kv_blocks) and self.num_kv_blocks >= 2),
               "num_kv_blocks", "an integer >= 2 or None", self.num_kv_blocks)
        _check(self.kv_cache_memory_gb is None or (isinstance(self.kv_cache_memory_gb, (int, float))
                                                   and not isinstance(self.kv_cache_memory_gb, bool)
                                                   and math.isfinite(self.kv_cache_memory_gb)
                                                   and self.kv_cache_memory_gb > 0),
               "kv_cache_memory_gb", "a positive number or None", self.kv_cache_memory_gb)
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "a bool",
               self.enable_prefix_caching)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    """Slots: requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes + prefill chunks)."""
    max_waiting: int = 1024
    """Bounded waiting queue; beyond it submit raises EngineOverloadedError."""
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"
    """``continuous`` (join/leave every step) or ``static`` (fixed batches, the straw man)."""

    def __post_init__(self) -> None:
        _check(_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 4096, "max_num_seqs",
               "an integer in [1, 4096]", self.max_num_seqs)
        _check(_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
               "max_num_batched_tokens", "a positive integer", self.max_num_batched_tokens)
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               f">= max_num_seqs ({self.max_num_seqs})", self.max_num_batched_tokens)
        _check(_int(self.max_waiting) and self.max_waiting >= 0, "max_waiting",
               "a non-negative integer", self.max_waiting)
        _check(isinstance(self.enable_chunked_prefill, bool), "enable_chunked_prefill", "a bool",
               self.enable_chunked_prefill)
        _check(self.scheduling in SCHEDULING_MODES, "scheduling", f"one of {SCHEDULING_MODES}", self.scheduling)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Devices of one node this engine spans (engine.tp): rank 0 schedules and samples."""
    distributed_timeout_s: float = 60.0
    """Longest wait of a collective between ranks: a hung rank fails the engine after this."""

    def __post_init__(self) -> None:
        _check(_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
               "tensor_parallel_size", "a positive integer", self.tensor_parallel_size)
        _check(isinstance(self.distributed_timeout_s, (int, float)) and not isinstance(self.distributed_timeout_s, bool)
               and math.isfinite(self.distributed_timeout_s) and self.distributed_timeout_s > 0,
               "distributed_timeout_s", "a finite number > 0", self.distributed_timeout_s)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention_backend: str = "auto"
    """``auto``: flash on CUDA with flash-attn installed, else the torch reference."""
    profile: bool = False
    """Time the phases of each step (schedule, prepare, forward, sample, output) into stats."""
    num_threads: int | None = None
    """torch intra-op threads. Set it to the CPUs a replica owns: two replicas each spinning
    OpenMP teams over the same cores slow every op by orders of magnitude."""
    stuck_timeout_s: float = 30.0
    """AsyncEngine health: with work to do and no step finished for this long, the loop is
    stuck. It must exceed the slowest step (the first one warms the model up; without
    chunked prefill one step holds a whole prompt). A hang shows within this plus one
    health-check period; set it near ``health_check_period_s`` where steps are short."""

    def __post_init__(self) -> None:
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               f"one of {ATTENTION_BACKENDS}", self.attention_backend)
        _check(self.num_threads is None or (_int(self.num_threads) and self.num_threads >= 1),
               "num_threads", "a positive integer or None", self.num_threads)
        _check(isinstance(self.stuck_timeout_s, (int, float)) and not isinstance(self.stuck_timeout_s, bool)
               and math.isfinite(self.stuck_timeout_s) and self.stuck_timeout_s > 0,
               "stuck_timeout_s", "a finite number > 0", self.stuck_timeout_s)

    @classmethod
    def from_options(cls, model: str, **options: Any) -> "EngineConfig":
        """Build from flat keyword options; unknown keys raise ValueError naming them."""
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                    "parallel": ParallelConfig}
        kwargs: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        top_fields = {"attention_backend", "profile", "num_threads", "stuck_timeout_s"}
        owners = {f.name: name for name, klass in sections.items() for f in dataclasses.fields(klass)}
        for key, value in options.items():
            if key in top_fields:
                top[key] = value
            elif key in owners and key != "model":
                kwargs[owners[key]][key] = value
            else:
                allowed = sorted((set(owners) - {"model"}) | top_fields)
                raise ValueError(f"unknown engine option {key!r}; allowed: {', '.join(allowed)}")
        return cls(model=ModelConfig(model=model, **kwargs["model"]),
                   cache=CacheConfig(**kwargs["cache"]),
                   scheduler=SchedulerConfig(**kwargs["scheduler"]),
                   parallel=ParallelConfig(**kwargs["parallel"]), **top)
