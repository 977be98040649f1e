"""The CPU kernels refuse indices outside the cache or q (engine/csrc/checks.h): a bad slot, query
offset, length or block id raises a RuntimeError naming it, before anything is written or read,
instead of a segfault or a silent write into other memory. Unread padding of a block table row
passes, and the valid calls the bad ones are made from still match dense attention."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine.attention import create_backend
from engine.cpu_features import cpu_flags
from tests.test_attention import CPU

if cpu_kernels.compiler_problem() is not None:
    pytest.skip(f"no CPU kernel library here: {cpu_kernels.compiler_problem()}", allow_module_level=True)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCKS, WIDTH = 4, 2, 64, 16, 6, 4
# Two requests: 20 keys in blocks 3, 1 (one decode row), 35 keys in blocks 0, 5, 2 (two rows). The
# entries past them are padding the kernel never reads: garbage there must pass.
TABLE = [[3, 1, 10**6, -7], [0, 5, 2, 10**6]]
LENS, CU = [20, 35], [0, 1, 3]
KINDS = [pytest.param("auto", id="float32"),
         pytest.param("int8", id="int8", marks=pytest.mark.skipif(
             "avx512_vnni" not in cpu_flags(), reason="the int8 cache needs AVX-512 VNNI"))]


def _ops():
    return cpu_kernels.load_kernel()


def _filled_pool(kv_cache_dtype):
    """A backend and its pool, every slot written with random K/V through write_kv."""
    backend = create_backend("cpu", CPU, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32,
                             kv_cache_dtype=kv_cache_dtype)
    k_cache, v_cache = backend.allocate_cache(BLOCKS, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
    _ops().write_kv(k_cache, v_cache, k, v, torch.arange(BLOCKS * BLOCK_SIZE))
    return backend, k_cache, v_cache


def _step():
    """q and the index tensors of the two requests, as the engine builds them (int32, contiguous)."""
    q = torch.randn(CU[-1], HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    return q, *(torch.tensor(x, dtype=torch.int32) for x in (CU, LENS, TABLE))


def _dense(backend, k_cache, v_cache, q):
    """Each row's attention over its request's keys read back from the pool (causal, bottom-right)."""
    out = torch.empty_like(q)
    for b, length in enumerate(LENS):
        keys, values = backend.read_context(k_cache, v_cache, torch.tensor(TABLE[b]), length, torch.float32)
        keys, values = (x.repeat_interleave(HEADS // KV_HEADS, 1) for x in (keys, values))
        first, end = CU[b], CU[b + 1]
        for row in range(first, end):
            seen = length - (end - row) + 1
            scores = torch.einsum("hd,thd->ht", q[row], keys[:seen]) * backend.scale
            out[row] = torch.einsum("ht,thd->hd", scores.softmax(-1), values[:seen])
    return out


# ---------------------------------------------------------------- write_kv: slot_mapping


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"], ids=["float32", "int8"])
@pytest.mark.parametrize("slot", [10**7, BLOCKS * BLOCK_SIZE, -1], ids=["far", "one-past", "negative"])
def test_write_kv_refuses_a_slot_outside_the_pool_and_writes_nothing(slot, kv_cache_dtype):
    _, k_cache, v_cache = _filled_pool(kv_cache_dtype)
    before = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(4, KV_HEADS, HEAD_DIM), torch.randn(4, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([0, 5, 95, slot])
    with pytest.raises(RuntimeError, match=rf"write_kv: slot_mapping\[3\] = {slot} is outside the cache's 96 slots "
                                           rf"\(6 blocks of 16\)"):
        _ops().write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])  # checked before any write
    slots[3] = 94  # the same call with the slot in range lands
    _ops().write_kv(k_cache, v_cache, k, v, slots)
    if kv_cache_dtype == "auto":
        assert torch.equal(k_cache[5, :, :, 14], k[3]) and torch.equal(v_cache[5, :, 14], v[3])
    else:
        assert not torch.equal(k_cache[5], before[0][5]) and not torch.equal(v_cache[5], before[1][5])


# ---------------------------------------------------------------- paged_attention: cu_seqlens_q, seqlens_k, block_table

BAD = {  # argument, position, value, what the message says
    "cu-start": ("cu", 0, 1, r"cu_seqlens_q\[0\] = 1 must be 0"),
    "cu-decreasing": ("cu", 1, 4, r"cu_seqlens_q\[2\] = 3 is below cu_seqlens_q\[1\] = 4"),
    "cu-past-q": ("cu", 2, 4, r"cu_seqlens_q\[2\] = 4 must equal q's 3 rows"),
    "cu-short-of-q": ("cu", 2, 2, r"cu_seqlens_q\[2\] = 2 must equal q's 3 rows"),
    "lens-negative": ("lens", 1, -5, r"seqlens_k\[1\] = -5 is outside \[0, 64\]: the block table holds 4 blocks of 16"),
    "lens-below-rows": ("lens", 1, 1, r"seqlens_k\[1\] = 1 is below request 1's 2 query rows"),
    "lens-past-table": ("lens", 0, 65, r"seqlens_k\[0\] = 65 is outside \[0, 64\]"),
    "block-one-past": ("table", (1, 2), BLOCKS, r"block_table\[1, 2\] = 6 is outside the cache's 6 blocks \[0, 6\)"),
    "block-far": ("table", (0, 1), 10**7, r"block_table\[0, 1\] = 10000000 is outside the cache's 6 blocks"),
    "block-negative": ("table", (0, 0), -1, r"block_table\[0, 0\] = -1 is outside"),
}


@pytest.mark.parametrize("kv_cache_dtype", KINDS)
@pytest.mark.parametrize("case", list(BAD))
def test_paged_attention_refuses_indices_outside_q_or_the_pool(case, kv_cache_dtype):
    backend, k_cache, v_cache = _filled_pool(kv_cache_dtype)
    q, cu, lens, table = _step()
    which, position, value, message = BAD[case]
    bad = {"cu": cu, "lens": lens, "table": table}[which].clone()
    bad[position] = value
    args = {"cu": cu, "lens": lens, "table": table, which: bad}
    with pytest.raises(RuntimeError, match="paged_attention: " + message):
        _ops().paged_attention(torch.empty_like(q), q, k_cache, v_cache, args["cu"], args["lens"], args["table"],
                               backend.scale)


@pytest.mark.parametrize("kv_cache_dtype", KINDS)
def test_the_valid_call_reads_only_its_blocks_and_matches_dense_attention(kv_cache_dtype):
    backend, k_cache, v_cache = _filled_pool(kv_cache_dtype)
    q, cu, lens, table = _step()
    out = torch.empty_like(q)
    _ops().paged_attention(out, q, k_cache, v_cache, cu, lens, table, backend.scale)
    tolerance = 1e-5 if kv_cache_dtype == "auto" else 3e-2  # int8: the query is quantized too (test_kv_int8)
    torch.testing.assert_close(out, _dense(backend, k_cache, v_cache, q), atol=tolerance, rtol=tolerance)
    lens[1] = 64  # the row's whole table, garbage included, is now read
    with pytest.raises(RuntimeError, match=r"block_table\[1, 3\] = 1000000"):
        _ops().paged_attention(out, q, k_cache, v_cache, cu, lens, table, backend.scale)


def test_the_fused_decode_step_refuses_a_bound_slot_outside_the_pool():
    """slotserve_cpu::attention (the compiled decoder's op) writes through write_kv: the same check."""
    backend, k_cache, v_cache = _filled_pool("auto")
    q, k, v = torch.randn(2, HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM)
    # Two decodes: request 0's last key (its second block, 1, offset 3), then a slot far outside.
    index = [torch.tensor([BLOCK_SIZE + 3, 10**7]), torch.tensor([0, 1, 2], dtype=torch.int32),
             torch.tensor(LENS, dtype=torch.int32), torch.tensor(TABLE, dtype=torch.int32)]
    try:
        torch.ops.slotserve_cpu.bind_attention_step(index, backend.scale)
        with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 10000000 is outside"):
            torch.ops.slotserve_cpu.attention(q, k, v, k_cache, v_cache)
        index[0][1] = 2 * BLOCK_SIZE + 2  # request 1's last key, its third block (2), offset 2
        out = torch.ops.slotserve_cpu.attention(q, k, v, k_cache, v_cache)
        assert out.shape == (2, HEADS * HEAD_DIM) and torch.isfinite(out).all()
    finally:
        torch.ops.slotserve_cpu.bind_attention_step([], 1.0)
