"""The CPU kernel that reads the paged cache in place (engine.attention.cpu): the attention
contract at several block sizes, dtypes and head layouts, long scattered contexts against the
torch reference, clear errors, and a build cache keyed so that a stale library is never loaded."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from engine.attention import create_backend
from engine import cpu_kernels
from engine.attention import cpu as cpu_attention
from engine.attention.metadata import build_step_inputs
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk
from tests.test_attention import CPU, run_contract

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (4, 4), (6, 2), (14, 2), (10, 1)],
                         ids=["gqa", "mqa", "mha", "gqa3", "gqa7", "mqa10"])  # 10: two passes, 8 heads then 2
@pytest.mark.parametrize("block_size", [8, 16, 32, 256])
def test_cpu_kernel_matches_dense_attention(block_size, heads, kv_heads, dtype):
    run_contract("cpu", CPU, block_size, dtype, TOLERANCE[dtype], heads, kv_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (14, 2), (10, 1)], ids=["g4", "g7", "g10"])
@pytest.mark.parametrize("head_dim", [48, 64, 128])
@pytest.mark.parametrize("block_size", [16, 64])
def test_cpu_kernel_matches_dense_attention_over_head_sizes(block_size, head_dim, heads, kv_heads, dtype):
    """The kernel splits the head dimension into groups of vectors and the query heads of a KV head into
    groups of at most 8: full and partial groups of each (head_dim 48 is three vectors of 16 floats)."""
    run_contract("cpu", CPU, block_size, dtype, TOLERANCE[dtype], heads, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_long_chunks_after_a_prefix_match_dense_attention(block_size, heads, kv_heads, dtype):
    """Chunks after a cached prefix from SDPA_MIN_ROWS rows up go to torch's fused kernel with a
    bottom-right causal mask; shorter ones and decodes stay in the paged kernel, in the same step."""
    rows = cpu_attention.SDPA_MIN_ROWS
    run_contract("cpu", CPU, block_size, dtype, TOLERANCE[dtype], heads, kv_heads,
                 contexts=(37, 300, 5, 0, 130, 64), new=(1, rows, 200, 70, rows - 1, 1))


def _long_step(seed, block_size, heads, kv_heads, head_dim, dtype):
    """Decodes and chunks after a prefix over long contexts in a scattered pool."""
    rng = random.Random(seed)
    starts = [rng.randint(50, 700) for _ in range(12)]
    news = [1] * 9 + [rng.randint(2, 40) for _ in range(3)]
    need = [-(-(s + n) // block_size) for s, n in zip(starts, news)]
    pool = list(range(sum(need) * 2))
    rng.shuffle(pool)
    chunks = []
    for i, (s, n) in enumerate(zip(starts, news)):
        r = Request(str(i), [1] * (s + n), SamplingParams(), 0, i, 10_000, 0, frozenset())
        r.block_ids = [pool.pop() for _ in range(need[i])]
        chunks.append(ScheduledChunk(r, s, n))
    _, _, _, meta, _ = build_step_inputs(chunks, block_size, CPU)
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(news)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    return meta, q, k, v, len(pool) + sum(need)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_kernel_equals_the_torch_reference_over_long_contexts(dtype):
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    meta, q, k, v, blocks = _long_step(5, block_size, heads, kv_heads, head_dim, dtype)
    gen = torch.Generator().manual_seed(6)
    outs = []
    for name in ("cpu", "torch"):
        backend = create_backend(name, CPU, heads, kv_heads, head_dim, block_size, dtype)
        cache = backend.allocate_cache(blocks, dtype, CPU)
        # The same cached context in both layouts: write it through each backend's own slot writes.
        full = torch.randn(blocks * block_size, kv_heads, head_dim, generator=gen.manual_seed(7)).to(dtype)
        if name == "cpu":  # K [blocks, kv_heads, head_dim, block_size], V [blocks, kv_heads, block_size, head_dim]
            cache[0].copy_(full.view(blocks, block_size, kv_heads, head_dim).permute(0, 2, 3, 1))
            cache[1].copy_(full.flip(0).view(blocks, block_size, kv_heads, head_dim).transpose(1, 2))
        else:
            cache[0].copy_(full.transpose(0, 1))
            cache[1].copy_(full.flip(0).transpose(0, 1))
        backend.plan(meta)
        outs.append(backend.forward(q, k, v, cache, meta).float())
    torch.testing.assert_close(outs[0], outs[1], atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_rows_land_in_their_slots(dtype):
    # v as the model hands it over: a view into the fused qkv projection (rows not contiguous).
    blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 3, 16, 9
    qkv = torch.randn(tokens, 5 * kv_heads * head_dim).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    v = qkv[:, -kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size)[:tokens]
    backend = create_backend("cpu", CPU, kv_heads, kv_heads, head_dim, block_size, dtype)
    k_cache, v_cache = backend.allocate_cache(blocks, dtype, CPU)
    cpu_kernels.load_kernel().write_kv(k_cache, v_cache, k, v, slots)
    block, offset = slots // block_size, slots % block_size
    assert torch.equal(k_cache.permute(0, 3, 1, 2)[block, offset], k)  # [blocks, block_size, kv_heads, d]
    assert torch.equal(v_cache.transpose(1, 2)[block, offset], v)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not v_cache.transpose(1, 2).reshape(-1, kv_heads, head_dim)[untouched].any()
    with pytest.raises(RuntimeError, match="one slot per token"):
        cpu_kernels.load_kernel().write_kv(k_cache, v_cache, k, v, slots[:-1])
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu_kernels.load_kernel().write_kv(k_cache, v_cache, k.half(), v.half(), slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("length", [1, 21, 32, 47])
def test_what_a_block_holds_past_a_requests_last_key_never_reaches_its_output(length, dtype):
    """The kernel scores a request's last keys as a whole vector of its last block: the slots past them
    (NaN here, as stale data could be) are read but must not count."""
    kv_heads, heads, head_dim, block_size = 2, 6, 64, 16
    backend = create_backend("cpu", CPU, heads, kv_heads, head_dim, block_size, dtype)
    k_cache, v_cache = backend.allocate_cache(8, dtype, CPU)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    k, v = (torch.randn(length, kv_heads, head_dim).to(dtype) for _ in range(2))
    blocks = torch.tensor([5, 2, 7], dtype=torch.int32)
    slots = (blocks.long()[torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size)
    cpu_kernels.load_kernel().write_kv(k_cache, v_cache, k, v, slots)
    q = torch.randn(1, heads, head_dim).to(dtype)
    out = torch.empty_like(q)
    cpu_kernels.load_kernel().paged_attention(out, q, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32),
                                              torch.tensor([length], dtype=torch.int32), blocks[None], 0.125)
    group = heads // kv_heads
    scores = torch.einsum("hd,thd->ht", q[0].float(), k.float().repeat_interleave(group, 1)) * 0.125
    want = torch.einsum("ht,thd->hd", scores.softmax(-1), v.float().repeat_interleave(group, 1))
    torch.testing.assert_close(out[0].float(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_cpu_kernel_names_what_is_wrong():
    kernel = cpu_kernels.load_kernel().paged_attention
    q = torch.randn(2, 4, 16)
    k_cache, v_cache = torch.zeros(4, 2, 16, 8), torch.zeros(4, 2, 8, 16)  # 4 blocks of 8 tokens, 2 KV heads
    cu, lens, table = torch.tensor([0, 1, 2]), torch.tensor([3, 5]), torch.zeros(2, 1)
    with pytest.raises(RuntimeError, match="must be int32"):
        kernel(torch.empty_like(q), q, k_cache, v_cache, cu, lens, table, 0.25)
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernel(torch.empty_like(q), q, k_cache.bfloat16(), v_cache.bfloat16(), cu.int(), lens.int(), table.int(), 0.25)
    with pytest.raises(RuntimeError, match="last two dimensions swapped"):
        kernel(torch.empty_like(q), q, v_cache, v_cache, cu.int(), lens.int(), table.int(), 0.25)
    with pytest.raises(RuntimeError, match="head_dim must match"):
        kernel(torch.empty(2, 4, 8), torch.randn(2, 4, 8), k_cache, v_cache, cu.int(), lens.int(), table.int(), 0.25)


def test_the_build_is_keyed_by_source_flags_and_cpu(monkeypatch, tmp_path):
    name = cpu_kernels.kernel_name()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "another cpu")
    assert cpu_kernels.kernel_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "CFLAGS", cpu_kernels.CFLAGS + ("-DOTHER",))
    assert cpu_kernels.kernel_name() != name
    monkeypatch.undo()
    source = tmp_path / "paged_attention.cpp"
    source.write_bytes(cpu_kernels.SOURCES[0].read_bytes() + b"\n// edited\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source, *cpu_kernels.SOURCES[1:]))
    assert cpu_kernels.kernel_name() != name
    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path))
    assert cpu_kernels.kernel_dir() == tmp_path / "kernels"


def test_without_a_compiler_the_reason_is_given(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "no-such-compiler-here" in cpu_kernels.compiler_problem()


def test_engine_in_bf16_agrees_with_the_torch_backend(tmp_path):
    """Greedy paths with this kernel and with the torch reference in bf16 (the GPU kernels' check, on CPU)."""
    from engine import LLM
    from tests.factories import make_model_dir
    from tests.test_gpu_engine import assert_bf16_paths_agree, greedy_logprobs

    path = make_model_dir(tmp_path, "llama", seed=4, with_tokenizer=False, hidden=128, heads=8, kv_heads=2)
    paths = {backend: greedy_logprobs(LLM(str(path), device="cpu", dtype="bfloat16", attention_backend=backend,
                                          block_size=16, num_kv_blocks=256))
             for backend in ("cpu", "torch")}
    assert_bf16_paths_agree(paths["cpu"], paths["torch"])


def test_a_build_killed_midway_does_not_block_the_next_load():
    """torch's build lock is a file its builder deletes when done; one left by a killed builder is
    cleared (this process holds the OS lock every builder takes), not waited on forever."""
    cpu_kernels.load_kernel()
    stale = cpu_kernels.kernel_dir() / cpu_kernels.kernel_name() / "lock"
    stale.touch()
    result: list = []
    loader = threading.Thread(target=lambda: result.append(cpu_kernels.load_kernel.__wrapped__()), daemon=True)
    loader.start()
    loader.join(timeout=120)
    assert result and not stale.exists()
