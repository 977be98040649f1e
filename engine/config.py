"""Engine configuration: frozen dataclasses, built from flat keyword options.

Every option has one home (model, cache, scheduler, parallel). ``EngineConfig.from_options``
takes the flat, vLLM-shaped keywords users know (``max_num_seqs=...``, ``block_size=...``)
and rejects unknown ones by name instead of silently dropping them.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from engine.validation import Bool, Float, Int, Str, validated


CODE_CACHES = ("kernels", "inductor")
"""Caches of code that is loaded and run (the CPU kernel library, inductor's compiled graphs): a
process runs whatever it finds there, so where several machines share ``$SLOTSERVE_CACHE`` (a
Kubernetes volume) these stay in ``$SLOTSERVE_CODE_CACHE``, each machine's own."""


def cache_dir(kind: str) -> Path:
    """``$SLOTSERVE_CACHE/<kind>``, default ``~/.cache/slotserve/<kind>``: what slotserve builds once
    per machine (converted models, CPU kernels, compiled graphs). The ``CODE_CACHES`` go to
    ``$SLOTSERVE_CODE_CACHE/<kind>`` where that is set."""
    code_root = os.environ.get("SLOTSERVE_CODE_CACHE") if kind in CODE_CACHES else None
    root = code_root or os.environ.get("SLOTSERVE_CACHE")
    return (Path(root) if root else Path("~/.cache/slotserve")).expanduser() / kind


SCHEDULING_MODES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8")
QUANTIZATIONS = ("gguf", "int8", "fp8", "int4", "awq", "gptq")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "varlen", "flash", "fa3", "triton")


@validated()
class ModelConfig:
    model: Str = Field(min_length=1)
    """A local HF model directory, or a built-in name such as ``smollm2-135m`` (see engine.models_hub)."""
    dtype: Literal[DTYPES] = "auto"
    """``auto``: bfloat16 on CUDA and on CPUs with bfloat16 dot products (AVX-512 BF16, AMX), else
    float32. Logits, softmax and sampling are float32 whatever the dtype."""
    device: Str = "auto"
    """``auto``: cuda if available, else cpu."""
    max_model_len: Int | None = Field(None, gt=0)
    """Longest prompt + output; defaults to the model's ``max_position_embeddings``."""
    seed: Int = Field(0, ge=0)
    """Seed for requests that do not bring their own."""
    quantization: Literal[QUANTIZATIONS] | None = None
    """Fewer bytes read a step. CPU: ``gguf``: linear layers, the LM head and the embedding multiply the
    GGUF file's blocks in place instead of de-quantized weights (engine.model.quant). The file is
    ``gguf_file``, else the built-in model's own, else the one ``*.gguf`` in the model directory.
    ``int8``: the checkpoint's weights rounded at load to int8 with a scale per 32 (engine.model.int8).
    GPU (engine.model.gpu_quant): FP8, AWQ and GPTQ checkpoints are recognised by their config.json
    (``fp8``, ``awq``, ``gptq`` may name them); on a dense checkpoint ``fp8`` rounds the decoder's linear
    layers to e4m3 with a scale per output channel and ``int4`` to 4 bits with a scale and zero point
    per 128 inputs."""
    gguf_file: Str | None = Field(None, min_length=1)
    """The GGUF file of the same model as ``model`` for ``quantization: gguf``."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if re.fullmatch(r"auto|cpu|cuda(:\d+)?", device) is None:
            raise ValueError("must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return device


@validated()
class CacheConfig:
    block_size: Int = Field(16, ge=1, le=1024)
    """Tokens per KV block. Larger blocks (32-64) mean fewer gathers on CPU."""
    num_kv_blocks: Int | None = Field(None, ge=2)
    """Size of the block pool. None: derived from ``kv_cache_memory_gb`` (or a default)."""
    kv_cache_memory_gb: Float | None = Field(None, gt=0)
    """Memory budget for the pool when ``num_kv_blocks`` is not given."""
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = "auto"
    """``auto``: K/V in the model's dtype. ``int8``: quantized with a float32 scale per token and head,
    on the ``cpu`` attention backend (AVX-512 VNNI, ``block_size`` a multiple of 16): about half the
    bytes of bfloat16, so twice the tokens in one memory budget and decode steps that read half as
    much (vLLM's ``--kv-cache-dtype fp8`` is its 8-bit counterpart, with a scale per layer)."""
    enable_prefix_caching: Bool = True
    gpu_memory_utilization: Float = Field(0.90, gt=0, le=1)
    """On CUDA without ``num_kv_blocks``/``kv_cache_memory_gb``: the share of the GPU's memory
    this engine may use (weights, activations, CUDA graphs, buffers); the KV pool gets the rest."""


@validated()
class SchedulerConfig:
    max_num_seqs: Int = Field(32, ge=1, le=4096)
    """Slots: requests running at once."""
    max_num_batched_tokens: Int = Field(2048, ge=1)
    """Token budget of one step (decodes + prefill chunks)."""
    max_waiting: Int = Field(1024, ge=0)
    """Requests that may wait for a slot; beyond it submit raises EngineOverloadedError. 0: no
    queue, a request is taken only when a slot is free for it."""
    enable_chunked_prefill: Bool = True
    scheduling: Literal[SCHEDULING_MODES] = "continuous"
    """``continuous`` (join/leave every step) or ``static`` (fixed batches, the straw man)."""

    @field_validator("max_num_batched_tokens")
    @classmethod
    def _room_for_every_slot(cls, value: int, info: ValidationInfo) -> int:
        slots = info.data.get("max_num_seqs")
        if slots is not None and value < slots:
            raise ValueError(f"must be >= max_num_seqs ({slots})")
        return value


@validated()
class ParallelConfig:
    tensor_parallel_size: Int = Field(1, ge=1)
    """Devices of one node this engine spans (engine.tp): rank 0 schedules and samples."""
    distributed_timeout_s: Float = Field(60.0, gt=0)
    """Longest wait of a collective between ranks: a hung rank fails the engine after this."""


ADAPTER_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
"""What an adapter may be called: it travels as an OpenAI ``model`` and in metric labels."""


@validated()
class LoRAConfig:
    adapters: dict[Str, Str] = field(default_factory=dict)
    """Adapters served from the start: name -> local PEFT directory (``adapter_config.json`` and
    ``adapter_model.safetensors``). More can be loaded at run time (``LLMEngine.load_lora``)."""
    max_loras: Int = Field(4, ge=1, le=256)
    """Adapter slots on the device: a step mixes requests of at most this many adapters."""
    max_lora_rank: Int = Field(16, ge=1, le=1024)
    """Largest rank accepted; every slot is sized for it."""
    max_cpu_loras: Int | None = Field(None, ge=1)
    """Adapters whose weights stay in host memory (LRU) once read, so a slot reloads without the
    disk. None: ``max_loras``."""

    @field_validator("adapters")
    @classmethod
    def _names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name in adapters:
            if re.fullmatch(ADAPTER_NAME, name) is None:
                raise ValueError(f"adapter name {name!r} must match {ADAPTER_NAME}")
        return adapters


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")


@validated()
class SpeculativeConfig:
    """Speculative decoding (engine.spec_decode), vLLM's ``speculative_config`` names: drafts of up to
    ``num_speculative_tokens`` tokens verified in the same step as the rest of the batch. Greedy and
    sampled requests get exactly the tokens they would get without it."""

    method: Literal[SPECULATIVE_METHODS]
    """``ngram``: prompt lookup, the tokens that followed the latest earlier occurrence of the
    sequence's last n-gram (no draft model). ``draft_model``: the greedy tokens of ``model``, a
    smaller model with the target's tokenizer, run in the same replica (engine.spec_draft).
    ``eagle3``: the greedy tokens of ``model``, an EAGLE-3 head trained for the target, which reads
    the target's hidden states (engine.spec_eagle)."""
    model: Str | None = Field(None, min_length=1)
    """The draft model or the EAGLE-3 head: a local HF directory or a built-in name, as ``model.model``."""
    quantization: Literal[QUANTIZATIONS] | None = None
    """The draft model's weights, as ``model.quantization`` (None: its dtype, de-quantized)."""
    draft_tensor_parallel_size: Int = Field(1, ge=1, le=1)
    """The draft model or head runs on the target's first device, whole, also under tensor
    parallelism: rank 0 proposes, every rank verifies (vLLM's name; only 1 here)."""
    num_speculative_tokens: Int = Field(ge=1, le=16)
    """Draft tokens per step and request (k): a verifying request computes 1 + k tokens."""
    prompt_lookup_min: Int = Field(2, ge=1)
    """Shortest suffix n-gram matched."""
    prompt_lookup_max: Int = Field(5, ge=1, le=64)
    """Longest suffix n-gram matched (longer matches are preferred)."""
    cost_model: Bool = True
    """Draft only where it pays: per request, the positions whose acceptance so far is worth the
    step time they add, by step times measured as the engine runs (engine.spec_cost). False: draft
    all k whenever a draft is found (up to ``disable_by_batch_size``)."""
    disable_by_batch_size: Int | None = Field(8, ge=1)
    """No drafts in a step while more requests than this run: a full batch reads its weights for
    many tokens already, and rejected drafts would cost it compute. None: always draft."""

    @field_validator("prompt_lookup_max")
    @classmethod
    def _window(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("prompt_lookup_min")
        if low is not None and value < low:
            raise ValueError(f"must be >= prompt_lookup_min ({low})")
        return value

    @model_validator(mode="after")
    def _draft_model_named(self) -> "SpeculativeConfig":
        if (self.method in ("draft_model", "eagle3")) != (self.model is not None):
            raise ValueError("model (the draft model, or the EAGLE-3 head) is required with methods 'draft_model' "
                             "and 'eagle3' and only there")
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError("quantization is the draft model's: only with method 'draft_model'")
        return self


@validated()
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig | None = None
    """LoRA adapters on this base model (engine.lora); None: the base model only."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (engine.spec_decode); None: off, one token per request per step."""
    attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    """``auto``: on CUDA the first that runs here of fa3, flash, varlen (FlashAttention kernels) and
    triton; on CPU the ``cpu`` kernel (built on first use); else torch."""
    enforce_eager: Bool = Field(default_factory=lambda: os.environ.get("SLOTSERVE_ENFORCE_EAGER", "") == "1")
    """Run the model eagerly: no compiled model (engine.model.compiled: ~25 s at start with a warm
    inductor cache, ~2.5 min cold, for the default model on 2 cores), no CUDA graphs.
    Default: ``$SLOTSERVE_ENFORCE_EAGER == "1"`` (the test suite sets it, so only the tests of the
    compiled path pay for compiling)."""
    compile_model: Bool = True
    """``torch.compile`` the decoder stack unless ``enforce_eager`` (not with tensor parallelism).
    Off: eager modules, CUDA graphs still captured on GPU (to compare, or where compiling fails)."""
    profile: Bool = False
    """Time the phases of each step (schedule, prepare, forward, sample, output) into stats."""
    num_threads: Int | None = Field(None, ge=1)
    """torch intra-op threads. Set it to the CPUs a replica owns: two replicas each spinning
    OpenMP teams over the same cores slow every op by orders of magnitude."""
    stuck_timeout_s: Float = Field(30.0, gt=0)
    """AsyncEngine health: with work to do and no step finished for this long, the loop is
    stuck. It must exceed the slowest step (the first one warms the model up; without
    chunked prefill one step holds a whole prompt). A hang shows within this plus one
    health-check period; set it near ``health_check_period_s`` where steps are short."""

    @classmethod
    def from_options(cls, model: str, **options: Any) -> "EngineConfig":
        """Build from flat keyword options; unknown keys raise ValueError naming them."""
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                    "parallel": ParallelConfig}
        kwargs: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        top_fields = {"lora", "speculative_config", "attention_backend", "enforce_eager", "compile_model", "profile",
                      "num_threads", "stuck_timeout_s"}
        owners = {f.name: name for name, klass in sections.items() for f in dataclasses.fields(klass)}
        for key, value in options.items():
            if key == "lora" and isinstance(value, dict):
                top[key] = LoRAConfig(**value)
            elif key in top_fields:
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
