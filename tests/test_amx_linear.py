"""bfloat16 linear layers on AMX tiles (engine/csrc/amx_linear.cpp): decode-sized and mid-sized GEMMs.

Checked against float32 matmuls, against oneDNN's bits at decode sizes, and inside an engine against
one without it. Needs a CPU with AMX (the reason is given
where it has none).
"""

from __future__ import annotations

import pytest
import torch

from engine.cpu_kernels import amx_linear_problem, load_kernel
from engine.model.layers import AMX_MAX_ROWS, linear, pack_amx, pack_weight

pytestmark = pytest.mark.skipif(amx_linear_problem() is not None, reason=f"no AMX: {amx_linear_problem()}")


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 8, 13, 16, 17, 40, 300, 512, 530])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 64), (112, 96), (960, 576), (576, 1536)])
def test_every_row_count_and_column_remainder_matches_a_float32_matmul(rows, n, k):
    """Column blocks come in groups of four (48 and 112 columns leave groups of three), rows come 16 at
    a time with a remainder tile, in panels of 512 (530 rows: two panels)."""
    weight, x = _bf16(n, k, seed=n), _bf16(rows, k, seed=k + rows)
    out = x.new_empty(rows, n)
    load_kernel().amx_linear(out, x, pack_amx(weight))
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    want = x.float() @ weight.float().T  # fp32 accumulation, rounded once: at most one bf16 step apart
    torch.testing.assert_close(out.float(), want.bfloat16().float(), rtol=2 ** -7, atol=1e-3 * k ** 0.5)


def test_at_decode_sizes_it_gives_onednns_bits_and_takes_rows_with_a_stride():
    weight = _bf16(576, 1536, seed=1)
    wide = _bf16(16, 2 * 1536, seed=2)
    x = wide[:, :1536]  # rows 2 x K apart, as a slice of a fused projection would be
    onednn = torch.ops.mkldnn._linear_pointwise(x.contiguous(), pack_weight(weight, 16), None, "none", [], "")
    assert torch.equal(linear(x, weight, None, None, pack_amx(weight)), onednn)
    bias = _bf16(576, seed=3)
    assert torch.equal(linear(x, weight, bias, None, pack_amx(weight)), onednn + bias)


def test_inputs_past_its_row_limit_go_to_onednn():
    weight, x = _bf16(64, 64, seed=4), _bf16(AMX_MAX_ROWS + 1, 64, seed=5)
    packed = pack_weight(weight, 16)
    got = linear(x, weight, None, packed, pack_amx(weight))
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))


def test_shapes_it_cannot_tile_are_left_to_onednn_and_bad_calls_name_the_problem():
    assert pack_amx(_bf16(40, 64, seed=6)) is None  # N not a multiple of 16
    assert pack_amx(_bf16(64, 48, seed=7)) is None  # K not a multiple of 32
    weight, x = _bf16(64, 64, seed=8), _bf16(4, 64, seed=9)
    amx_linear = load_kernel().amx_linear
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        amx_linear(torch.empty(4, 64), x.float(), pack_amx(weight))
    with pytest.raises(RuntimeError, match="does not match"):
        amx_linear(torch.empty(4, 32, dtype=torch.bfloat16), x, pack_amx(weight))
    with pytest.raises(RuntimeError, match="as many rows"):
        amx_linear(torch.empty(5, 64, dtype=torch.bfloat16), x, pack_amx(weight))
    with pytest.raises(RuntimeError, match="rows of x and out must be contiguous"):
        amx_linear(torch.empty(4, 64, dtype=torch.bfloat16), _bf16(64, 4, seed=10).T, pack_amx(weight))


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_an_engine_agrees_with_and_without_it(tmp_path, monkeypatch, enforce_eager):
    """Greedy paths and logprobs of tests/test_gpu_engine.py's prompts (2-280 tokens) agree with an engine
    that runs oneDNN only. Past 16 rows oneDNN splits K its own way, so a last bit may differ: the paths
    may part at a near-tie, as two bf16 backends may."""
    import engine.runner
    from engine import LLM
    from tests.factories import make_model_dir
    from tests.test_gpu_engine import assert_bf16_paths_agree, greedy_logprobs

    path = make_model_dir(tmp_path, "llama", seed=3, with_tokenizer=False, hidden=128, heads=8, kv_heads=2)
    kw = dict(device="cpu", dtype="bfloat16", block_size=16, num_kv_blocks=256, enforce_eager=enforce_eager)
    llm = LLM(str(path), **kw)
    layer = llm.engine.runner.model.layers[0]
    assert layer.mlp.gate_up_proj.amx is not None and layer.self_attn.o_proj.amx is not None
    with_amx = greedy_logprobs(llm)
    monkeypatch.setattr(engine.runner, "amx_supported", lambda device, dtype: False)
    without = LLM(str(path), **kw)
    assert without.engine.runner.model.layers[0].mlp.gate_up_proj.amx is None
    assert_bf16_paths_agree(with_amx, greedy_logprobs(without))
