"""The attention contract: every backend equals dense causal attention over each request's
own tokens, for packed decodes, first prefill chunks and chunks after a cached prefix (and
the shared metadata builder: cu_seqlens, block tables, slot mapping, gather rows, decode
length groups). GPU-only kernels are stood in for on CPU by reference kernels with their
signatures, so each backend's own work (cache writes, gathers, splits, GQA) is checked here."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import backend_problem, create_backend, resolve_backend
from engine.attention.fa3 import FA3AttentionBackend
from engine.attention.flash import FlashAttentionBackend
from engine.attention.metadata import build_step_inputs, order_chunks
from engine.attention.torch_ref import plan_decode_groups
from engine.attention.varlen import VarlenAttentionBackend
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk

D = 16
CONTEXTS = [0, 5, 17, 40, 3, 64, 9]
NEW = [7, 1, 1, 1, 12, 1, 1]


def _dense(q, k, v, start):
    """q [n, H, d]; k, v [L, Hkv, d] (all tokens so far); query j sits at position start + j."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k.float()) * q.shape[-1] ** -0.5
    pos_q = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.float()).reshape(q.shape[0], -1)


def run_contract(backend, device, block_size, dtype, atol, heads=4, kv_heads=2, head_dim=D, contexts=CONTEXTS,
                 new=NEW):
    """Two steps over scattered blocks: first chunks of ``contexts``, then ``new`` tokens on top of each
    (decodes, chunks after a prefix, a first chunk where the context is 0).
    ``backend``: a name for create_backend, or a backend instance."""
    gen = torch.Generator().manual_seed(0)
    if isinstance(backend, str):
        backend = create_backend(backend, device, heads, kv_heads, head_dim, block_size, dtype)
    total = [c + n for c, n in zip(contexts, new)]
    need = [-(-t // block_size) for t in total]
    ids = list(range(sum(need) + 3))
    random.Random(1).shuffle(ids)  # blocks scattered over the pool
    cache = backend.allocate_cache(len(ids), dtype, device)
    reqs, k_all, v_all = [], [], []
    for i, t in enumerate(total):
        r = Request(str(i), [1] * t, SamplingParams(), 0, i, 10_000, 0, frozenset())
        r.block_ids = [ids.pop() for _ in range(need[i])]
        reqs.append(r)
        k_all.append(torch.randn(t, kv_heads, head_dim, generator=gen))
        v_all.append(torch.randn(t, kv_heads, head_dim, generator=gen))
    q_all = [torch.randn(t, heads, head_dim, generator=gen) for t in total]

    def step(chunks):
        _, _, _, meta, _ = build_step_inputs(chunks, block_size, device)
        order, _, _ = order_chunks(chunks)
        rows = [int(c.request.request_id) for c in order]
        sl = [slice(c.start, c.start + c.num_tokens) for c in order]
        pack = lambda xs: torch.cat([xs[r][s] for r, s in zip(rows, sl)]).to(device, dtype)  # noqa: E731
        backend.plan(meta)
        out = backend.forward(pack(q_all), pack(k_all), pack(v_all), cache, meta).float().cpu()
        offset = 0
        for r, c in zip(rows, order):
            n = c.num_tokens
            want = _dense(q_all[r][c.start:c.start + n], k_all[r][:c.start + n], v_all[r][:c.start + n], c.start)
            torch.testing.assert_close(out[offset:offset + n], want, atol=atol, rtol=atol)
            offset += n

    step([ScheduledChunk(r, 0, c) for r, c in zip(reqs, contexts) if c > 0])        # contexts, as first chunks
    step([ScheduledChunk(r, c, n) for r, c, n in zip(reqs, contexts, new)])         # decodes + chunks on top


# ---------------------------------------------------------------- reference kernels (CPU stand-ins)
def _reference(q, keys_of, cu_q, causal, scale):
    """Per request: causal (bottom-right) or full attention of its queries over ``keys_of(i)``."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        k, v = keys_of(i)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", q[a:b].float(), k.float()) * scale
        if causal:
            last = torch.arange(k.shape[0] - (b - a), k.shape[0])[:, None]
            scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > last, float("-inf"))
        out[a:b] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.float()).to(q.dtype)
    return out


def _pages(cache, table_row, length):
    return cache[table_row[:-(-length // cache.shape[1])].long()].flatten(0, 1)[:length]


def ref_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch.nn.attention.varlen.varlen_attn's semantics, paged mode included."""
    heads_k = key.shape[-2]
    assert enable_gqa or heads_k == query.shape[1], "varlen_attn without enable_gqa needs equal heads"
    assert max_q >= int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    if block_table is not None:
        assert seqused_k is not None and int(seqused_k.max()) <= max_k
        keys_of = lambda i: (_pages(key, block_table[i], int(seqused_k[i])),  # noqa: E731
                             _pages(value, block_table[i], int(seqused_k[i])))
    else:
        assert int((cu_seq_k[1:] - cu_seq_k[:-1]).max()) <= max_k
        keys_of = lambda i: (key[cu_seq_k[i]:cu_seq_k[i + 1]], value[cu_seq_k[i]:cu_seq_k[i + 1]])  # noqa: E731
    return _reference(query, keys_of, cu_seq_q, tuple(window_size) == (-1, 0), scale)


def ref_varlen_older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    """An older varlen_attn: no enable_gqa, no paged mode."""
    return ref_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)


def ref_fa3_kvcache(q, k_cache, v_cache, cache_seqlens=None, page_table=None, cu_seqlens_q=None,
                    max_seqlen_q=None, softmax_scale=None, causal=False, **_):
    keys_of = lambda i: (_pages(k_cache, page_table[i], int(cache_seqlens[i])),  # noqa: E731
                         _pages(v_cache, page_table[i], int(cache_seqlens[i])))
    return _reference(q, keys_of, cu_seqlens_q, causal, softmax_scale)


def ref_fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                   causal=False, block_table=None, **_):
    lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    keys_of = lambda i: (_pages(k, block_table[i], int(lens[i])), _pages(v, block_table[i], int(lens[i])))  # noqa: E731
    return _reference(q, keys_of, cu_seqlens_q, causal, softmax_scale)


def ref_fa2_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None, causal=False,
                    **_):
    cu = torch.arange(q.shape[0] + 1)
    return ref_fa3_kvcache(q.squeeze(1), k_cache, v_cache, cache_seqlens, block_table, cu, 1, softmax_scale,
                           causal).unsqueeze(1)


# ---------------------------------------------------------------- every backend, CPU
CPU = torch.device("cpu")


def test_torch_backend_matches_dense_attention():
    run_contract("torch", CPU, 8, torch.float32, 1e-5)


def test_torch_backend_with_one_token_blocks():
    run_contract("torch", CPU, 1, torch.float32, 1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def test_varlen_backend_pages_like_dense_attention(heads, kv_heads):
    backend = VarlenAttentionBackend(heads, kv_heads, D, 256, kernel=ref_varlen)
    run_contract(backend, CPU, 256, torch.float32, 1e-5, heads, kv_heads)


@pytest.mark.parametrize("kernel,block_size", [(ref_varlen, 16), (ref_varlen_older, 256)], ids=["small-pages",
                                                                                             "older-torch"])
def test_varlen_backend_never_gathers(kernel, block_size):
    """Where varlen_attn cannot read the pages in place, the backend refuses (auto takes triton)."""
    with pytest.raises(ValueError, match="multiples of 256"):
        VarlenAttentionBackend(4, 2, D, block_size, kernel=kernel)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_fa3_backend_calls_match_dense_attention(block_size, heads, kv_heads):
    backend = FA3AttentionBackend(heads, kv_heads, D, block_size, kernel=ref_fa3_kvcache)
    run_contract(backend, CPU, block_size, torch.float32, 1e-5, heads, kv_heads)


def test_flash_backend_calls_match_dense_attention():
    backend = FlashAttentionBackend(4, 2, D, 256, kernels=(ref_fa2_varlen, ref_fa2_kvcache))
    run_contract(backend, CPU, 256, torch.float32, 1e-5)


# ---------------------------------------------------------------- choosing a backend
CUDA = torch.device("cuda")  # a device name only: nothing here touches a GPU


def test_auto_picks_a_flash_kernel_on_cuda_in_half_precision_and_the_cpu_kernel_on_cpu(monkeypatch):
    monkeypatch.setattr("engine.attention._installed", lambda module: False)  # neither package, wherever this runs
    monkeypatch.setattr("engine.cpu_kernels.compiler_problem", lambda: None)
    assert resolve_backend("auto", CPU, torch.float32, 16, 64)[0] == "cpu"
    monkeypatch.setattr("engine.cpu_kernels.compiler_problem", lambda: "no C++ compiler")
    name, why = resolve_backend("auto", CPU, torch.float32, 16, 64)
    assert name == "torch" and "no C++ compiler" in why
    name, why = resolve_backend("auto", CUDA, torch.float32, 16, 64)
    assert name == "torch" and "float16/bfloat16" in why and "Triton is not installed" in why
    name, why = resolve_backend("auto", CUDA, torch.bfloat16, 256, 64)
    assert name == "varlen"  # no FlashAttention-3 or flash-attn package here; torch ships varlen_attn
    assert "flash_attn_interface" in why and "flash-attn" in why
    monkeypatch.setattr("engine.attention._installed", lambda module: module == "triton")
    name, why = resolve_backend("auto", CUDA, torch.bfloat16, 16, 64)
    assert name == "triton" and "multiple of 256" in why  # small pages: no FlashAttention kernel pages them
    assert resolve_backend("auto", CUDA, torch.float32, 16, 64)[0] == "triton"
    assert resolve_backend("auto", CUDA, torch.bfloat16, 256, 12)[0] == "triton"  # head_dim not a multiple of 8


@pytest.mark.parametrize("name,device,dtype,block_size,says", [
    ("varlen", CPU, torch.float32, 16, ["CUDA device", "torch.nn.attention.varlen"]),
    ("cpu", CUDA, torch.bfloat16, 16, ["runs on the CPU", "C++ compiler"]),
    ("flash", CUDA, torch.bfloat16, 16, ["flash-attn", "multiple of 256"]),
    ("varlen", CUDA, torch.bfloat16, 16, ["multiple of 256", "block_table"]),
    ("triton", CPU, torch.float32, 16, ["CUDA device", "Triton"]),
    ("fa3", CUDA, torch.bfloat16, 16, ["flash_attn_interface", "Hopper"]),
    ("flash", CUDA, torch.float32, 256, ["float16/bfloat16", "flash-attn"]),
])
def test_asking_for_a_backend_that_cannot_run_names_what_it_needs(name, device, dtype, block_size, says,
                                                                  monkeypatch):
    monkeypatch.setattr("engine.attention._installed", lambda module: False)
    with pytest.raises(ValueError, match=f"attention_backend '{name}' cannot run here") as info:
        resolve_backend(name, device, dtype, block_size, 64)
    assert all(s in str(info.value) for s in says), str(info.value)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend("xformers", CPU, torch.float32, 16, 64)


# ---------------------------------------------------------------- the real kernels (CUDA)
def needs_backend(name, dtype, block_size, head_dim=D):
    """Skip unless CUDA and the backend's kernel are here (tests/test_attention_gpu.py too)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    problem = backend_problem(name, torch.device("cuda"), dtype, block_size, head_dim)
    if problem is not None:
        pytest.skip(f"{name}: {problem}")


@pytest.mark.gpu
def test_flash_backend_matches_dense_attention():
    needs_backend("flash", torch.bfloat16, 256)
    run_contract("flash", torch.device("cuda"), 256, torch.bfloat16, 2e-2)


# ---------------------------------------------------------------- metadata
def test_slot_mapping_and_block_table():
    r = Request("a", list(range(20)), SamplingParams(), 0, 0, 100, 0, frozenset())
    r.block_ids = [7, 2, 5]
    _, input_ids, positions, meta, logits_idx = build_step_inputs([ScheduledChunk(r, 6, 14)], 8, CPU)
    assert input_ids.tolist() == list(range(6, 20))
    assert positions.tolist() == list(range(6, 20))
    want = [(7 if p < 8 else 2 if p < 16 else 5) * 8 + p % 8 for p in range(6, 20)]
    assert meta.slot_mapping.tolist() == want
    assert meta.cu_seqlens_q.tolist() == [0, 14] and meta.seqlens_k.tolist() == [20]
    assert meta.block_table.tolist() == [[7, 2, 5]]
    assert logits_idx.tolist() == [13]


def test_steps_order_decodes_then_chunks_after_a_prefix_then_first_chunks():
    reqs = []
    for i, blocks in enumerate([[3], [4, 6], [1], [2, 8, 9]]):
        r = Request(str(i), list(range(30)), SamplingParams(), 0, i, 100, 0, frozenset())
        r.block_ids = blocks
        reqs.append(r)
    chunks = [ScheduledChunk(reqs[0], 0, 5), ScheduledChunk(reqs[1], 9, 1), ScheduledChunk(reqs[2], 3, 4),
              ScheduledChunk(reqs[3], 20, 1)]
    sampling, _, positions, meta, _ = build_step_inputs(chunks, 8, CPU)
    order, num_decodes, num_gathered = order_chunks(chunks)
    assert [c.request.request_id for c in order] == ["3", "1", "2", "0"]
    assert (meta.num_decodes, meta.num_gathered, meta.gathered_tokens) == (num_decodes, num_gathered, 6) == (2, 3, 6)
    assert positions.tolist() == [20, 9, 3, 4, 5, 6, 0, 1, 2, 3, 4]
    assert meta.kv_lens == [21, 10, 7, 5] and meta.cu_seqlens_k.tolist() == [0, 21, 31, 38, 43]


def test_decode_groups_minimise_padding():
    assert plan_decode_groups([]) == []
    assert plan_decode_groups([100, 90, 80], overhead=512) == [(0, 3, 100)]
    groups = plan_decode_groups([3000, 2900, 100, 90, 80, 70], overhead=512)
    assert groups == [(0, 2, 3000), (2, 6, 100)]
    assert groups[0][0] == 0 and groups[-1][1] == 6
