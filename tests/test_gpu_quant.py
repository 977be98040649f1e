"""FP8 and INT4 weights kept quantized (engine.model.gpu_quant): the Triton kernels against the
de-quantized weights, each checkpoint layout's repacking against a packer written from the format's
description, and the rounding of dense weights. On CPU the kernels run in Triton's interpreter
(tests/conftest.py); the ``gpu`` tests run the compiled kernels and torch._scaled_mm."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ModelLoadError
from engine.model.gpu_quant import (AWQ_ORDER, FP8_MAX, QuantScheme, checkpoint_scheme, fp8_from_dense,
                                    fp8_scaled_mm, int4_from_dense, pack_rows, unpack_columns, unpack_rows)
from engine.model.quant_checkpoint import _fp8_parts, _int4_parts
from engine.model.triton_quant import Tile, fp8_mm, int4_mm, plan

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _device(name: str) -> torch.device:
    if name == "cuda":
        return torch.device("cuda")
    from engine.model.gpu_quant import interpreted
    if not interpreted():
        pytest.skip("the Triton kernels run on CPU only in its interpreter (TRITON_INTERPRET=1)")
    return torch.device("cpu")


def _check(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, dtype: torch.dtype, tol: float | None = None) -> None:
    """Against ``x @ dense.T`` in float64: float32 (interpreter, IEEE dots) agrees to rounding; bfloat16
    rounds each de-quantized weight (2^-9 relative) and the inputs, summed over K terms."""
    ref = (x.double() @ dense.double().t())
    tol = tol or (1e-4 if dtype == torch.float32 else 2e-2)
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= tol * scale, (out.double() - ref).abs().max().item() / scale


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int4_kernel_matches_dequantized_weights(rows):
    _device("cpu")
    torch.manual_seed(0)
    weight = torch.randn(96, 256) * 0.05
    wq = int4_from_dense(weight, group=64)
    x = torch.randn(rows, 256)
    _check(wq(x), x, wq.dequantize(), torch.float32)
    # Rounding to the nearest of 16 levels, with the zero point itself rounded to a level: no weight
    # moves by more than one step of its group, and most by at most half of one.
    step = wq.scales.float().repeat_interleave(64, 0).t()
    err = (wq.dequantize() - weight).abs()
    assert (err <= step + 1e-6).all() and (err <= step / 2 + 1e-6).float().mean() > 0.9


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fp8_kernel_per_channel_and_block(rows):
    _device("cpu")
    torch.manual_seed(1)
    weight = torch.randn(80, 384) * 0.1
    x = torch.randn(rows, 384)
    channel = fp8_from_dense(weight)
    _check(channel(x), x, channel.dequantize(), torch.float32)
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 of itself (relative), or of its scale.
    err = (channel.dequantize() - weight).abs()
    assert (err <= weight.abs() / 16 + channel.scale / 2).all()
    # 128 x 128 blocks of scales over a width that is no multiple of the block: edges are partial.
    blocks = torch.rand(1, 3) + 0.5
    codes = (torch.randn(80, 384) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    parts = [{"weight": codes, "weight_scale_inv": blocks}]
    block = _fp8_parts(["layer"], parts, QuantScheme("fp8", "fp8", block=(128, 128)))
    assert block.block == (1, 128)  # a block's scale repeated over its rows
    dense = codes.float() * blocks.repeat_interleave(128, 1)[:, :384]
    assert torch.equal(block.dequantize(), dense)
    _check(block(x), x, dense, torch.float32)


@pytest.mark.parametrize("tile", [Tile(1, 32, 64, gemv=True), Tile(4, 16, 32, gemv=True),
                                  Tile(2, 16, 32, split=False, gemv=True)])
def test_gemv_kernels_match_dequantized_weights(tile):
    """The register kernels for few rows: rows under, at and over ``block_m``; K split or not; K = 1,000
    masked; per-channel and 128 x 128 block scales; INT4 groups of 64 with zero points."""
    _device("cpu")
    torch.manual_seed(6)
    for rows in (1, 7):  # at or under block_m, and over it
        x = torch.randn(rows, 384)
        channel = fp8_from_dense(torch.randn(80, 384) * 0.1)
        _check(fp8_mm(x, channel.weight, channel.scale, 1, 384, tile), x, channel.dequantize(), torch.float32)
        codes = (torch.randn(80, 384) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        blocks = torch.rand(1, 3) + 0.5
        dense = codes.float() * blocks.repeat_interleave(128, 1)[:, :384]
        _check(fp8_mm(x, codes, blocks, 80, 128, tile), x, dense, torch.float32)
        w4 = int4_from_dense(torch.randn(96, 256) * 0.05, group=64)
        x4 = torch.randn(rows, 256)
        _check(int4_mm(x4, w4.qweight, w4.scales, w4.zeros, 64, tile), x4, w4.dequantize(), torch.float32)
    odd = fp8_from_dense(torch.randn(24, 1000) * 0.05)
    x = torch.randn(2, 1000)
    _check(fp8_mm(x, odd.weight, odd.scale, 1, 1000, tile), x, odd.dequantize(), torch.float32)


def test_split_k_plan_fills_the_gpu_and_keeps_tiles_whole():
    # A decode step on Llama-3.1-8B's down_proj: one row tile, 64 column tiles, K split to fill the SMs.
    tile, split = plan("int4", 1, 4096, 14336, 128, torch.device("cpu"))
    assert (tile.block_m, tile.block_n, tile.block_k) == (16, 64, 128) and split == 1  # the interpreter's 4 "SMs"
    if torch.cuda.is_available():
        tile, split = plan("int4", 16, 4096, 14336, 128, torch.device("cuda"))
        assert split > 1 and 14336 % tile.block_k == 0
    assert plan("fp8", 512, 4096, 4096, 128, torch.device("cpu"))[1] == 1  # a prefill chunk has tiles enough
    # A tuned tile whose K width does not divide the scale's falls back to one that does.
    assert plan("fp8", 4, 64, 4096, 64, torch.device("cpu"), Tile(16, 64, 128))[0].block_k == 64


def test_split_k_partial_sums_match():
    _device("cpu")
    torch.manual_seed(2)
    weight = torch.randn(16, 2048) * 0.05
    wq = int4_from_dense(weight)
    x = torch.randn(2, 2048)
    assert plan("int4", 2, 16, 2048, 128, x.device)[1] == 4  # one column tile: K split four ways
    _check(wq(x), x, wq.dequantize(), torch.float32)


def test_widths_tiles_do_not_divide_and_uneven_splits():
    """K = 1,000: 16-wide tiles (masked along K), split eight ways with a short last split."""
    _device("cpu")
    torch.manual_seed(5)
    weight = torch.randn(16, 1000) * 0.05
    wq = fp8_from_dense(weight)
    x = torch.randn(3, 1000)
    tile, split = plan("fp8", 3, 16, 1000, 1000, x.device)
    assert tile.block_k == 16 and split == 8
    _check(wq(x), x, wq.dequantize(), torch.float32)
    w4 = int4_from_dense(torch.randn(24, 96) * 0.05)  # group 32: tiles of 32, K split in three
    x4 = torch.randn(2, 96)
    _check(w4(x4), x4, w4.dequantize(), torch.float32)


def _awq_pack(q: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's gemm packing, from its description: column ``8 j + c`` goes to nibble ``AWQ_ORDER[c]``
    of word ``j``. Written independently of gpu_quant's unpacking (a loop over nibbles)."""
    rows, cols = q.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(8):
        words |= q[:, c::8].to(torch.int64) << (4 * AWQ_ORDER[c])
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_pack_rows(q: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for i in range(8):
        words |= q[i::8].to(torch.int64) << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_pack_columns(q: torch.Tensor) -> torch.Tensor:
    return _gptq_pack_rows(q.t().contiguous()).t().contiguous()


def test_awq_and_gptq_layouts_repack_to_the_same_weights():
    torch.manual_seed(3)
    k, n, g = 256, 48, 128
    q = torch.randint(0, 16, (k, n))
    z = torch.randint(1, 16, (k // g, n))  # GPTQ's first format stores z - 1 in a nibble: z = 0 cannot be held
    s = (torch.rand(k // g, n) * 0.01 + 0.001).half()
    dense = ((q - z.repeat_interleave(g, 0)).float() * s.float().repeat_interleave(g, 0)).t()
    awq = {"qweight": _awq_pack(q), "qzeros": _awq_pack(z), "scales": s}
    gptq = {"qweight": _gptq_pack_rows(q), "qzeros": _gptq_pack_columns(z - 1), "scales": s,
            "g_idx": torch.arange(k, dtype=torch.int32) // g}
    for parts, scheme in ((awq, QuantScheme("int4", "awq", g)), (gptq, QuantScheme("int4", "gptq", g, zero_offset=1))):
        wq = _int4_parts(["mlp.down_proj"], [parts], scheme)
        assert torch.equal(wq.dequantize(), dense), scheme.source
    # Fused parts (q, k, v) join along the output features.
    fused = _int4_parts(["q_proj", "k_proj"], [awq, awq], QuantScheme("int4", "awq", g))
    assert torch.equal(fused.dequantize(), torch.cat([dense, dense]))
    assert torch.equal(unpack_rows(pack_rows(q)), q) and torch.equal(unpack_columns(_gptq_pack_columns(z)), z)


def test_fp8_parts_per_tensor_scales_become_per_channel():
    codes = [(torch.randn(n, 64) * 50).to(torch.float8_e4m3fn) for n in (32, 16, 16)]
    scales = [torch.tensor(0.5), torch.tensor([0.25]), torch.tensor(2.0)]
    wq = _fp8_parts(["q_proj", "k_proj", "v_proj"], [{"weight": c, "weight_scale": s} for c, s in zip(codes, scales)],
                    QuantScheme("fp8", "compressed-tensors"))
    assert wq.block is None and wq.scale.shape == (64, 1)
    assert torch.equal(wq.dequantize(), torch.cat([c.float() * s for c, s in zip(codes, scales)]))


def test_fp8_block_scales_of_parts_of_any_size_join():
    """Parts of 256, 64 and 128 rows over 256 inputs, with 128 x 128 blocks: each block's scale is
    repeated over its rows (k_proj's 64 rows are half a block), and a part of one block is a block
    scale (the config names blocks), not a per-tensor one."""
    sizes = (256, 64, 128)
    codes = [(torch.randn(n, 256) * 50).to(torch.float8_e4m3fn) for n in sizes]
    scales = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0]]), torch.tensor([[7.0, 8.0]])]
    wq = _fp8_parts(["q_proj", "k_proj", "v_proj"], [{"weight": c, "weight_scale_inv": s} for c, s in zip(codes, scales)],
                    QuantScheme("fp8", "fp8", block=(128, 128)))
    assert wq.block == (1, 128) and wq.scale.shape == (448, 2)
    want = torch.cat([c.float() * s.repeat_interleave(128, 0)[:c.shape[0]].repeat_interleave(128, 1)
                      for c, s in zip(codes, scales)])
    assert torch.equal(wq.dequantize(), want)
    # A per-channel part beside block-scaled ones keeps its scale in every column.
    mixed = _fp8_parts(["gate_proj", "up_proj"], [{"weight": codes[1], "weight_scale": torch.full((64, 1), 0.5)},
                                                  {"weight": codes[2], "weight_scale_inv": scales[2]}],
                       QuantScheme("fp8", "compressed-tensors", block=(128, 128)))
    assert torch.equal(mixed.dequantize(), torch.cat([codes[1].float() * 0.5, want[320:]]))


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 8}, "only 4"),
    ({"quant_method": "gptq", "desc_act": True}, "desc_act"),
    ({"quant_method": "awq", "version": "gemv"}, "gemm"),
    ({"quant_method": "gptq", "group_size": 100}, "multiple of 32"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "float-quantized"),
    ({"quant_method": "bitsandbytes"}, "not supported"),
])
def test_unsupported_checkpoints_are_named(config, message):
    with pytest.raises(ModelLoadError, match=message):
        checkpoint_scheme({"quantization_config": config})


def test_mismatched_layouts_name_the_layer():
    good = {"qweight": torch.zeros(256, 4, dtype=torch.int32), "qzeros": torch.zeros(2, 4, dtype=torch.int32),
            "scales": torch.ones(2, 32).half()}
    with pytest.raises(ModelLoadError, match="mlp.down_proj.*scales"):
        _int4_parts(["mlp.down_proj"], [{**good, "scales": torch.ones(4, 32).half()}], QuantScheme("int4", "awq"))
    with pytest.raises(ModelLoadError, match="lacks qzeros"):
        _int4_parts(["mlp.down_proj"], [{k: v for k, v in good.items() if k != "qzeros"}], QuantScheme("int4", "awq"))
    with pytest.raises(ModelLoadError, match="act-order"):
        _int4_parts(["o"], [{"qweight": torch.zeros(32, 32, dtype=torch.int32), "qzeros": torch.zeros(2, 4, dtype=torch.int32),
                           "scales": torch.ones(2, 32).half(), "g_idx": torch.arange(256).flip(0) // 128}],
                    QuantScheme("int4", "gptq"))
    with pytest.raises(ModelLoadError, match="without weight_scale"):
        _fp8_parts(["o"], [{"weight": torch.zeros(8, 8).to(torch.float8_e4m3fn)}], QuantScheme("fp8", "fp8"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_kernels_on_cuda(rows):
    torch.manual_seed(4)
    weight = torch.randn(4096, 1024, device="cuda") * 0.02
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    for wq in (fp8_from_dense(weight), int4_from_dense(weight)):
        _check(wq(x), x, wq.dequantize(), torch.bfloat16)
    channel = fp8_from_dense(weight)
    if torch.cuda.get_device_capability() >= (8, 9):
        # W8A8 also rounds every activation to e4m3 (3 mantissa bits, 2^-4 relative): the H200 gave
        # 2.4-2.6 % of the largest output on these shapes, against 2 % for bfloat16 activations.
        _check(fp8_scaled_mm(x, channel.weight, channel.scale), x, channel.dequantize(), torch.bfloat16, 5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization, dtype", [("fp8", "bfloat16"), ("fp8", "float32"), ("int4", "bfloat16"),
                                                 ("int4", "float32")])
def test_engine_on_cuda_captured_steps_equal_eager_ones(tiny_model_dir, quantization, dtype):
    """The quantized layers inside CUDA graphs give the tokens the same layers give eagerly; in float32
    compiled too (in bfloat16 inductor's fusions round elsewhere than eager modules do)."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    prompts = [{"prompt_token_ids": [5 + i, 9, 14 + 2 * i, 3, 7]} for i in range(3)]
    tokens = []
    modes = ((True, False), (False, False)) + (((False, True),) if dtype == "float32" else ())
    for eager, compiled in modes:
        llm = LLM(str(tiny_model_dir), quantization=quantization, device="cuda", dtype=dtype, enforce_eager=eager,
                  compile_model=compiled, num_kv_blocks=64, max_num_seqs=4)
        runner = llm.engine.runner
        assert runner.quantization == quantization and (runner.graphs is None) == eager
        assert (runner.compiled is not None) == compiled
        assert runner.model.layers[0].mlp.down_proj.wq is not None
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        tokens.append([o.outputs[0].token_ids for o in outs])
        del llm
    assert all(t == tokens[0] for t in tokens[1:])
