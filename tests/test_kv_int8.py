"""The int8 KV cache (``kv_cache_dtype="int8"``, engine/csrc/kv_layout.h): what the writer stores,
the kernel over it against attention on the same dequantized K/V, the attention contract within the
quantization's error, the memory it saves, clear errors, and greedy text on the real model."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine import cpu_kernels
from engine.attention import create_backend
from engine.attention import cpu as cpu_attention
from engine.config import CacheConfig
from engine.cpu_features import cpu_flags
from tests.test_attention import CPU, run_contract

# What the kernel scores int8 keys with (vLLM's 8-bit CPU cache needs AVX-512 too); CI's hosts have it.
needs_vnni = pytest.mark.skipif("avx512_vnni" not in cpu_flags(), reason="the int8 cache needs AVX-512 VNNI")

# Keys and values are N(0, 1) in the contract: an element's error is at most max|x| / 254 (~0.015 at
# head_dim 64), the query's as much again, and attention outputs, averages of such values under
# probabilities that move as little, measured at most ~0.015 off the unquantized result.
CONTRACT_TOLERANCE = 3e-2
# The same roundings as the kernel's, up to float32 sums in another order and a weight one 15-bit step
# off where the kernel's exp and torch's differ in the last bit (measured up to 1.2e-5).
EXACT = {torch.float32: 5e-5, torch.bfloat16: 2e-2}


def _kernel():
    return cpu_kernels.load_kernel()


def _backend(heads, kv_heads, head_dim, block_size, dtype):
    return create_backend("cpu", CPU, heads, kv_heads, head_dim, block_size, dtype, kv_cache_dtype="int8")


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (10, 1)], ids=["gqa3", "mha", "mqa10"])
@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_int8_cache_keeps_the_attention_contract(block_size, heads, kv_heads, dtype):
    """Decodes, short and long chunks after a cached prefix (the long ones read the cache back through
    read_context into SDPA) and first chunks, against exact attention on the unquantized K/V."""
    rows = cpu_attention.SDPA_MIN_ROWS
    run_contract(_backend(heads, kv_heads, 64, block_size, dtype), CPU, block_size, dtype, CONTRACT_TOLERANCE,
                 heads, kv_heads, 64, contexts=(37, 300, 5, 0, 130, 64, 17), new=(1, rows, 200, 70, rows - 1, 1, 3))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_writer_stores_int8_values_and_a_scale_per_token_and_head(dtype):
    blocks, block_size, kv_heads, head_dim, tokens = 5, 16, 3, 32, 11
    backend = _backend(kv_heads, kv_heads, head_dim, block_size, dtype)
    k_cache, v_cache = backend.allocate_cache(blocks, dtype, CPU)
    assert k_cache.dtype == torch.int8 and k_cache.shape == (blocks, kv_heads, block_size * (head_dim + 4))
    k = (torch.randn(tokens, kv_heads, head_dim) * torch.logspace(-3, 2, tokens)[:, None, None]).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    k[3, 1] = 0  # a row of zeros: scale 0, values 0, no division by zero
    slots = torch.randperm(blocks * block_size)[:tokens]
    _kernel().write_kv(k_cache, v_cache, k, v, slots)
    for cache, x in ((k_cache, k), (v_cache, v)):
        data = cache[..., :head_dim * block_size]
        scales = cache[..., head_dim * block_size:].contiguous().view(torch.float32)  # [blocks, kv_heads, block]
        block, offset = slots // block_size, slots % block_size
        scale = scales[block, :, offset]  # [tokens, kv_heads]
        peak = x.float().abs().amax(-1)
        torch.testing.assert_close(scale, peak / 127, rtol=1e-6, atol=0)
        if cache is k_cache:  # K blocks are [head_dim / 4, block_size, 4] of int8 + 128
            grouped = data.view(torch.uint8).view(blocks, kv_heads, head_dim // 4, block_size, 4).int() - 128
            values = grouped[block, :, :, offset].flatten(-2)
        else:  # V blocks are [block_size / 2, head_dim, 2]: a token pair side by side in each dimension
            paired = data.view(blocks, kv_heads, block_size // 2, head_dim, 2)
            values = paired[block, :, offset // 2, :, offset % 2]
        assert values.abs().amax(-1)[peak > 0].eq(127).all() and scale.isfinite().all()
        error = (values.float() * scale[..., None] - x.float()).abs()
        assert (error <= scale[..., None] / 2 * (1 + 1e-5) + 1e-12).all()
    zero_block, zero_offset = int(slots[3]) // block_size, int(slots[3]) % block_size
    zero_key = k_cache[zero_block, 1, :head_dim * block_size].view(torch.uint8).view(-1, block_size, 4)[:, zero_offset]
    assert zero_key.eq(128).all()
    assert k_cache[zero_block, 1, head_dim * block_size:].view(torch.float32)[zero_offset] == 0


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("length", [1, 21, 47, 300])
def test_kernel_equals_attention_over_the_dequantized_cache(length, dtype):
    """The kernel scores int8 keys against the query quantized per head, applies each token's key scale
    to its score, and weighs the int8 values by probability x value scale in 15 bits: against dense
    attention over read_context's dequantized K/V with the same roundings it agrees to float32 rounding.
    Slots past the request's last token hold garbage (their scales are NaN) and must not count."""
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    backend = _backend(heads, kv_heads, head_dim, block_size, dtype)
    k_cache, v_cache = backend.allocate_cache(40, dtype, CPU)
    k_cache.fill_(-1)  # 0xffffffff: a NaN scale in every slot never written
    v_cache.fill_(-1)
    k, v = (torch.randn(length, kv_heads, head_dim).to(dtype) for _ in range(2))
    rng = random.Random(length)
    need = -(-length // block_size)
    blocks = torch.tensor(rng.sample(range(40), need), dtype=torch.int32)
    slots = blocks.long()[torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size
    _kernel().write_kv(k_cache, v_cache, k, v, slots)
    q = torch.randn(1, heads, head_dim).to(dtype)
    out = torch.empty_like(q)
    _kernel().paged_attention(out, q, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32),
                              torch.tensor([length], dtype=torch.int32), blocks[None], 0.125)
    keys, values = backend.read_context(k_cache, v_cache, blocks, length, torch.float32)
    group = heads // kv_heads
    qf = q[0].float() * 0.125
    peak = qf.abs().amax(-1, keepdim=True)
    qf = (qf * (127 / peak)).round().clamp(-127, 127) * (peak / 127)  # as the kernel quantizes it
    scores = torch.einsum("hd,thd->ht", qf, keys.repeat_interleave(group, 1))
    # The kernel weighs values by probability x value scale, rounded to 15 bits of the row's largest.
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    token = torch.arange(length)
    v_scale = v_cache[blocks.long()[token // block_size], :, head_dim * block_size:].contiguous().view(torch.float32)
    v_scale = v_scale[token, :, token % block_size].repeat_interleave(group, 1).T  # [heads, tokens]
    weight = e * v_scale
    peak = weight.amax(-1, keepdim=True)
    weight = (weight * (32767 / peak)).round() * (peak / 32767) / v_scale.clamp_min(1e-30)
    want = torch.einsum("ht,thd->hd", weight, values.repeat_interleave(group, 1)) / e.sum(-1, keepdim=True)
    torch.testing.assert_close(out[0].float(), want, atol=EXACT[dtype], rtol=EXACT[dtype])


@needs_vnni
def test_int8_blocks_take_68_bytes_a_token_and_head_and_the_pool_grows():
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    plain = create_backend("cpu", CPU, heads, kv_heads, head_dim, block_size, torch.bfloat16)
    int8 = _backend(heads, kv_heads, head_dim, block_size, torch.bfloat16)
    assert plain.token_bytes(torch.bfloat16) == 2 * kv_heads * head_dim * 2
    assert int8.token_bytes(torch.bfloat16) == 2 * kv_heads * (head_dim + 4)
    assert int8.bytes_per_block(torch.bfloat16) == block_size * int8.token_bytes(torch.bfloat16)
    k, v = int8.allocate_cache(3, torch.bfloat16, CPU)
    assert k.numel() + v.numel() == 3 * int8.bytes_per_block(torch.bfloat16)


@needs_vnni
def test_engine_sizes_its_pool_in_int8_bytes(tiny_model_dir):
    budget_gb = 0.01

    def runner(kv):
        llm = LLM(str(tiny_model_dir), device="cpu", dtype="bfloat16", kv_cache_memory_gb=budget_gb, kv_cache_dtype=kv,
                  max_num_seqs=256)
        return llm.engine.runner

    plain, int8 = runner("auto"), runner("int8")
    assert plain.kv_caches[0][0].dtype == torch.bfloat16 and int8.kv_caches[0][0].dtype == torch.int8
    for r in (plain, int8):
        assert r.num_blocks == int(budget_gb * (1 << 30) // (r.backend.bytes_per_block(torch.bfloat16) * r.num_layers))
    head_dim = int8.backend.head_dim  # 16 here: 40 bytes a token and head against 64
    assert int8.backend.token_bytes(torch.bfloat16) / plain.backend.token_bytes(torch.bfloat16) == (
        (head_dim + 4) / (2 * head_dim))


def test_asking_for_int8_where_it_cannot_run_names_the_option():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is read by the cpu attention backend only, not "
                                         "'torch'"):
        create_backend("torch", CPU, 4, 2, 64, 16, torch.float32, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs the cpu attention backend, which cannot run "
                                         "here: head_dim must be a multiple of 16"):
        create_backend("auto", CPU, 4, 2, 40, 16, torch.float32, kv_cache_dtype="int8")
    if "avx512_vnni" in cpu_flags():
        with pytest.raises(ValueError, match="block_size must be a multiple of 16"):
            create_backend("cpu", CPU, 4, 2, 64, 8, torch.float32, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype") as err:
        CacheConfig(kv_cache_dtype="fp8")
    assert "'auto'" in str(err.value) and "'int8'" in str(err.value)


@needs_vnni
def test_kernel_refuses_int8_caches_of_the_wrong_shape():
    q = torch.randn(1, 4, 64)
    k_cache = torch.zeros(4, 2, 16 * 68, dtype=torch.int8)
    args = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="K and V alike"):
        _kernel().paged_attention(torch.empty_like(q), q, k_cache, k_cache[:, :, :-68].contiguous(), *args)
    with pytest.raises(RuntimeError, match="head_dim must match"):
        _kernel().paged_attention(torch.empty_like(q), q, k_cache[..., :-1].contiguous(),
                                  k_cache[..., :-1].contiguous(), *args)
    with pytest.raises(RuntimeError, match="block_size must be a multiple of 16"):
        small = torch.zeros(4, 2, 8 * 68, dtype=torch.int8)
        _kernel().paged_attention(torch.empty_like(q), q, small, small, *args)
    k, v = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="K and V alike"):
        _kernel().write_kv(k_cache, k_cache[:, :1].contiguous(), k, v, torch.zeros(1, dtype=torch.long))


# The default model in float32, int8 K/V against float32 K/V over 4 x 48 greedy tokens: paths agreed
# to the last token but one split at a near-tie (top-2 gap 0.009 nats), logprobs at most 0.13 nats
# apart along the way (measured). A split must be where the reference is unsure by twice that.
INT8_NOISE = 0.26


@needs_vnni
@pytest.mark.slow
def test_default_model_greedy_text_with_int8_kv_follows_the_unquantized_cache(default_model_dir):
    prompts = [[{"role": "user", "content": "What is the capital of France?"}],
               [{"role": "user", "content": "Write a haiku about the sea."}], "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    runs = {}
    for kv in ("auto", "int8"):
        llm = LLM(str(default_model_dir), dtype="float32", max_num_seqs=4, block_size=16, num_kv_blocks=64,
                  kv_cache_dtype=kv)
        ids = [llm.tokenizer.apply_chat_template(p) if isinstance(p, list) else llm.tokenizer.encode(p)
               for p in prompts]
        runs[kv] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ids], params)]
    assert "Paris" in runs["int8"][0].text
    agreed = 0
    for got, want in zip(runs["int8"], runs["auto"]):
        same = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), len(want.token_ids))
        agreed += same
        for i in range(same):
            token = want.token_ids[i]
            assert got.logprobs[i][token] == pytest.approx(want.logprobs[i][token], abs=INT8_NOISE)
        if same < len(want.token_ids):
            top = sorted(want.logprobs[same].values(), reverse=True)
            assert top[0] - top[1] <= INT8_NOISE, f"paths split at token {same} where the reference is sure"
    assert agreed >= 0.75 * 48 * len(prompts)
