"""GGUF layers inside the compiled decoder: the graph names each layer by its index and reads its blocks
from a table bound once a step (engine/csrc/gguf_layers.cpp), as it does oneDNN-packed layers. The
compiled paths' tokens against HF are checked in tests/test_gguf_quant.py; here, what the op computes
and what the graph takes as inputs."""

from __future__ import annotations

import dis
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from benchmarks.gguf_kernels import blocks_of
from engine import LLM, SamplingParams
from engine.model.layers import LinearBase
from engine.model.quant import QUANT_MAX_ROWS, GGUFTensor, QuantPart, hold_blocks, quant_linear
from tests.test_gguf_quant import MIXED, PROJ, Q, _model_dir, _ops

pytest.importorskip("gguf")


def _layer(type_name: str, n: int, k: int, seed: int, int8: bool, monkeypatch) -> QuantPart:
    import engine.model.quant as quant
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", int8)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    layer = QuantPart()
    hold_blocks(layer, [GGUFTensor("w", type_name, blocks_of(w, type_name))], k)
    assert (layer.qscale is not None) == int8
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gguf_layer_op_runs_the_bound_layers_as_eager_does_on_its_own_thread(dtype, monkeypatch):
    """``slotserve_cpu::gguf_layer``, what the compiled graph calls for a GGUF layer: packed for the int8
    kernel or the file's blocks, either side of QUANT_MAX_ROWS, it gives the eager layer's bits; the table
    a step binds belongs to the binding thread, and a layer of another width than traced is refused."""
    ops = _ops()
    int8 = [True, False] if ops.gguf_int8_ready() else [False]
    layers = [_layer(t, 48, 128, i, packed, monkeypatch) for i, (t, packed) in
              enumerate((t, p) for t in ("Q4_1", "Q8_0") for p in int8)]
    for exact in (True, False):
        for layer in layers:
            layer.qexact = exact
        ops.bind_gguf_layers([m.qweight for m in layers], [m.qscale for m in layers], [m.qmin for m in layers],
                             [m.qtype for m in layers], [m.qexact for m in layers], 1 << 16, QUANT_MAX_ROWS)
        for rows in (3, QUANT_MAX_ROWS + 1):
            x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
            for index, layer in enumerate(layers):
                got = ops.gguf_layer(x, index, 48)
                assert got.dtype == dtype and torch.equal(got, quant_linear(x, layer)), (exact, rows, index)
    with pytest.raises(RuntimeError, match="layer 1 has 48 outputs, the graph was traced with 64"):
        ops.gguf_layer(x, 1, 64)
    with ThreadPoolExecutor(1) as pool:
        error = pool.submit(ops.gguf_layer, x, 0, 48).exception()
    assert isinstance(error, RuntimeError) and "layer 0 is not bound on this thread" in str(error)


def _blocks_fetched(llm) -> int:
    """How many ``qweight`` buffers the compiled ``hidden_states``' code fetches from the model for its
    graph, in its most-fetching variant: each is one of the graph's inputs."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    code = llm.engine.runner.compiled._hidden._torchdynamo_orig_callable.__code__
    entries = _debug_get_cache_entry_list(code)
    assert entries, "the decoder was not compiled"
    return max(sum(i.argval == "qweight" for i in dis.get_instructions(e.code)) for e in entries)


@pytest.mark.parametrize("types,int8", [({p: Q.Q4_1 for p in PROJ}, True), (MIXED, False)],
                         ids=["int8-q4_1-tied", "float32-mixed"])
def test_the_compiled_graph_takes_no_linear_layers_blocks(tmp_path, monkeypatch, types, int8):
    """Of every module holding GGUF blocks, only the embedding's are graph inputs (its lookup is no
    linear layer); the compiled model still gives the eager model's greedy tokens."""
    import engine.model.quant as quant
    if int8 and not _ops().gguf_int8_ready():
        pytest.skip("the int8 kernel needs AVX-512 VNNI or AVX2")
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", int8)
    _model_dir(tmp_path, types, tie=True)
    options = dict(quantization="gguf", dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=4)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 200, 17], list(range(3, 40)))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path), enforce_eager=eager, **options)
        runs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    held = [m for m in llm.engine.runner.model.modules() if getattr(m, "qweight", None) is not None]
    assert len(held) == 2 * 4 + 2  # 4 projections a layer, the embedding and the tied head
    assert all(m.qindex >= 0 for m in held if isinstance(m, LinearBase))
    assert _blocks_fetched(llm) == 1  # the embedding's (the tied head runs outside the graph)
    assert runs[False] == runs[True]
