"""``quantization: gguf`` with int8 layers: a row's output has the same bits in any batch (issue 47).

The int8 kernel rounds each layer's input to int8 per block, so a float32 ulp upstream can move an
output by a whole step, and the next layers grow that into percent-sized differences: a prompt that
hit the prefix cache (its rows computed in a smaller chunk, its attention by another kernel) got
other greedy text than the same prompt computed from scratch. These tests hold every quantized layer
and the attention to one arithmetic per row, on tiny random GGUF models (tests/test_gguf_quant.py).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.test_gguf_quant import MIXED, Q, Q4_K_M, _int8_ready, _model_dir

pytestmark = pytest.mark.skipif(not _int8_ready(), reason="int8 layers need AVX-512 VNNI or AVX2")

TYPE_MIXES = {
    # Q4_0 / Q4_1 / Q8_0 on the int8 kernel, Q5_1 on the float32 one, a Q8_0 head
    "legacy": (dict(MIXED, v_proj=Q.Q5_1, down_proj=Q.Q5_1), 64, Q.Q8_0),
    # Q4_K, Q5_0 on the int8 kernel beside Q6_K and Q5_1 on the float32 one, a Q6_K head
    "k-quants": (dict(Q4_K_M, o_proj=Q.Q5_1), 256, Q.Q6_K),
}
FLOAT32_KERNEL = ("Q5_1", "Q6_K")


@pytest.fixture(autouse=True)
def _float32_kernel_for_some_types(monkeypatch):
    """Every type has an int8 packing, but a tensor whose rows are no multiple of 16 (a vocabulary of
    32001) keeps the float32 kernel beside int8 layers: here two types stand for such tensors."""
    import engine.model.quant as quant
    monkeypatch.setattr(quant, "INT8_TYPES", tuple(t for t in quant.INT8_TYPES if t not in FLOAT32_KERNEL))


def _engine(tmp_path, mix: str, dtype: str = "float32", layers: int = 2, **options) -> LLM:
    types, hidden, head = TYPE_MIXES[mix]
    tmp_path.mkdir(exist_ok=True)
    _model_dir(tmp_path, types, tie=False, hidden=hidden, head_type=head, layers=layers)
    return LLM(str(tmp_path), quantization="gguf", dtype=dtype, block_size=8, num_kv_blocks=64,
               max_num_seqs=4, **options)


@pytest.mark.parametrize("mix", TYPE_MIXES)
def test_each_quantized_layer_gives_a_row_the_same_bits_in_any_batch(tmp_path, mix):
    """Every quantized linear layer and the LM head, each of its kernels (int8; float32 block tiles up to
    QUANT_MAX_ROWS rows, de-quantized tiles above): rows alone, in tile remainders and in large steps."""
    model = _engine(tmp_path, mix, enforce_eager=True).engine.runner.model
    layers = {name: m for name, m in model.named_modules()
              if getattr(m, "qtype", None) is not None and (hasattr(m, "in_features") or name == "lm_head")}
    kinds = {(p or m).qscale is not None for m in layers.values() for p in (m.qparts or [None])}
    assert len(layers) == 2 * 4 + 1 and kinds == {True, False}  # both kernels among them
    gen = torch.Generator().manual_seed(0)
    for name, layer in layers.items():
        x = torch.randn(80, model.embed_tokens.weight.shape[1] if name == "lm_head" else layer.in_features,
                        generator=gen)
        with torch.no_grad():
            whole = layer(x)
            for start, rows in ((0, 1), (5, 1), (3, 2), (0, 9), (7, 31), (40, 33), (0, 64)):
                part = layer(x[start:start + rows])
                assert torch.equal(part, whole[start:start + rows]), (name, start, rows)


PROMPT = [(7 * i + 3) % 500 + 3 for i in range(43)]
OTHERS = [[5, 9, 200, 17], list(range(100, 160, 2)), [300] * 3]


@pytest.mark.parametrize("eager,dtype,layers", [(True, "float32", 2), (False, "float32", 2),
                                                (False, "bfloat16", 4)],
                         ids=["eager", "compiled", "compiled-bfloat16"])
def test_prefix_hit_batch_and_chunks_leave_greedy_logprobs_bitwise_equal(tmp_path, eager, dtype, layers):
    """One prompt computed from scratch, again after its prefix was cached, beside other requests, and
    in chunks of 16 tokens: the same tokens with the same log-probabilities, to the bit. In bfloat16,
    from four layers on, inductor fuses residual adds across layers differently in its one-token and
    many-token graphs (engine.model.compiled: where it rounds)."""
    llm = _engine(tmp_path, "legacy", dtype, layers, enforce_eager=eager, max_num_batched_tokens=64)
    assert llm.engine.runner.backend.batch_invariant
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(prompts, engine=llm):
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]

    cold = run([PROMPT])[0]
    assert run([PROMPT])[0] == cold  # its first 40 tokens from the prefix cache
    assert run([PROMPT[:-1] + [11]] + OTHERS)[0] != cold  # sanity: another prompt, other numbers
    assert run([PROMPT] + OTHERS)[0] == cold  # beside others: decode steps of several rows
    chunked = _engine(tmp_path / "chunked", "legacy", dtype, layers, enforce_eager=eager,
                      max_num_batched_tokens=16, enable_prefix_caching=False)
    assert run([PROMPT], chunked)[0] == cold  # prefilled in 3 chunks after one another
    llm.engine.block_manager.check_invariants()


def test_models_without_int8_layers_keep_the_faster_paths(tmp_path, monkeypatch):
    """Float32 kernels alone never round activations: ulps stay ulps, so large steps keep the GEMM and
    first chunks torch's fused attention."""
    import engine.model.quant as quant
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", False)
    llm = _engine(tmp_path, "legacy", enforce_eager=True)
    model = llm.engine.runner.model
    assert not llm.engine.runner.backend.batch_invariant
    assert not any(m.qexact for m in model.modules() if getattr(m, "qtype", None) is not None)
