"""FP8 / INT4 weights kept quantized (engine.model.gpu_quant) through the whole engine, on CPU.

A tiny random Llama is rounded at load (``quantization: fp8 | int4``) or written here in each published
checkpoint layout (compressed-tensors FP8 per channel, Hugging Face FP8 in 128 x 128 blocks, AWQ gemm,
GPTQ), quantized round-to-nearest by this file and packed with the reference packers of
tests/test_gpu_quant.py. The oracle is HF transformers running the de-quantized weights in float32:
the Triton kernels (in Triton's interpreter here, IEEE float32 dots) multiply by exactly those values,
so greedy tokens agree and log-probabilities differ by summation order only (checked within 1e-4 nats).
Without the interpreter the same checkpoints load de-quantized into the dense layers.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.model.gpu_quant import FP8_MAX, QuantWeights, interpreted
from tests.factories import build_tokenizer, make_model
from tests.test_gpu_quant import _awq_pack, _gptq_pack_columns, _gptq_pack_rows

PROMPTS = [[5, 9, 200, 17], list(range(3, 30)), [300] * 3]
MAX_NEW = 6
OPTIONS = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=32, max_num_seqs=4)
"""On CPU wherever the tests run: with the interpreter the kernels run, without it the layers are dense."""
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": ("mlp.down_proj",)}
AWQ_GROUP, GPTQ_GROUP = 128, 32
"""Both divide the tiny model's input features (hidden 128, intermediate 256); two group sizes covered."""

needs_interpreter = pytest.mark.skipif(not interpreted(), reason="the kernels run on CPU only in Triton's interpreter")


# --- the tiny models and their oracle ------------------------------------------------------------

def _dense_dir(path):
    """hidden 128 (int4's group of 128 must divide every input width; the conftest's tiny model has
    64), 4 heads of 32 and 2 KV heads: fused q/k/v parts of unequal rows (128, 64, 64)."""
    hf = make_model("llama", seed=0, hidden=128, layers=2, heads=4, kv_heads=2)
    hf.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return _dense_dir(tmp_path_factory.mktemp("dense-gqa"))


def _hf_name(layer: int, proj: str) -> str:
    return f"model.layers.{layer}.{proj}.weight"


def _oracle(hf, weights: dict[str, torch.Tensor]):
    """A copy of ``hf`` whose linear layers hold ``weights`` (HF names -> float32 [N, K])."""
    hf = copy.deepcopy(hf)
    state = hf.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            assert state[name].shape == w.shape, name
            state[name].copy_(w)
    return hf.eval()


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _assert_matches_hf(llm, hf) -> None:
    """Greedy tokens equal HF's; every prompt token's log-probability within 1e-4 nats of HF's."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
        err = max(abs(out.prompt_logprobs[i][prompt[i]] - want[i - 1, prompt[i]].item())
                  for i in range(1, len(prompt)))
        assert err < 1e-4, (prompt[:4], err)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free == bm.num_blocks


def _split(module, hf_config, dense: torch.Tensor, fused: str) -> list[torch.Tensor]:
    """A fused layer's [N, K] weight back into its checkpoint parts (q, k, v; gate, up)."""
    if fused == "self_attn.qkv_proj":
        head_dim = hf_config.hidden_size // hf_config.num_attention_heads
        q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
        sizes = [q, kv, kv]
    elif fused == "mlp.gate_up_proj":
        sizes = list(module.out_sizes)
    else:
        sizes = [dense.shape[0]]
    assert sum(sizes) == dense.shape[0] == module.out_features
    return list(dense.split(sizes))


# --- rounding to each format (round-to-nearest), written from the formats' descriptions ----------------

def _fp8_channel(w):
    """compressed-tensors ``strategy: channel``: a float32 scale per output row, [N, 1]."""
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def _fp8_block(w, b: int = 128):
    """Hugging Face ``quant_method: fp8``: ``weight_scale_inv`` [ceil(N / b), ceil(K / b)], the factor
    that multiplies each b x b block's e4m3 codes back."""
    n, k = w.shape
    rows, cols = -(-n // b), -(-k // b)
    padded = torch.zeros(rows * b, cols * b)
    padded[:n, :k] = w
    scale = (padded.view(rows, b, cols, b).abs().amax((1, 3)) / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
    codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale}, codes.float() * full


def _int4_groups(w, g: int, sym: bool):
    """[N, K] -> codes q [K, N] 0..15, zero points z [K / g, N], float16 scales s [K / g, N] and the
    de-quantized [N, K] weight ``(q - z) * s``. Asymmetric (AWQ): min/max per group; symmetric (GPTQ):
    zero point 8, scale 2 amax / 15."""
    n, k = w.shape
    groups = w.t().reshape(k // g, g, n)
    if sym:
        s = (2 * groups.abs().amax(1) / 15).clamp(min=1e-8).half()
        z = torch.full_like(s, 8, dtype=torch.float32)
    else:
        lo, hi = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8).half()
        z = (-lo / s.float()).round().clamp(0, 15)
    q = ((groups / s.float()[:, None]).round() + z[:, None]).clamp(0, 15).reshape(k, n)
    dense = ((q - z.repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)).t().contiguous()
    return q.long(), z.long(), s, dense


def _awq(w, g=AWQ_GROUP):
    q, z, s, dense = _int4_groups(w, g, sym=False)
    return {"qweight": _awq_pack(q), "qzeros": _awq_pack(z), "scales": s}, dense


def _gptq(w, g=GPTQ_GROUP):
    q, z, s, dense = _int4_groups(w, g, sym=True)
    k = q.shape[0]
    return {"qweight": _gptq_pack_rows(q), "qzeros": _gptq_pack_columns(z - 1),  # stores zero - 1
            "scales": s, "g_idx": torch.arange(k, dtype=torch.int32) // g}, dense


FORMATS = {
    "compressed-tensors": (_fp8_channel, {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
        "ignore": ["lm_head"]}),
    "fp8": (_fp8_block, {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}),
    "awq": (_awq, {"quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP, "zero_point": True,
                   "version": "gemm"}),
    "gptq": (_gptq, {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "desc_act": False,
                     "sym": True}),
}


def write_checkpoint(dense_dir, hf, out, quantize, quant_config, drop=()):
    """``hf`` with every decoder projection quantized by ``quantize`` (``{suffix: tensor}``, de-quantized
    weight), written as the format's files name their tensors; the embedding, norms and LM head stay
    float32. Returns the de-quantized weights by HF name. ``drop``: tensor names left out (hostile)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    dequantized = {}
    for layer in range(hf.config.num_hidden_layers):
        for proj in PROJ:
            name = _hf_name(layer, proj)
            tensors, dequantized[name] = quantize(state.pop(name))
            state.update({f"{name.removesuffix('.weight')}.{suffix}": t.contiguous() for suffix, t in tensors.items()})
    save_file({k: v for k, v in state.items() if k not in drop}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config}, indent=2))
    for f in dense_dir.iterdir():  # the tokenizer and generation config
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    return dequantized


@pytest.fixture(scope="module")
def checkpoints(gqa, tmp_path_factory):
    """Each format's checkpoint, written once: fmt -> (directory, de-quantized weights, HF oracle)."""
    dense_dir, hf = gqa
    built = {}

    def get(fmt: str):
        if fmt not in built:
            out = tmp_path_factory.mktemp(fmt)
            quantize, quant_config = FORMATS[fmt]
            weights = write_checkpoint(dense_dir, hf, out, quantize, quant_config)
            built[fmt] = out, weights, _oracle(hf, weights)
        return built[fmt]
    return get


def _module(model, layer: int, name: str):
    return model.layers[layer].get_submodule(name)


# --- 1. a dense checkpoint rounded at load ---------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_dense_checkpoint_rounded_at_load_matches_hf(gqa, method):
    dense_dir, hf = gqa
    llm = LLM(str(dense_dir), quantization=method, **OPTIONS)
    runner = llm.engine.runner
    assert runner.quantization == method
    model = runner.model
    dequantized = {}
    for layer in range(hf.config.num_hidden_layers):
        for fused, parts in FUSED.items():
            module = _module(model, layer, fused)
            wq = module.wq
            assert isinstance(wq, QuantWeights) and wq.kind == method, (layer, fused)
            assert module.weight.numel() == 0 and module.packed is None, (layer, fused)
            assert (wq.out_features, wq.in_features) == (module.out_features, module.in_features)
            if method == "int4":
                assert wq.group == 128 and wq.qweight.dtype == torch.int32
            else:
                assert wq.weight.dtype == torch.float8_e4m3fn and wq.scale.shape == (module.out_features, 1)
            for proj, w in zip(parts, _split(module, hf.config, wq.dequantize(), fused)):
                dequantized[_hf_name(layer, proj)] = w
    # Rounding moved the weights (else this would test nothing), but not far.
    original = hf.state_dict()
    for name, w in dequantized.items():
        err = (w - original[name]).abs().max().item()
        assert 0 < err <= 0.1 * original[name].abs().max().item(), (name, err)
    # Only the decoder's linear layers: the LM head and the embedding stay dense.
    assert sum(isinstance(m, QuantWeights) for m in model.modules()) == 4 * hf.config.num_hidden_layers
    _assert_matches_hf(llm, _oracle(hf, dequantized))


# --- 2. published checkpoint layouts, detected from config.json ------------------------------------

@needs_interpreter
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_is_detected_and_matches_hf(checkpoints, fmt):
    path, weights, oracle = checkpoints(fmt)
    llm = LLM(str(path), **OPTIONS)  # no quantization option: config.json says
    runner = llm.engine.runner
    assert runner.quantization == fmt
    for layer in range(oracle.config.num_hidden_layers):
        for fused, parts in FUSED.items():
            module = _module(runner.model, layer, fused)
            wq = module.wq
            assert isinstance(wq, QuantWeights), (layer, fused)
            assert wq.kind == ("fp8" if fmt in ("fp8", "compressed-tensors") else "int4")
            assert module.weight.numel() == 0 and module.packed is None
            if fmt == "fp8":
                # Every layer's blocks, attention's single [1, 1] blocks too, held as a scale per row and
                # 128 inputs (gate/up [256, 128]: scales [2, 1]; down [128, 256]: [1, 2]).
                assert wq.block == (1, 128) and wq.scale.shape == (module.out_features, -(-module.in_features // 128))
            elif fmt == "compressed-tensors":
                assert wq.block is None and wq.scale.shape == (module.out_features, 1)
            else:
                assert wq.group == (AWQ_GROUP if fmt == "awq" else GPTQ_GROUP)
            # The repacked layer holds exactly the values written (parts joined along the outputs).
            expected = torch.cat([weights[_hf_name(layer, p)] for p in parts])
            assert torch.equal(wq.dequantize(), expected), (layer, fused)
    _assert_matches_hf(llm, oracle)


# --- 3. without the interpreter (a CPU host): de-quantized at load ----------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_without_kernels_checkpoint_loads_dequantized(checkpoints, monkeypatch, fmt):
    path, _, oracle = checkpoints(fmt)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not interpreted()
    llm = LLM(str(path), **OPTIONS)
    runner = llm.engine.runner
    assert runner.quantization == fmt
    for layer in range(oracle.config.num_hidden_layers):
        for fused in FUSED:
            module = _module(runner.model, layer, fused)
            assert module.wq is None and (module.weight.numel() > 0 or module.packed is not None), (layer, fused)
    assert not any(isinstance(m, QuantWeights) for m in runner.model.modules())
    _assert_matches_hf(llm, oracle)


def test_without_kernels_rounding_a_dense_checkpoint_is_refused(gqa, monkeypatch):
    dense_dir, _ = gqa
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for method in ("fp8", "int4"):
        with pytest.raises(ModelLoadError, match="CUDA"):
            LLM(str(dense_dir), quantization=method, **OPTIONS)


# --- 4. hostile checkpoints and options ------------------------------------------------------------

def test_awq_layer_without_zero_points_is_named(gqa, tmp_path):
    dense_dir, hf = gqa
    quantize, config = FORMATS["awq"]
    write_checkpoint(dense_dir, hf, tmp_path / "down", quantize, config, drop={"model.layers.1.mlp.down_proj.qzeros"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.down_proj.*lacks qzeros"):
        LLM(str(tmp_path / "down"), **OPTIONS)
    # A part of a fused layer: the fused layer and the part's position are named.
    write_checkpoint(dense_dir, hf, tmp_path / "k", quantize, config, drop={"model.layers.0.self_attn.k_proj.qzeros"})
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.k_proj: awq layer lacks qzeros"):
        LLM(str(tmp_path / "k"), **OPTIONS)


def test_quantization_option_against_the_checkpoint(gqa, checkpoints):
    dense_dir, _ = gqa
    with pytest.raises(ModelLoadError, match="no quantization_config"):
        LLM(str(dense_dir), quantization="awq", **OPTIONS)
    with pytest.raises(ModelLoadError, match="no quantization_config"):
        LLM(str(dense_dir), quantization="gptq", **OPTIONS)
    awq_dir = checkpoints("awq")[0]
    with pytest.raises(ModelLoadError, match=r"already quantized \(awq\)"):
        LLM(str(awq_dir), quantization="int8", **OPTIONS)
    with pytest.raises(ModelLoadError, match="already quantized"):
        LLM(str(awq_dir), quantization="fp8", **OPTIONS)
