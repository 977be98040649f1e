"""``quantization: gguf``: linear layers multiply a GGUF file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K
blocks in place.

The files are written here with the ``gguf`` package (llama.cpp's own writer and quantizers; k-quant
blocks are drawn at random, as ``gguf`` has no quantizer for them), in llama.cpp's layout (Llama q/k
rows interleaved for its rotary). The oracle is HF transformers
running the de-quantized weights in float32: the kernel computes with exactly those values, so
greedy tokens agree and logits differ by summation order only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from benchmarks.gguf_kernels import blocks_of
from engine.errors import ModelLoadError
from tests.factories import make_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
PROJ = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
        "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for Llama."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, path, types: dict[str, object], head_type=Q.Q8_0) -> None:
    """Quantize ``hf``'s linear layers into ``path`` (type per projection) and put the de-quantized
    values back into ``hf``, so that it becomes the oracle."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "llama")
    state = hf.state_dict()
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for proj, short in PROJ.items():
            part = "self_attn" if short.startswith("attn") else "mlp"
            name = f"model.layers.{i}.{part}.{proj}.weight"
            w = state[name].numpy()
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(proj)
            blocks = _quantize(_interleave(w, heads) if heads else w, types[proj])
            tensors[f"blk.{i}.{short}.weight"] = (blocks, types[proj])
            back = gguf.quants.dequantize(blocks, types[proj])
            state[name].copy_(torch.from_numpy(_interleave_back(back, heads) if heads else back))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    blocks = _quantize(state[head].numpy(), head_type)
    tensors["token_embd.weight" if cfg.tie_word_embeddings else "output.weight"] = (blocks, head_type)
    state[head].copy_(torch.from_numpy(gguf.quants.dequantize(blocks, head_type)))
    if not cfg.tie_word_embeddings:
        tensors["token_embd.weight"] = (state["model.embed_tokens.weight"].numpy(), None)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


K_QUANTS = (Q.Q4_K, Q.Q6_K)


def _quantize(w: np.ndarray, qtype) -> np.ndarray:
    return blocks_of(w, qtype.name)


def _interleave_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _ops():
    from engine.cpu_kernels import load_kernel
    return load_kernel()


def _int8_ready() -> bool:
    return _ops().gguf_int8_ready()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_QUANTS], ids=lambda t: t.name)
def test_float32_kernel_matches_gguf_dequantize(qtype):
    from engine.model.quant import QUANT_MAX_ROWS
    ops = _ops()
    gen = torch.Generator().manual_seed(0)
    for n, k in ((96, 256), (40, 768)) if qtype in K_QUANTS else ((96, 64), (40, 160)):
        w = torch.randn(n, k, generator=gen).numpy()
        blocks = torch.from_numpy(_quantize(w, qtype))
        reference = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).copy())
        assert torch.equal(ops.gguf_dequantize(blocks, int(qtype), k), reference)
        for rows in (1, 2, 7, 8, 9, QUANT_MAX_ROWS + 3):  # every tile remainder and the GEMM path
            x = torch.randn(rows, k, generator=gen)
            expected = (x.double() @ reference.double().T).float()
            got = ops.gguf_mm(x, blocks, int(qtype), QUANT_MAX_ROWS)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_QUANTS], ids=lambda t: t.name)
def test_int8_kernel_within_the_activations_rounding(qtype):
    """Each output differs from the exact product by at most what rounding the activations to int8 per
    block can move it: sum over blocks of half a step (amax / 127 / 2) times the block's |weights|.
    Q4_K is packed as Q4_1 blocks and Q6_K with a scale per 16 weights, their scales rounded to float16:
    checked within that rounding, and the bound taken over the packed values."""
    if not _int8_ready():
        pytest.skip("the int8 kernel needs AVX-512 VNNI")
    from engine.model.quant import KERNEL_TYPES, PACKED_AS, QUANT_MAX_ROWS, pack_int8
    ops = _ops()
    kernel_type = KERNEL_TYPES[PACKED_AS.get(qtype.name, qtype.name)][0]
    gen = torch.Generator().manual_seed(1)
    # 2, 5 and 18 blocks; k-quants: 8 and 24 sub-blocks (columns: groups of 16)
    for n, k in ((96, 256), (32, 768)) if qtype in K_QUANTS else ((96, 64), (48, 160), (32, 576)):
        w = torch.randn(n, k, generator=gen).numpy()
        blocks = _quantize(w, qtype)
        exact = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
        packed = pack_int8(blocks, qtype.name, k)
        unpacked = ops.gguf_dequantize_packed(*packed, kernel_type, k)
        # k-quants: d sc (and dmin m) rounded to float16 (2^-11 of each); a layout slip is off by whole steps.
        atol = exact.abs().max().item() * 2.0 ** -10 if qtype in K_QUANTS else 1e-6
        torch.testing.assert_close(unpacked, exact, rtol=0, atol=atol)
        reference = unpacked.double()
        for rows in (1, 3, 8, 9, 17, QUANT_MAX_ROWS + 1):
            x = torch.randn(rows, k, generator=gen).double()
            step = x.view(rows, k // 32, 32).abs().amax(-1) / 127  # [rows, blocks]
            bound = (step / 2) @ reference.abs().view(n, k // 32, 32).sum(-1).T
            got = ops.gguf_mm_packed(x.float(), *packed, kernel_type, QUANT_MAX_ROWS).double()
            err = (got - x @ reference.T).abs()
            assert (err <= bound + 1e-4).all(), (rows, (err - bound).max().item())


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_1, Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_int8_kernel_takes_bfloat16_rows_as_their_float32_values(qtype):
    """A bfloat16 model's rows go into the int8 kernel as they are and come out in bfloat16: bitwise the
    float32 rows' outputs rounded to nearest even, as a tensor conversion rounds them, at every tile
    remainder, for row-strided inputs too, and into a float32 ``out``."""
    if not _int8_ready():
        pytest.skip("the int8 kernel needs AVX-512 VNNI or AVX2")
    from engine.model.quant import KERNEL_TYPES, QUANT_MAX_ROWS, pack_int8
    ops = _ops()
    kernel_type = KERNEL_TYPES[qtype.name][0]
    gen = torch.Generator().manual_seed(2)
    n, k = 48, 512
    packed = pack_int8(_quantize(torch.randn(n, k, generator=gen).numpy(), qtype), qtype.name, k)
    for rows in (1, 3, 8, 9, 17):
        wide = torch.randn(rows, 2 * k, generator=gen).bfloat16()
        for x in (wide[:, :k].contiguous(), wide[:, k:]):  # the second: rows 2k apart
            want = ops.gguf_mm_packed(x.float(), *packed, kernel_type, QUANT_MAX_ROWS)
            got = ops.gguf_mm_packed(x, *packed, kernel_type, QUANT_MAX_ROWS)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16()), (rows, x.stride())
            out = torch.empty(rows, n)
            ops.gguf_linear_int8(out, x, *packed, kernel_type)
            assert torch.equal(out, want)


MIXED = {"q_proj": Q.Q4_0, "k_proj": Q.Q4_0, "v_proj": Q.Q4_0, "o_proj": Q.Q8_0,
         "gate_proj": Q.Q4_1, "up_proj": Q.Q4_1, "down_proj": Q.Q4_1}


def _model_dir(tmp_path, types, tie: bool, hidden: int = 64, head_type=Q.Q8_0, layers: int = 2):
    hf = make_model("llama", seed=3, hidden=hidden, layers=layers, heads=4, kv_heads=2, tie=tie)
    write_gguf(hf, tmp_path / "model.gguf", types, head_type)
    hf.save_pretrained(tmp_path, safe_serialization=True)  # the de-quantized weights: the oracle's
    return hf


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def round_activations_like_int8(hf, projections: set[str]) -> None:
    """Make ``hf`` round the inputs of ``projections`` (module names' last part) as the int8 kernel does:
    per 32-block, d = amax / 127, q = round-half-even(x * 127 / amax), x' = q d, in float32. With it, HF
    computes exactly the int8 kernel's products up to summation order, so it stays the oracle."""
    def round_input(module, args):
        x = args[0]
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
        amax = blocks.abs().amax(-1, keepdim=True)
        q = torch.round(blocks * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))).clamp(-128, 127)
        return (q * (amax / 127.0)).reshape(x.shape),

    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in projections:
            module.register_forward_pre_hook(round_input)


ALL_PROJECTIONS = {*PROJ, "lm_head"}
PROMPTS = [[5, 9, 200, 17], list(range(3, 60)), [300] * 3, list(range(100, 140, 3))]


@pytest.mark.parametrize("tie,types,eager,int8", [
    (False, MIXED, True, False),
    (True, {p: Q.Q4_1 for p in PROJ}, False, False),  # the default model's kind: Q4_1, a tied Q8_0 head
    (False, MIXED, True, True),
    (True, {p: Q.Q4_1 for p in PROJ}, False, True),
], ids=["float32-mixed-untied-eager", "float32-q4_1-tied-compiled", "int8-mixed-untied-eager",
        "int8-q4_1-tied-compiled"])
def test_greedy_matches_hf_on_dequantized_weights(tmp_path, monkeypatch, tie, types, eager, int8):
    """float32: the same values, summed in another order. int8: HF rounds each projection's input as
    the kernel does (round_activations_like_int8), so again the same values."""
    import engine.model.quant as quant
    if int8 and not _int8_ready():
        pytest.skip("the int8 kernel needs AVX-512 VNNI")
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", int8)
    hf = _model_dir(tmp_path, types, tie)
    if int8:
        round_activations_like_int8(hf, ALL_PROJECTIONS)
    llm = LLM(str(tmp_path), quantization="gguf", dtype="float32", block_size=8, num_kv_blocks=64,
              max_num_seqs=4, enforce_eager=eager)
    runner = llm.engine.runner
    layers = [m for m in runner.model.modules() if getattr(m, "qweight", None) is not None]
    # qkv, o, gate_up, down per layer, the LM head and the embedding (a Q8_0 token_embd when tied)
    assert len(layers) == 2 * 4 + 1 + tie
    assert all((m.qscale is not None) == int8 for m in layers)
    assert all(m.weight.numel() == 0 for m in layers)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 8) for p in PROMPTS]
    _assert_prompt_logprobs_close(llm, hf, INT8_NATS if int8 else 1e-4)
    llm.engine.block_manager.check_invariants()


INT8_NATS = 0.05
"""Log-probability error allowed on int8 paths against HF with round_activations_like_int8. Each layer
agrees to float32 summation order (1e-7 relative), but such a difference can flip one activation's
int8 rounding in a later layer, one step of amax / 127: measured up to 0.013 nats (0.028 with Q4_K's
float16-rounded scales). Without the rounding in HF the same paths were 0.15-0.31 nats off."""


def _assert_prompt_logprobs_close(llm, hf, tolerance: float = 1e-4) -> None:
    """Every prompt token's log-probability, teacher-forced, within ``tolerance`` nats of HF's."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
        got = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
        err = max(abs(g - want[i - 1, prompt[i]].item()) for i, g in enumerate(got, start=1))
        assert err < tolerance, (prompt[:4], err)


Q4_K_M = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.F32,
          "gate_proj": Q.Q5_0, "up_proj": Q.Q5_1, "down_proj": Q.Q6_K}
"""llama.cpp's Q4_K_M mix: Q6_K for v and down beside Q4_K (the fused qkv layer holds two types), Q5
where its quantizer falls back from a k-quant, and an unquantized layer, which keeps the checkpoint's
weights."""


@pytest.mark.parametrize("eager,int8", [(True, False), (False, False), (True, True)],
                         ids=["float32-eager", "float32-compiled", "int8-eager"])
def test_k_quants_greedy_match_hf(tmp_path, monkeypatch, eager, int8):
    """Q4_K, Q6_K (256-weight super-blocks), Q5_0 and Q5_1 through the float32 kernel: exactly the
    file's values, so greedy tokens are HF's on the de-quantized weights. With int8 activations every
    one of them is packed: Q4_K's sub-blocks as Q4_1 blocks and Q6_K's with a scale per 16 weights
    (their scales rounded to float16, which HF then takes too), Q5_0's as Q8_0's, Q5_1's as bytes with
    their minimum; HF rounds their inputs as the kernel does."""
    import engine.model.quant as quant
    if int8 and not _int8_ready():
        pytest.skip("the int8 kernel needs AVX-512 VNNI")
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", int8)
    hf = _model_dir(tmp_path, Q4_K_M, tie=False, hidden=256, head_type=Q.Q6_K)
    if int8:
        round_activations_like_int8(hf, ALL_PROJECTIONS - {"o_proj"})  # o_proj: F32 in the file, dense
    llm = LLM(str(tmp_path), quantization="gguf", dtype="float32", block_size=8, num_kv_blocks=64,
              max_num_seqs=4, enforce_eager=eager)
    model = llm.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    q4k = int(Q.Q4_1 if int8 else Q.Q4_K)  # the kernel's type: the packed form's
    assert [p.qtype for p in qkv.qparts] == [q4k, q4k, int(Q.Q6_K)] and qkv.weight.numel() == 0
    assert [p.qscale is not None for p in qkv.qparts] == [int8] * 3
    assert [p.qscale is not None for p in model.layers[0].mlp.gate_up_proj.qparts] == [int8] * 2  # Q5_0, Q5_1
    assert (model.lm_head.qscale is not None) == int8 == (model.layers[0].mlp.down_proj.qscale is not None)
    assert model.layers[0].self_attn.o_proj.qtype is None  # dense (oneDNN-packed here)
    assert model.lm_head.qtype == int(Q.Q6_K) and model.embed_tokens.qtype is None  # an F32 token_embd
    if int8:  # HF takes the weights the kernel reads: k-quants' scales rounded to float16 when packed
        for layer, hf_layer in zip(model.layers, hf.model.layers):
            a, m = hf_layer.self_attn, hf_layer.mlp
            for part, proj in [*zip(layer.self_attn.qkv_proj.qparts, (a.q_proj, a.k_proj, a.v_proj)),
                               *zip(layer.mlp.gate_up_proj.qparts, (m.gate_proj, m.up_proj)),
                               (layer.mlp.down_proj, m.down_proj), (model.lm_head, hf.lm_head)]:
                packed = (part.qweight, part.qscale, part.qmin, part.qtype)
                proj.weight.data.copy_(_ops().gguf_dequantize_packed(*packed, proj.weight.shape[1]))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 8) for p in PROMPTS]
    _assert_prompt_logprobs_close(llm, hf, INT8_NATS if int8 else 1e-4)
    llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_lora_over_gguf_blocks_equals_hf_peft(tmp_path, monkeypatch, eager):
    """An adapter's delta is added to the quantized base's product, as to a dense one: HF + PEFT on the
    de-quantized weights is the oracle, base and adapter rows in one batch."""
    import engine.model.quant as quant
    from peft import PeftModel

    from tests.factories import make_lora_dir
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", False)
    (tmp_path / "base").mkdir()
    hf = _model_dir(tmp_path / "base", MIXED, tie=True)
    adapter = make_lora_dir(tmp_path / "base", tmp_path / "lora", rank=4, seed=2, scale=0.5)
    prompt = PROMPTS[1]
    want = [_hf_greedy(hf, prompt, 8), _hf_greedy(PeftModel.from_pretrained(hf, adapter).eval(), prompt, 8)]
    assert want[0] != want[1]
    llm = LLM(str(tmp_path / "base"), quantization="gguf", dtype="float32", block_size=8, num_kv_blocks=64,
              max_num_seqs=4, enforce_eager=eager, lora=dict(adapters={"a": str(adapter)}, max_lora_rank=4))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora=[None, "a"])
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    llm.engine.block_manager.check_invariants()


def test_tensor_parallel_ranks_take_whole_blocks(tmp_path):
    """tp 2: q/k/v, gate/up and the vocabulary split by rows, o and down by whole blocks of every row;
    the tokens are tp 1's on the same file."""
    from engine.model.quant import GGUFTensor
    _model_dir(tmp_path, MIXED, tie=True)
    options = dict(quantization="gguf", dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **options).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **options)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        rank0 = llm.engine.runner.model
        # rank 0's share: 2 of 4 q heads and 1 of 2 KV heads (16 features each), half of o's input blocks
        columns = [m.qweight.shape[0] * (16 if m.qscale is not None else 1)
                   for m in (rank0.layers[0].self_attn.qkv_proj, rank0.lm_head)]
        assert columns == [4 * 16, 256]
        o = rank0.layers[0].self_attn.o_proj  # Q8_0 over 32 input features: one block a row, 34 bytes or packed
        assert o.qweight.shape[1] == (512 if o.qscale is not None else 34)
    finally:
        llm.shutdown()
    assert got == want
    rows = np.zeros((4, 2 * 144), np.uint8)  # Q4_K: 512 input features in two super-blocks
    assert GGUFTensor("w", "Q4_K", rows).input_slice(256, 256).rows.shape == (4, 144)
    with pytest.raises(ModelLoadError, match=r"w \(Q4_K\): tensor parallelism splits .* at 128, 256, inside"):
        GGUFTensor("w", "Q4_K", rows).input_slice(128, 128)


def test_layers_match_dequantized_model(tmp_path, monkeypatch):
    import engine.model.quant as quant
    from engine.model.quant import attach_gguf
    monkeypatch.setattr(quant, "INT8_ACTIVATIONS", False)
    hf = _model_dir(tmp_path, MIXED, tie=False)
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=4, enforce_eager=True)
    model = llm.engine.runner.model
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    dense = model.lm_head(hidden), model.layers[0].mlp(hidden), model.layers[1].self_attn.qkv_proj(hidden)
    attach_gguf(model, tmp_path / "model.gguf")
    quantized = model.lm_head(hidden), model.layers[0].mlp(hidden), model.layers[1].self_attn.qkv_proj(hidden)
    for got, expected in zip(quantized, dense):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    del hf


def test_bad_files_name_the_tensor(tmp_path):
    from engine.model.quant import GGUFFile
    _model_dir(tmp_path, {**MIXED, "down_proj": Q.MXFP4}, tie=False)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_down\.weight is MXFP4; .* keeps F32, F16, BF16 dense"):
        LLM(str(tmp_path), quantization="gguf", dtype="float32", num_kv_blocks=16, enforce_eager=True)
    _model_dir(tmp_path, {**MIXED, "up_proj": Q.F16}, tie=False)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight unquantized beside quantized blk\.0\.ffn_gate"):
        LLM(str(tmp_path), quantization="gguf", dtype="float32", num_kv_blocks=16, enforce_eager=True)
    file = GGUFFile(tmp_path / "model.gguf")
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight \(Q4_0\) holds .* expects \[32, 64\]"):
        file.quantized("blk.0.attn_q.weight", 32, 64)
    with pytest.raises(ModelLoadError, match="no tensor blk.9.attn_q.weight"):
        file.quantized("blk.9.attn_q.weight", 64, 64)
    data = (tmp_path / "model.gguf").read_bytes()
    (tmp_path / "model.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        GGUFFile(tmp_path / "model.gguf")
    (tmp_path / "model.gguf").unlink()
    with pytest.raises(ModelLoadError, match="holds 0 \\*.gguf files"):
        LLM(str(tmp_path), quantization="gguf", dtype="float32", num_kv_blocks=16, enforce_eager=True)
