"""Model runner: turns a scheduler step into packed tensors, runs the model, samples.

Step inputs are built by engine.attention.metadata (shared by every backend) over a block
table kept on the device (engine.attention.block_table). A step's host work is building a
few small integer arrays; everything it ships to the device goes in non-blocking copies,
and the only wait for the device is reading the sampled token ids. On CUDA, decode-only
steps replay captured graphs (engine.cuda_graphs) and the KV pool is sized from a measured
memory budget (engine.memory).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from engine.attention import create_backend
from engine.attention.block_table import BlockTable
from engine.errors import ModelLoadError
from engine.attention.metadata import build_step_inputs, order_chunks
from engine.config import EngineConfig
from engine.cpu_features import fast_bf16
from engine.cuda_graphs import DecodeGraphs
from engine.memory import (DraftFootprint, MemoryBudget, dummy_prefill, graph_logits_bytes, max_context_tokens,
                           measure_peak, outside_torch_bytes, worst_case_sampling)
from engine.lora import LoRAModel
from engine.model import ModelArch, load_model
from engine.model.compiled import CompiledDecoder
from engine.model.gpu_quant import resolve_scheme
from engine.model.quant_checkpoint import describe_quantized, quantize_dense
from engine.model.layers import AMX_MAX_ROWS, amx_supported, cpu_prepack_supported
from engine.parallel import ParallelGroup
from engine.sampler import PROMPT_ROWS_AT_ONCE, Sampler, SamplingBatch, prompt_logprobs
from engine.scheduler import MAX_SCORED_TOKENS, ScheduledChunk
from engine.spec_verify import draft_rows
from engine.pooling import accumulate
from engine.warm_up import warm_up_steps

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_GB = 2.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and fast_bf16())
        return torch.bfloat16 if fast else torch.float32
    return DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, arch: ModelArch, max_model_len: int,
                 group: ParallelGroup | None = None, device: str | None = None,
                 agree_blocks: Callable[[int, int], int] | None = None,
                 aux_layers: tuple[int, ...] = (), draft: DraftFootprint | None = None,
                 graph_width: int | None = None) -> None:
        """``group``/``device``: this rank's place and device (default: alone, ``config.model.device``).
        ``agree_blocks(blocks, param_bytes)``: with tensor parallelism, the KV pool size every
        rank can hold (each sizes its own from its memory).
        ``aux_layers``: the layers whose input streams each step keeps (``aux_out``, rows ``aux_rows``)
        for an EAGLE-3 head (engine.spec_eagle). ``draft``: what the drafter beside this model will
        hold: its pool, of as many blocks, shares the KV budget; on a GPU its weights count too.
        ``graph_width``: query tokens a row of the widest captured step (default: 1 + k verifying k drafts)."""
        self.config = config
        self.draft = draft
        self._graph_width = graph_width
        self.group = group or ParallelGroup()
        self.device = torch.device(device) if device is not None else resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        heads = self.group.heads(arch.num_heads, arch.num_kv_heads)
        self.backend = create_backend(config.attention_backend, self.device, heads.q_count, heads.kv_count,
                                      arch.head_dim, self.block_size, self.dtype, config.cache.kv_cache_dtype)
        t0 = time.perf_counter()
        scheme = resolve_scheme(model_path, config.model.quantization)
        self.quantization = config.model.quantization if scheme is None else scheme.source
        """How the weights are held: ``none``, ``gguf``, ``int8``, or a GPU scheme's source."""
        self.model = load_model(model_path, arch, self.group, self.backend, self.dtype, self.device, max_model_len,
                                None if scheme is None or scheme.source == "dense" else scheme)
        self.model.aux_layers = aux_layers  # before it is compiled: the graph returns them
        self.whole_embedding: torch.Tensor | None = None
        """Under tensor parallelism, with an EAGLE-3 head: every rank's embedding rows (engine.tp.driver)."""
        self.aux_rows: dict[int, int] = {}
        """Each chunk's first row in the last step's ``model.aux_out``, by ``id(chunk)``."""
        weights = str(self.dtype).removeprefix("torch.")
        if config.model.quantization in ("gguf", "int8") and self.device.type != "cpu":
            raise ModelLoadError(f"quantization {config.model.quantization} runs on CPU (on GPU: fp8, int4, awq, gptq)")
        if scheme is not None:
            if scheme.source == "dense":
                quantize_dense(self.model, scheme.kind, self.device)
                self.quantization = scheme.kind
            weights = describe_quantized(self.model, scheme, weights)
        elif config.model.quantization == "gguf":
            weights = self._attach_gguf(model_path)
        elif config.model.quantization == "int8":
            from engine.model.int8 import attach_int8
            attach_int8(self.model)
            weights = f"int8 blocks of 32 made from {weights}"
        if config.model.quantization in ("gguf", "int8"):
            from engine.model.quant import make_batch_invariant
            if make_batch_invariant(self.model) and hasattr(self.backend, "batch_invariant"):
                self.backend.batch_invariant = True  # the CPU kernel: one arithmetic for every row
        quantized = (b for name, b in self.model.named_buffers()
                     if ".wq." in name or name.rsplit(".", 1)[-1] in ("qweight", "qscale", "qmin"))
        self.param_bytes = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *quantized))
        logger.info("weights loaded in %.1f s: %s, %.0f MiB in %s", time.perf_counter() - t0, model_path.name,
                    self.param_bytes / (1 << 20), weights)
        self.lora: LoRAModel | None = None
        if config.lora is not None:
            lora = config.lora
            self.lora = LoRAModel(self.model, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras or lora.max_loras)
        if cpu_prepack_supported(self.device, self.dtype):
            # Decode steps run about max_num_seqs rows through every linear layer.
            amx = amx_supported(self.device, self.dtype)
            self.model.prepack(config.scheduler.max_num_seqs, amx=amx)
            logger.info("linear layers: oneDNN%s", f", AMX tiles for steps of <= {AMX_MAX_ROWS} rows" if amx else "")
        # Not with tensor parallelism: its ranks all-reduce mid-layer, outside what one graph can trace.
        self.compiled: CompiledDecoder | None = None
        if config.compile_model and not config.enforce_eager and self.group.world_size == 1:
            self.compiled = CompiledDecoder(self.model, self.backend)
        self.decoder: Callable = (self.model if self.compiled is None
                                  else functools.partial(self.compiled, backend=self.backend))
        """What runs the model, called like it: the compiled decoder where there is one, else the modules."""
        self.num_layers = arch.num_layers
        self.vocab_size = arch.vocab_size
        self.sampler = Sampler()
        max_seqs = config.scheduler.max_num_seqs
        self.use_graphs = (self.device.type == "cuda" and not config.enforce_eager and self.group.world_size == 1
                           and self.backend.supports_cuda_graphs)
        self.max_context_tokens = max_context_tokens(max_seqs, max_model_len, self.block_size)
        blocks = self._pool_size()
        self.num_blocks = agree_blocks(blocks, self.param_bytes) if agree_blocks is not None else blocks
        self.scratch_block = self.num_blocks
        """One block past the pool: padding rows of captured steps write there, never a request."""
        self.kv_caches = [self.backend.allocate_cache(self.num_blocks + 1, self.dtype, self.device)
                          for _ in range(arch.num_layers)]
        if self.device.type == "cuda":
            self.backend.reserve(self.max_context_tokens, self.dtype, self.device)
        self.block_table = BlockTable(max_seqs, -(-max_model_len // self.block_size), self.device,
                                      pad_block=self.scratch_block)
        self.compile_s: float | None = None
        """Seconds the start-up compilation took (a warm inductor cache makes it short)."""
        if self.compiled is not None:  # before capture: no compilation may happen inside a CUDA graph
            self.compile_s = self._warm_up()
        self.graphs: DecodeGraphs | None = None
        if self.use_graphs:
            self.graphs = self.step_graphs()
            with torch.inference_mode():
                self.graphs.capture()
        self.send_step: Callable[[list], None] | None = None
        """Rank 0 with tensor parallelism: hands each step to the other ranks before running it."""

    def _attach_gguf(self, model_path: Path) -> str:
        from engine.model.quant import attach_gguf
        from engine.models_hub import resolve_gguf
        path = resolve_gguf(self.config.model.model, model_path, self.config.model.gguf_file)
        types = attach_gguf(self.model, path)
        return f"{', '.join(f'{n} {t}' for t, n in sorted(types.items()))} tensors from {path.name}"

    def _warm_up(self) -> float:
        """Every path a step can take (engine.warm_up), on throwaway sequences in the pool's first
        blocks, which no request owns yet; the pool is as allocated again afterwards."""
        sched = self.config.scheduler
        steps = warm_up_steps(self.block_size, sched.max_num_seqs, sched.max_num_batched_tokens,
                              self.max_model_len, self.num_blocks)
        try:
            return self.compiled.warm_up(steps, self._warm_up_step)
        finally:
            if self.lora is not None:
                self.lora.step.set(None)
            for cache in self.kv_caches:  # (a memset: well under a second even for a large pool)
                for tensor in cache:
                    tensor.zero_()

    @torch.inference_mode()
    def _warm_up_step(self, chunks: list) -> None:
        if self.lora is not None:
            self.lora.set_step(order_chunks(chunks)[0], self.device)
        sampling, input_ids, positions, meta, logits_idx = build_step_inputs(chunks, self.block_size, self.device)
        logits = self._forward(input_ids, positions, meta, logits_idx)
        # Greedy and random rows alike: the sampler's heaviest path (top-k, top-p, min-p).
        self.sampler(logits[:len(sampling)],
                     dataclasses.replace(worst_case_sampling(len(sampling), self.device), all_random=False))

    def _forward(self, input_ids, positions, meta, logits_idx):
        self.backend.plan(meta)
        return self.decoder(input_ids, positions, self.kv_caches, meta, logits_idx)

    # ------------------------------------------------------------------ KV pool
    def _pool_size(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.backend.bytes_per_block(self.dtype) * self.num_layers
        # No use holding more than every slot at full length (plus room for cached prefixes).
        ceiling = 2 * self.config.scheduler.max_num_seqs * -(-self.max_model_len // self.block_size)
        if cache.kv_cache_memory_gb is None and self.device.type == "cuda":
            return self._gpu_pool_size(per_block, ceiling)
        budget = (cache.kv_cache_memory_gb if cache.kv_cache_memory_gb is not None else DEFAULT_CPU_KV_GB) * (1 << 30)
        with_draft = per_block + (0 if self.draft is None else self.draft.block_bytes)
        blocks = min(int(budget // with_draft), ceiling)
        if blocks < 2:
            raise ValueError(f"KV cache budget {budget / (1 << 30):.3f} GiB holds fewer than 2 blocks "
                             f"of {with_draft} bytes; raise kv_cache_memory_gb or num_kv_blocks")
        logger.info("KV pool: %d blocks of %d tokens (%.2f GiB)", blocks, self.block_size,
                    blocks * per_block / (1 << 30))
        return blocks

    def _gpu_pool_size(self, per_block: int, ceiling: int) -> int:
        weights = torch.cuda.memory_allocated(self.device)
        activations = self._profile_largest_step()
        total, other = outside_torch_bytes(self.device)
        budget = MemoryBudget(
            total_bytes=total, utilization=self.config.cache.gpu_memory_utilization, weights_bytes=weights,
            activation_bytes=activations, graph_pool_bytes=self._graph_bytes(activations) if self.use_graphs else 0,
            gather_bytes=self.backend.scratch_bytes(self.max_context_tokens, self.dtype), other_bytes=other,
            block_bytes=per_block, draft=self.draft)
        blocks = budget.num_blocks(ceiling)
        logger.info("GPU memory: %s -> KV pool %d blocks of %d tokens", budget.describe(), blocks, self.block_size)
        return blocks

    @property
    def graph_width(self) -> int:
        """Query tokens a row of the widest captured step: 1 + k where steps verifying k drafts are captured."""
        spec = self.config.speculative_config
        if not self.backend.verify_graphs:
            return 1
        return self._graph_width or (1 if spec is None else 1 + spec.num_speculative_tokens)

    def step_graphs(self) -> DecodeGraphs:
        """The graphs of this runner's steps, uncaptured (``capture`` records them on CUDA; on CPU, as in
        tests, their static path runs as it is)."""
        return DecodeGraphs(self.decoder, self.backend, self.kv_caches, self.block_table, self.block_size,
                            self.config.scheduler.max_num_seqs, self.max_model_len, self.vocab_size, self.device,
                            None if self.lora is None else self.lora.step, (1, self.graph_width),
                            self.model if self.model.aux_layers else None)

    def _graph_bytes(self, activations: int) -> int:
        """The graphs' private pool (the largest step's activations again) and their logits buffer."""
        return activations + graph_logits_bytes(self.config.scheduler.max_num_seqs, self.graph_width, self.vocab_size)

    @torch.inference_mode()
    def _profile_largest_step(self) -> int:
        """Peak activation bytes of the largest step, run on a throwaway cache just big enough."""
        sched = self.config.scheduler
        chunks, used = dummy_prefill(sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len,
                                     self.block_size)
        caches = [self.backend.allocate_cache(used, self.dtype, self.device) for _ in range(self.num_layers)]
        sampling = worst_case_sampling(len(chunks), self.device)
        left = MAX_SCORED_TOKENS  # and it scores as many prompt tokens as a step may: a logits row each
        # With LoRA every token uses the last slot, so each projection's LoRA part reads all slots.
        last_slot = -1 if self.lora is None else self.config.lora.max_loras - 1
        for i, c in enumerate(chunks):
            take = max(0, min(left, c.num_tokens - 1))
            chunks[i] = dataclasses.replace(c, prompt_logprob_positions=range(take), lora_slot=last_slot)
            left -= take

        def step():
            if self.lora is not None:
                self.lora.set_step(order_chunks(chunks)[0], self.device)
            _, input_ids, positions, meta, logits_idx = build_step_inputs(chunks, self.block_size, self.device)
            self.backend.plan(meta)
            logits = self.model(input_ids, positions, caches, meta, logits_idx)
            if logits is not None:  # rank 0 samples; other tensor-parallel ranks get None
                self.sampler(logits[:len(chunks)], sampling)
                torch.log_softmax(logits[len(chunks):len(chunks) + PROMPT_ROWS_AT_ONCE].float(), dim=-1)

        try:
            return measure_peak(step, self.device)
        finally:
            if self.lora is not None:
                self.lora.step.set(None)
            caches.clear()
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ one step
    def prepare(self, chunks: list, drafts: bool = False):
        if self.lora is not None:
            self.lora.set_step(order_chunks(chunks)[0], self.device)
        return build_step_inputs(chunks, self.block_size, self.device, self.block_table, drafts)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], timings: dict[str, float] | None = None, drafts: bool = False):
        """Run one step; returns (requests that sampled, their tokens, their logprobs, prompt
        logprobs: (request, one {token id: logprob} per position it asked for) pairs).
        ``drafts``: some chunks verify draft tokens (engine.spec_decode); each of their positions
        is sampled, so their request appears once per position (engine.spec_verify.draft_rows)."""
        t0 = time.perf_counter()
        if self.send_step is not None:
            self.send_step(chunks)
        tb = time.perf_counter()
        scored = []  # (request, positions) in build_step_inputs' order: their rows follow the sampling rows
        if any(c.request.prompt_logprobs is not None for c in chunks):  # (a cheap test: most steps have none)
            scored = [(c.request, c.prompt_logprob_positions) for c in order_chunks(chunks)[0]
                      if c.prompt_logprob_positions]
        pooling = any(c.request.params.pooling is not None for c in chunks)
        key = self.graphs.key_for(chunks) if self.graphs is not None and not scored and not pooling else None
        offsets = None
        if key is None:
            sampling, input_ids, positions, meta, logits_idx = self.prepare(chunks, drafts)
            reqs, offsets = draft_rows(sampling) if drafts else ([c.request for c in sampling], None)
            if self.model.aux_layers:
                order = order_chunks(chunks)[0]
                self.aux_rows = dict(zip(map(id, order), itertools.accumulate((c.num_tokens for c in order),
                                                                               initial=0)))
            t1 = time.perf_counter()
            if pooling:  # the modules themselves: the compiled decoder returns logits only
                self.backend.plan(meta)
                hidden = self.model.keep_aux(self.model.hidden_states(input_ids, positions, self.kv_caches, meta))
                accumulate(order_chunks(chunks)[0], hidden, self.model.norm)
                logits = self.model.logits(hidden, logits_idx)
            else:
                logits = self._forward(input_ids, positions, meta, logits_idx)
        else:
            sampled = [c for c in chunks if c.samples]
            reqs, offsets = draft_rows(sampled) if drafts else ([c.request for c in sampled], None)
            if self.model.aux_layers:
                self.aux_rows = {id(c): i * key.width for i, c in enumerate(chunks)}
            t1 = time.perf_counter()
            logits = self.graphs.run(chunks, key)
        # Built after the launch: on CUDA the forward is still running, so this host work hides under
        # the device's (its copies queue behind the forward, ahead of the sampler that reads them).
        tl = time.perf_counter()
        batch = SamplingBatch.build(reqs, self.device, offsets) if reqs else None
        tlb = time.perf_counter()
        if timings is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        prompt = []
        if scored:
            logits, prompt = logits[:len(reqs)], prompt_logprobs(logits[len(reqs):], scored)
        tokens, logprobs = self.sampler(logits, batch) if reqs else ([], [])
        t3 = time.perf_counter()
        if timings is not None:
            if self.send_step is not None:
                timings["tp_broadcast"] = timings.get("tp_broadcast", 0.0) + (tb - t0)
            # The sampling batch is host time outside the forward only where the forward had ended (CPU).
            build = 0.0 if self.device.type == "cuda" else tlb - tl
            timings["prepare"] = timings.get("prepare", 0.0) + (t1 - tb) + build
            timings["forward"] = timings.get("forward", 0.0) + (t2 - t1) - build
            timings["sample"] = timings.get("sample", 0.0) + (t3 - t2)
        return reqs, tokens, logprobs, prompt

    @torch.inference_mode()
    def greedy(self, chunks: list) -> dict[int, int]:
        """Each chunk's greedy next token, by ``id(chunk)``: a draft model's proposals (engine.spec_draft).
        Its one-token passes replay the decode graphs where captured: host work is most of such a pass."""
        key = self.graphs.key_for(chunks) if self.graphs is not None else None
        if key is not None:
            best = self.graphs.run(chunks, key).argmax(dim=-1).tolist()
            return {id(c): token for c, token in zip(chunks, best)}
        sampling, input_ids, positions, meta, logits_idx = self.prepare(chunks)
        best = self._forward(input_ids, positions, meta, logits_idx)[:len(sampling)].argmax(dim=-1).tolist()
        return {id(c): token for c, token in zip(sampling, best)}

    @torch.inference_mode()
    def follow(self, chunks: list) -> None:
        """A step rank 0 scheduled, on another tensor-parallel rank: the same inputs and the same
        collectives; the logits go to rank 0, which samples."""
        _, input_ids, positions, meta, logits_idx = self.prepare(chunks, any(c.speculative for c in chunks))
        self.backend.plan(meta)
        self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
