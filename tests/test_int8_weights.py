"""``quantization: int8``: a dense checkpoint's weights rounded at load to Q8_0 blocks (an int8 per
weight, a float16 scale per 32) and multiplied in place by the GGUF kernels.

The oracle is HF transformers on the checkpoint with every quantized weight replaced by its Q8_0
values (gguf's own quantizer and de-quantizer): the engine computes with exactly those values. On the
int8 kernel HF also rounds each projection's input as the kernel does (round_activations_like_int8).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.factories import make_model
from tests.test_gguf_quant import (ALL_PROJECTIONS, INT8_NATS, PROMPTS, _assert_prompt_logprobs_close, _int8_ready,
                                   round_activations_like_int8)

gguf = pytest.importorskip("gguf")
Q8_0 = gguf.GGMLQuantizationType.Q8_0
OPTIONS = dict(quantization="int8", dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _round_to_q8_0(hf) -> int:
    """Replace ``hf``'s 2-D weights whose rows are whole 32-blocks by their Q8_0 values; returns how many."""
    count = 0
    with torch.no_grad():
        for p in {id(p): p for p in hf.parameters()}.values():  # a tied weight once
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                blocks = gguf.quants.quantize(p.numpy(), Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q8_0)))
                count += 1
    return count


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's argmax continuation, end-of-sequence tokens included (the requests ignore EOS)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _generate(llm, prompts=PROMPTS):
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.mark.parametrize("tie,eager,int8", [(False, True, False), (True, False, False), (False, True, True),
                                            (True, False, True)],
                         ids=["float32-untied-eager", "float32-tied-compiled", "int8-untied-eager",
                              "int8-tied-compiled"])
def test_greedy_matches_hf_on_q8_0_weights(tmp_path, monkeypatch, tie, eager, int8):
    import engine.model.quant as quant
    if int8 and not _int8_ready():
        pytest.skip("the int8 kernel needs AVX-512 VNNI")
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", int8)
    hf = make_model("llama", seed=5, hidden=64, layers=2, heads=4, kv_heads=2, tie=tie)
    hf.save_pretrained(tmp_path, safe_serialization=True)  # the checkpoint: float32, unrounded
    # 7 projections a layer, the head and (untied) the embedding
    assert _round_to_q8_0(hf) == 2 * 7 + 1 + (not tie)
    if int8:
        round_activations_like_int8(hf, ALL_PROJECTIONS)
    llm = LLM(str(tmp_path), enforce_eager=eager, **OPTIONS)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
    assert len(layers) == 2 * 4 + 2  # qkv, o, gate_up, down per layer; head and embedding (one tensor if tied)
    assert all(m.qtype == int(Q8_0) and m.weight.numel() == 0 for m in layers)
    assert all((m.qscale is not None) == int8 for m in layers)
    assert (model.embed_tokens.qweight is model.lm_head.qweight) == tie
    # 8.5 bits a weight where it was 32: every quantized tensor's bytes, scales included
    dense_bytes = sum(p.numel() * 4 for p in hf.parameters() if p.dim() == 2)  # a tied weight once
    assert llm.engine.runner.param_bytes < dense_bytes * 0.3
    assert _generate(llm) == [_hf_greedy(hf, p, 8) for p in PROMPTS]
    _assert_prompt_logprobs_close(llm, hf, INT8_NATS if int8 else 1e-4)
    llm.engine.block_manager.check_invariants()


def test_widths_off_the_block_stay_dense(tmp_path, monkeypatch):
    """hidden 48: every layer reading 48 features (q/k/v, o, gate/up, the head and the embedding), no
    multiple of 32, keeps the checkpoint's weights; down reads 96 and is quantized, and HF rounds just
    that one."""
    import engine.model.quant as quant
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", False)
    hf = make_model("llama", seed=6, hidden=48, layers=2, heads=4, kv_heads=2, tie=True)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert _round_to_q8_0(hf) == 2  # the down projections
    llm = LLM(str(tmp_path), enforce_eager=True, **OPTIONS)
    model = llm.engine.runner.model
    assert [m.qtype for m in (model.layers[0].mlp.down_proj, model.layers[1].mlp.down_proj)] == [int(Q8_0)] * 2
    assert model.layers[0].self_attn.qkv_proj.qtype is None and model.lm_head.qtype is None
    assert _generate(llm) == [_hf_greedy(hf, p, 8) for p in PROMPTS]


def test_tensor_parallel_ranks_quantize_their_share(tmp_path):
    """tp 2: each rank rounds the part of each weight it holds, the same blocks as tp 1's rows (o and
    down split between blocks), so the tokens are tp 1's."""
    make_model("llama", seed=7, hidden=64, layers=2, heads=4, kv_heads=2, tie=True).save_pretrained(
        tmp_path, safe_serialization=True)
    want = _generate(LLM(str(tmp_path), **OPTIONS))
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **OPTIONS)
    try:
        got = _generate(llm)
        rank0 = llm.engine.runner.model
        o = rank0.layers[0].self_attn.o_proj  # 2 of 4 heads of 16: 32 input features, one block a row
        assert o.qtype == int(Q8_0) and o.qweight.shape[1] == (512 if o.qscale is not None else 34)
    finally:
        llm.shutdown()
    assert got == want


def test_served_config_takes_int8_and_refuses_other_names():
    from engine.config import EngineConfig
    assert EngineConfig.from_options(model="m", quantization="int8").model.quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig.from_options(model="m", quantization="int3")
