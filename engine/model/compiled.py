"""The decoder stack under ``torch.compile``, attention and GEMMs left opaque.

Dynamo traces the layers once with the step's token count dynamic (and once more for
one-token steps, which it specializes). Two custom ops stay opaque to inductor:

- ``slotserve::attention``: whichever backend the engine picked (the CPU kernel,
  FlashAttention, Triton) runs unchanged inside the graph; the step's metadata (Python lists,
  per-step tensors) reaches it out of band, through ``step_context``, so it never becomes a
  guard that would recompile every step (vLLM passes its forward context the same way).
  On the CPU kernel the graph calls the library's C++ twin, ``slotserve_cpu::attention``
  (engine/csrc/attention_step.cpp): a decode-only step's index tensors are bound once, and each
  layer's K/V write and kernel run without Python; any other step goes on to this op.
- ``slotserve::packed_linear`` (CPU): the GEMM over the weights ``prepack`` packed (AMX tiles up
  to ``AMX_MAX_ROWS`` rows, oneDNN above), as the eager model runs it. A packed oneDNN tensor can
  be neither traced nor written to inductor's disk cache, so the graph names each layer by its
  index in the model instead. Where the CPU kernel library is built, the graph calls its C++ twin,
  ``slotserve_cpu::packed_linear``, which reads the step's layers from a table bound once a step:
  a layer call is then one dispatch, not a Python function (~7 us less a call, ~120 calls a step).
- ``slotserve_cpu::gguf_layer``: a layer served from GGUF blocks (engine.model.quant), named by index
  the same way, its blocks read from a table bound once a step (engine/csrc/gguf_layers.cpp). As graph
  inputs they would be three tensors a layer that dynamo fetches from the modules, and inductor checks,
  on every step.
- ``slotserve::lora_delta`` (LoRA engines): what the step's adapters add to a projection
  (engine.lora.layers). The step's token -> adapter map is host state that changes every step;
  read out of band like the attention metadata, it never becomes a guard, and inside a decode
  CUDA graph it is the graph's own input buffer.

What inductor gains is everything between them: RMSNorm, rotary, SiLU·mul and the residual
adds become a few fused loops per layer instead of ~40 small ops, each a Python dispatch and
an OpenMP launch on CPU, a kernel launch on CUDA. The final norm and LM head stay outside:
they run on the rows that sample, whose count may be zero, and the LM head is one large GEMM
that fusion does not help. On CUDA the compiled decoder is what the decode steps' CUDA graphs
capture (engine.cuda_graphs): fusion takes kernels out of the graph, not just launches.

Each decoder compiles its own copy of ``hidden_states``' code and keeps dynamo's guards on the
step's inputs only (token count, caches, global state), none on its model: guarding the model
re-read every module's attributes and tensors before each step, 1.3-1.5 ms a step of a 30-layer
model on a 2-core host. The model's shapes and attributes never change once traced (weights change
in place; adapters and attention metadata arrive out of band), and with its own code object a
decoder never meets another model's graphs. vLLM's compiled models skip dynamo's guards likewise.

Compiled code is cached on disk by inductor (``$SLOTSERVE_CACHE/inductor``, default
``~/.cache/slotserve/inductor``) under keys that hash the traced graph, torch's version and
inductor's settings: a model of another shape or a change to this code traces another graph
and never meets a stale entry. Weights are graph inputs, not constants baked into the code,
so two checkpoints of one shape share cached code, never weights.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
import types
from typing import Callable, Iterator

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.config import cache_dir
from engine.model.layers import AMX_MAX_ROWS, linear

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64
_step = threading.local()
"""The running step's (backend, metadata, packed layers, LoRA weights): per thread, as engines may
share a process."""


@contextlib.contextmanager
def step_context(backend: AttentionBackend, meta: AttentionMetadata, packed_layers: list,
                 lora_layers: list = ()) -> Iterator[None]:
    _step.current = (backend, meta, packed_layers, lora_layers)
    try:
        yield
    finally:
        _step.current = None


def _current() -> tuple:
    current = getattr(_step, "current", None)
    if current is None:
        raise RuntimeError("a compiled slotserve op ran outside step_context")
    return current


# Defined through ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter's
# Python wrapper costs ~30 us a call on CPU, and a decode step calls these ~150 times.
_lib = torch.library.Library("slotserve", "DEF")
_lib.define("packed_linear(Tensor x, int index, int out_features, bool with_bias) -> Tensor")
_lib.define("lora_delta(Tensor x, int index, int out_features) -> Tensor")
_lib.define("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache) -> Tensor")


def _op(name: str):
    """Registers the decorated function as the op's kernel on every device."""
    def register(fn):
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return register


@_op("packed_linear")
def packed_linear(x: torch.Tensor, index: int, out_features: int, with_bias: bool) -> torch.Tensor:
    """``x @ W.T (+ b)`` with the running model's packed layer ``index`` (AMX or oneDNN, as in eager)."""
    layer = _current()[2][index]
    return linear(x, layer.weight, layer.bias if with_bias else None, layer.packed, layer.amx)


@torch.library.register_fake("slotserve::packed_linear", lib=_lib)
def _packed_linear_shape(x, index, out_features, with_bias):
    return x.new_empty(x.shape[0], out_features)


@_op("lora_delta")
def lora_delta(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """What the step's adapters add to LoRA projection ``index`` (zeros when no token uses one)."""
    delta = _current()[3][index].delta(x)
    return x.new_zeros(x.shape[0], out_features) if delta is None else delta


@torch.library.register_fake("slotserve::lora_delta", lib=_lib)
def _(x, index, out_features):
    return x.new_empty(x.shape[0], out_features)


@_op("attention")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> torch.Tensor:
    """One layer's paged attention with the step context's backend and metadata."""
    backend, meta = _current()[:2]
    return backend.forward(q, k, v, (k_cache, v_cache), meta)


@torch.library.register_fake("slotserve::attention", lib=_lib)
def _attention_shape(q, k, v, k_cache, v_cache):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_SHAPES = {"packed_linear": _packed_linear_shape, "attention": _attention_shape}
"""Shape functions of the ops that have a C++ twin in the kernel library (same schema)."""


@functools.cache
def native_op(name: str):
    """The kernel library's C++ twin of op ``name`` (``packed_linear``, ``attention``), its shape
    function registered for tracing; None where the library cannot be built here."""
    from engine.cpu_kernels import compiler_problem, load_kernel
    if compiler_problem() is not None:
        return None
    op = getattr(load_kernel(), name)
    torch.library.register_fake(f"slotserve_cpu::{name}")(_SHAPES[name])
    return op


def _own_code(method):
    """``method`` over a copy of its code object. Dynamo keeps its compiled variants and their guards
    per code object, so this decoder's variants are for its model alone."""
    fn = method.__func__
    code = fn.__code__.replace(co_firstlineno=fn.__code__.co_firstlineno)
    return types.MethodType(types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__),
                            method.__self__)


_MODEL_SOURCE = re.compile(r"(\w+\()*self\b")
"""A guard's source inside the model: ``self._modules[...]``, ``dict(type(self)...)``."""


def _inputs_only(entries) -> list[bool]:
    """Keep dynamo's guards on the step's inputs and global state, none on the model (see the module's
    docstring); guards on the inputs still pick between the one-token and the many-token graph."""
    return [_MODEL_SOURCE.match(entry.name) is None for entry in entries]


def _gguf_table(model: torch.nn.Module) -> tuple | None:
    """Numbers every module of ``model`` that holds GGUF blocks (``qindex``) and returns the arguments
    of ``slotserve_cpu::bind_gguf_layers`` for them; None without any."""
    from engine.model.quant import INT8_MAX_ROWS, QUANT_MAX_ROWS
    # By ``qout``, not ``qweight``: a GPU INT4 layer (engine.model.gpu_quant) holds a ``qweight`` too.
    held = [m for m in model.modules() if getattr(m, "qout", 0) > 0 and m.qweight is not None]
    if not held:
        return None
    for index, module in enumerate(held):
        module.qindex = index
    return ([m.qweight for m in held], [m.qscale for m in held], [m.qmin for m in held],
            [m.qtype for m in held], [m.qexact for m in held], INT8_MAX_ROWS, QUANT_MAX_ROWS)


class CompiledDecoder:
    """The model's ``hidden_states`` compiled; called like the eager model (plus the backend)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend) -> None:
        # Inductor reads its cache folder from the environment when it needs it. Importing torch._dynamo
        # sets the variable to torch's default (a temporary folder): that value is not the user's choice.
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir("inductor"))
        # Dynamo keeps one compiled variant per model shape, dtype and token-count class (one, many)
        # under one code object; a process that builds engines of several models (tests, benchmarks)
        # passes its default of 8, and with fullgraph=True that is an error, not a fallback.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.model = model
        self.packed_layers = [m for m in model.modules() if getattr(m, "packed", None) is not None
                              and hasattr(m, "packed_index")]
        native = native_op("packed_linear") if self.packed_layers else None
        for index, layer in enumerate(self.packed_layers):
            layer.packed_index = index
            layer.packed_op = native or torch.ops.slotserve.packed_linear
        self._bind = (native and (
            [layer.amx for layer in self.packed_layers], [layer.packed for layer in self.packed_layers],
            [layer.bias for layer in self.packed_layers], AMX_MAX_ROWS))
        self._bind_gguf = _gguf_table(model)
        # The CPU kernel's decode steps run in the C++ op; every other step goes on to the Python one.
        native_attention = native_op("attention") if backend.name == "cpu" else None
        self.native_attention = native_attention is not None
        attention_op = native_attention or torch.ops.slotserve.attention
        for module in model.modules():
            if hasattr(module, "compiled_op"):
                module.compiled_op = attention_op
        self.lora_layers = [m.lora for m in model.modules() if getattr(m, "lora", None) is not None]
        for index, weights in enumerate(self.lora_layers):
            weights.index = index
        options = {"guard_filter_fn": _inputs_only}
        if next(model.parameters()).device.type == "cpu":
            # A fused loop keeps a 16-bit result in float32 where it is reused, and which reuses stay
            # in registers differs between the one-token and the many-token graph (RMSNorm's variance
            # of the unrounded residual in one, of the stored bfloat16 one in the other): a row then
            # rounds by the step's size, and a verified draft or a decode beside others changes
            # greedy text. Rounding where eager rounds costs 0-2 % a step on a 2-core host.
            options["emulate_precision_casts"] = True
            # The graph's wrapper in C++, not Python: its ~300 kernel and op calls a step stop costing an
            # interpreter each. A decode step at 1 running, default model, 2-core AVX-512 host: 1.02-1.12x
            # in 5 alternated pairs, even at 16; a first compile takes ~50 s longer, a cached start no longer.
            options["cpp_wrapper"] = True
        self._hidden = torch.compile(_own_code(model.hidden_states), dynamic=True, fullgraph=True,
                                     options=options)

    def __call__(self, input_ids, positions, kv_caches, meta, logits_indices, backend):
        # Eager steps and captured decode steps pass rows of one packed tensor, at offsets that vary
        # with the token count. A storage offset is a size dynamo guards on: copies at offset 0 keep
        # one compiled variant for all (inside a CUDA graph the copy is one tiny captured kernel).
        input_ids, positions = (t if t.storage_offset() == 0 else t.clone() for t in (input_ids, positions))
        if self._bind:
            torch.ops.slotserve_cpu.bind_packed_layers(*self._bind)
        if self._bind_gguf:
            torch.ops.slotserve_cpu.bind_gguf_layers(*self._bind_gguf)
        if self.native_attention:
            torch.ops.slotserve_cpu.bind_attention_step(backend.decode_step_index(meta), backend.scale)
        with step_context(backend, meta, self.packed_layers, self.lora_layers):
            hidden = self._hidden(input_ids, positions, kv_caches, None)
        return self.model.logits(self.model.keep_aux(hidden), logits_indices)

    def warm_up(self, steps: list, run_step: Callable[[list], None]) -> float:
        """Run ``steps`` (engine.warm_up.WarmUpStep) with ``run_step(chunks)``: the first one-token and
        the first many-token step compile the model's two graphs, the others run every path a real
        step takes (nothing is left to compile for the first request). Returns the seconds taken."""
        t0 = time.perf_counter()
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        graphs: set[bool] = set()
        for i, step in enumerate(steps, 1):
            many = sum(c.num_tokens for c in step.chunks) > 1
            compiles = many not in graphs
            graphs.add(many)
            # One line a step: Ray forwards a replica's output line by line (a progress bar's
            # carriage returns would show only when it ends).
            logger.info("warming up the compiled model: step %d of %d (%s)%s", i, len(steps), step.name,
                        f": compiling its graph, {len(graphs)} of 2 (a first start compiles for minutes; "
                        f"later starts read {cache})" if compiles else "")
            t = time.perf_counter()
            run_step(step.chunks)
            logger.info("warm-up step %d of %d done in %.1f s", i, len(steps), time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        logger.info("model compiled and warmed up in %.1f s (inductor cache %s)", seconds, cache)
        return seconds
