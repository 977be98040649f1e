"""The compiled model (engine.model.compiled) gives HF's greedy tokens, and a warm compile cache
never serves another model's weights.

The only tests that compile: the rest of the suite runs engines eagerly (conftest sets
SLOTSERVE_ENFORCE_EAGER). Qwen3 on two layers: q/k norm, GQA, SiLU, untied head.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine import LLM
from engine.model import compiled
from tests.factories import make_model_dir
from tests.test_engine_oracle import MAX_NEW, _hf_greedy, _prompts

# A budget of 16 tokens: prompts go in chunks, some steps hold decodes beside a chunk, and a
# 1-token prompt makes one-token steps (the specialized graph) as well as many-token ones.
OPTIONS = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
               num_kv_blocks=96, enforce_eager=False)


def _greedy(llm: LLM) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two qwen3 checkpoints of one shape and different weights, with HF's greedy tokens for each."""
    from transformers import AutoModelForCausalLM

    out = []
    for seed in (5, 6):
        path = make_model_dir(tmp_path_factory.mktemp(f"compiled{seed}"), "qwen3", seed=seed, with_tokenizer=False)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out.append((path, [_hf_greedy(hf, p, MAX_NEW) for p in _prompts()]))
    return out


def test_compiled_engine_gives_hf_greedy_tokens_and_a_cached_compile_no_stale_weights(models):
    (first, want_first), (second, want_second) = models
    assert want_first != want_second
    llm = LLM(str(first), **OPTIONS)
    runner = llm.engine.runner
    assert runner.compiled is not None and runner.compile_s > 0
    native = compiled.native_op("packed_linear")  # the kernel library's layer op; None without a compiler
    assert runner.compiled.packed_layers and all(
        layer.packed_op is (native or torch.ops.slotserve.packed_linear) for layer in runner.compiled.packed_layers)
    # Decode steps' attention runs in the library's C++ op too (the CPU kernel backend, by default here).
    assert runner.backend.name == ("cpu" if native else "torch") and runner.compiled.native_attention == bool(native)
    assert _greedy(llm) == want_first
    # Same shapes, so the same graphs: the second engine's compile finds them in the cache.
    llm2 = LLM(str(second), **OPTIONS)
    assert _greedy(llm2) == want_second
    assert _greedy(llm) == want_first  # and the first engine's graphs still read its own weights


def test_engines_of_other_shapes_in_one_process_keep_their_own_graphs(models, tmp_path):
    """Each compiled decoder keeps dynamo's guards on the step's inputs only, none on its model, over
    its own copy of the code: an engine of another shape in the same process compiles its own graphs
    and never runs the first one's."""
    from transformers import AutoModelForCausalLM

    other = make_model_dir(tmp_path / "llama", "llama", seed=8, hidden=96, heads=6, kv_heads=3,
                           with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    want_other = [_hf_greedy(hf, p, MAX_NEW) for p in _prompts()]
    llm, llm2 = LLM(str(models[0][0]), **OPTIONS), LLM(str(other), **OPTIONS)
    assert llm.engine.runner.compiled._hidden is not llm2.engine.runner.compiled._hidden
    for _ in range(2):
        assert _greedy(llm2) == want_other
        assert _greedy(llm) == models[0][1]


@pytest.mark.parametrize("option", ["enforce_eager", "compile_model"])
def test_the_model_runs_uncompiled_when_asked(models, option):
    llm = LLM(str(models[0][0]), **{**OPTIONS, option: option == "enforce_eager"})
    assert llm.engine.runner.compiled is None and llm.engine.runner.compile_s is None
    assert _greedy(llm) == models[0][1]


def test_captured_decode_inputs_reach_the_compiled_model_as_eager_steps_do(tiny_model_dir):
    """DecodeGraphs' static buffers (what CUDA graphs capture) and eager steps' packed inputs give the
    compiled model one layout: two variants (one token, many) in all, none more per engine."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from tests.test_cuda_graphs import LONG, _attach_graphs, _generate

    options = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=6, max_model_len=300,
                   num_kv_blocks=64, attention_backend="torch")
    eager = LLM(str(tiny_model_dir), **options, enforce_eager=True)
    want = _generate(eager, LONG)
    code = eager.engine.runner.model.hidden_states.__code__  # dynamo keeps its variants per code object
    variants = [len(_debug_get_cache_entry_list(code))]  # other tests' models may have added some
    for _ in range(2):
        llm = LLM(str(tiny_model_dir), **options, enforce_eager=False)
        used = _attach_graphs(llm)
        assert _generate(llm, LONG) == want and used
        variants.append(len(_debug_get_cache_entry_list(code)))
    assert variants[1] - variants[0] <= 2 and variants[2] == variants[1], variants


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_librarys_layer_op_runs_the_bound_layers_as_eager_does_on_its_own_thread(dtype):
    """``slotserve_cpu::packed_linear``, what the compiled graph calls for a layer: with an AMX copy or
    without, either side of AMX_MAX_ROWS, with a bias or not, it gives ``layers.linear``'s bits; the
    table of layers a step binds belongs to the binding thread."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.cpu_kernels import amx_linear_problem, compiler_problem
    from engine.model.layers import AMX_MAX_ROWS, cpu_prepack_supported, linear, pack_amx, pack_weight

    if compiler_problem() is not None:
        pytest.skip(f"no CPU kernel library here: {compiler_problem()}")
    if not cpu_prepack_supported(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN does not prepack {dtype} on this CPU")
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(64, 96, generator=gen).to(dtype) for _ in range(2)]
    bias = torch.randn(64, generator=gen).to(dtype)
    amx = pack_amx(weights[0]) if dtype == torch.bfloat16 and amx_linear_problem() is None else None
    layers = [(amx, pack_weight(weights[0], 16), None), (None, pack_weight(weights[1], 16), bias)]
    op = compiled.native_op("packed_linear")
    torch.ops.slotserve_cpu.bind_packed_layers(*map(list, zip(*layers)), AMX_MAX_ROWS)
    for rows in (3, AMX_MAX_ROWS + 1):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        for index, (amx_weight, packed, layer_bias) in enumerate(layers):
            for with_bias in (True, False):
                want = linear(x, weights[index], layer_bias if with_bias else None, packed, amx_weight)
                assert torch.equal(op(x, index, 64, with_bias), want), (rows, index, with_bias)
    with ThreadPoolExecutor(1) as pool:
        error = pool.submit(op, x, 0, 64, False).exception()
    assert isinstance(error, RuntimeError) and "layer 0 is not bound on this thread" in str(error)


def test_compiled_ops_outside_a_step_fail_clearly():
    q = torch.zeros(1, 2, 16)
    with pytest.raises(RuntimeError, match="outside step_context"):
        compiled.attention(q, q[:, :1], q[:, :1], q, q)


def _decode_step(contexts, block_size):
    """A decode-only step over ``contexts`` cached tokens per request, blocks scattered in the pool."""
    from engine.attention.metadata import build_step_inputs
    from engine.request import Request
    from engine.sampling import SamplingParams
    from engine.scheduler import ScheduledChunk

    need = [-(-(c + 1) // block_size) for c in contexts]
    pool = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1)).tolist()
    chunks = []
    for i, c in enumerate(contexts):
        r = Request(str(i), [1] * (c + 1), SamplingParams(), 0, i, 10_000, 0, frozenset())
        r.block_ids = [pool.pop() for _ in range(need[i])]
        chunks.append(ScheduledChunk(r, c, 1))
    return build_step_inputs(chunks, block_size, torch.device("cpu"))[3], sum(need)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_kernel_librarys_attention_op_serves_decode_steps_and_hands_other_steps_to_the_python_op(kv_cache_dtype):
    """``slotserve_cpu::attention``, what the compiled graph calls for a layer on the CPU kernel: a bound
    decode step's K/V writes and outputs are the backend's bits; with nothing bound (a step with prompt
    chunks) it runs the Python op, which reads the step context; the binding belongs to its thread."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.attention import create_backend, int8_problem
    from engine.cpu_kernels import compiler_problem
    from tests.test_attention_cpu import _long_step

    if compiler_problem() is not None:
        pytest.skip(f"no CPU kernel library here: {compiler_problem()}")
    if kv_cache_dtype == "int8" and int8_problem(16) is not None:
        pytest.skip(int8_problem(16))
    op, cpu, dtype = compiled.native_op("attention"), torch.device("cpu"), torch.bfloat16
    backend = create_backend("cpu", cpu, 9, 3, 64, 16, dtype, kv_cache_dtype)
    gen = torch.Generator().manual_seed(2)
    decode, blocks = _decode_step([40, 300, 17, 129], 16)
    mixed = _long_step(3, 16, 9, 3, 64, dtype)
    for meta, bound in ((decode, backend.decode_step_index(decode)), (mixed[0], backend.decode_step_index(mixed[0]))):
        assert (meta is decode) == bool(bound)
        tokens = len(meta.slot_mapping)
        q = torch.randn(tokens, 9, 64, generator=gen).to(dtype)
        k, v = (torch.randn(tokens, 3, 64, generator=gen).to(dtype) for _ in "kv")
        caches = [backend.allocate_cache(max(blocks, mixed[4]), dtype, cpu) for _ in range(2)]
        want = backend.forward(q, k, v, caches[0], meta)
        torch.ops.slotserve_cpu.bind_attention_step(bound, backend.scale)
        # A bound step never reaches Python: no step context for it.
        with compiled.step_context(backend, meta, []) if not bound else contextlib.nullcontext():
            got = op(q, k, v, *caches[1])
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(*caches))
    with ThreadPoolExecutor(1) as pool:  # nothing bound there, and no step context: the Python op refuses
        error = pool.submit(op, q, k, v, *caches[1]).exception()
    assert isinstance(error, RuntimeError) and "outside step_context" in str(error)
    torch.ops.slotserve_cpu.bind_attention_step(backend.decode_step_index(decode), backend.scale)
    with pytest.raises(RuntimeError, match="the bound step has 4 tokens"):
        op(q, k, v, *caches[1])


def test_the_compiled_model_takes_no_int4_layer_for_gguf_blocks(tiny_model_dir):
    """An INT4 layer (engine.model.gpu_quant) holds a ``qweight`` as a GGUF layer does; the compiled model,
    which binds GGUF blocks to the kernel library, must build over it and bind none (compiling and running
    it costs ~40 s here, in Triton's interpreter; the ``gpu`` test in tests/test_gpu_quant.py runs it)."""
    from engine.model.gpu_quant import interpreted
    if not interpreted():
        pytest.skip("INT4 layers run on CPU only in Triton's interpreter (TRITON_INTERPRET=1)")
    llm = LLM(str(tiny_model_dir), **{**OPTIONS, "quantization": "int4"})
    compiled_model = llm.engine.runner.compiled
    assert compiled_model is not None and compiled_model._bind_gguf is None
    assert llm.engine.runner.model.layers[0].mlp.down_proj.wq.qweight is not None
