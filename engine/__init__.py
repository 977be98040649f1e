"""slotserve's inference engine: continuous batching over a paged KV cache.

Never imports ray. ``LLM`` runs offline batches; ``AsyncEngine`` serves (step loop on
its own thread, asyncio streams); ``LLMEngine`` is the synchronous core both wrap.
"""

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, ModelLoadError
from engine.outputs import CompletionOutput, EngineStats, RequestOutput, RequestTiming, StreamOutput
from engine.sampling import SamplingParams

_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.engine",
    "AsyncEngine": "engine.async_engine",
}


def __getattr__(name: str):
    # torch-heavy modules load on first use, so config/sampling stay cheap to import.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "AsyncEngine", "CacheConfig", "CompletionOutput", "EngineConfig", "EngineDeadError",
    "EngineOverloadedError", "EngineStats", "InvalidRequestError", "LLM", "LLMEngine", "ModelConfig",
    "ModelLoadError", "ParallelConfig", "RequestOutput", "RequestTiming", "SamplingParams",
    "SchedulerConfig", "StreamOutput",
]
