"""The attention contract: every backend equals dense causal attention over each request's
own tokens, for packed decodes and prefill chunks with cached context (and the shared
metadata builder: cu_seqlens, block tables, slot mapping, decode length groups)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import create_backend
from engine.attention.metadata import build_step_inputs, plan_decode_groups
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk

HEADS, KV_HEADS, D = 4, 2, 16
CONTEXTS = [0, 5, 17, 40, 3, 64, 9]
NEW = [7, 1, 1, 1, 12, 1, 1]


def _dense(q, k, v, start):
    """q [n, H, d]; k, v [L, Hkv, d] (all tokens so far); query j sits at position start + j."""
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k.float()) * D ** -0.5
    pos_q = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.float()).reshape(q.shape[0], -1)


def _run_contract(backend_name, device, block_size, dtype, atol):
    gen = torch.Generator().manual_seed(0)
    backend = create_backend(backend_name, device, HEADS, KV_HEADS, D, block_size)
    total = [c + n for c, n in zip(CONTEXTS, NEW)]
    need = [-(-t // block_size) for t in total]
    ids = list(range(sum(need) + 3))
    random.Random(1).shuffle(ids)  # blocks scattered over the pool
    cache = backend.allocate_cache(len(ids), dtype, device)
    reqs, k_all, v_all = [], [], []
    for i, t in enumerate(total):
        r = Request(str(i), [1] * t, SamplingParams(), 0, i, 10_000, 0, frozenset())
        r.block_ids = [ids.pop() for _ in range(need[i])]
        reqs.append(r)
        k_all.append(torch.randn(t, KV_HEADS, D, generator=gen))
        v_all.append(torch.randn(t, KV_HEADS, D, generator=gen))
    q_all = [torch.randn(t, HEADS, D, generator=gen) for t in total]

    def step(chunks):
        _, _, _, meta, _ = build_step_inputs(chunks, block_size, device)
        order = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -(c.start + 1))
        order += [c for c in chunks if c.num_tokens != 1]
        rows = [int(c.request.request_id) for c in order]
        sl = [slice(c.start, c.start + c.num_tokens) for c in order]
        pack = lambda xs: torch.cat([xs[r][s] for r, s in zip(rows, sl)]).to(device, dtype)  # noqa: E731
        out = backend.forward(pack(q_all), pack(k_all), pack(v_all), cache, meta).float().cpu()
        offset = 0
        for r, c in zip(rows, order):
            n = c.num_tokens
            want = _dense(q_all[r][c.start:c.start + n], k_all[r][:c.start + n], v_all[r][:c.start + n], c.start)
            torch.testing.assert_close(out[offset:offset + n], want, atol=atol, rtol=atol)
            offset += n

    step([ScheduledChunk(r, 0, c) for r, c in zip(reqs, CONTEXTS) if c > 0])        # contexts, as prefills
    step([ScheduledChunk(r, c, n) for r, c, n in zip(reqs, CONTEXTS, NEW)])         # decodes + chunks on top


def test_torch_backend_matches_dense_attention():
    _run_contract("torch", torch.device("cpu"), 8, torch.float32, 1e-5)


def test_torch_backend_with_one_token_blocks():
    _run_contract("torch", torch.device("cpu"), 1, torch.float32, 1e-5)


@pytest.mark.gpu
def test_flash_backend_matches_dense_attention():
    _run_contract("flash", torch.device("cuda"), 256, torch.bfloat16, 2e-2)


@pytest.mark.gpu
def test_torch_backend_on_cuda_matches_dense_attention():
    _run_contract("torch", torch.device("cuda"), 16, torch.float32, 1e-4)


def test_slot_mapping_and_block_table():
    r = Request("a", list(range(20)), SamplingParams(), 0, 0, 100, 0, frozenset())
    r.block_ids = [7, 2, 5]
    _, input_ids, positions, meta, logits_idx = build_step_inputs([ScheduledChunk(r, 6, 14)], 8, torch.device("cpu"))
    assert input_ids.tolist() == list(range(6, 20))
    assert positions.tolist() == list(range(6, 20))
    want = [(7 if p < 8 else 2 if p < 16 else 5) * 8 + p % 8 for p in range(6, 20)]
    assert meta.slot_mapping.tolist() == want
    assert meta.cu_seqlens_q.tolist() == [0, 14] and meta.seqlens_k.tolist() == [20]
    assert logits_idx.tolist() == [13]


def test_decode_groups_minimise_padding():
    assert plan_decode_groups([]) == []
    assert plan_decode_groups([100, 90, 80], overhead=512) == [(0, 3, 100)]
    groups = plan_decode_groups([3000, 2900, 100, 90, 80, 70], overhead=512)
    assert groups == [(0, 2, 3000), (2, 6, 100)]
    assert groups[0][0] == 0 and groups[-1][1] == 6
