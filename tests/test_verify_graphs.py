"""Graphs for steps that verify drafts (engine.cuda_graphs, width 1 + k): every row padded to 1 + k
query tokens, padding written to the scratch block, logits picked back in the eager order.

On CPU the static path runs uncaptured, so everything but the capture is checked against the eager
verification steps; the `gpu` test replays captured ones.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.block_table import BlockTable
from engine.attention.metadata import build_step_inputs
from engine.cuda_graphs import DecodeGraphs, GraphKey, verify_metadata
from engine.request import Request
from engine.scheduler import ScheduledChunk
from engine.spec_decode import DraftChunk
from tests.factories import make_lora_dir
from tests.test_spec_decode import BASE, NGRAM, _prompts, _run, copy_model  # noqa: F401 (a fixture)
from tests.test_attention import D, _dense
from tests.test_spec_eagle import _eagle, heads  # noqa: F401 (a fixture)

CPU = torch.device("cpu")
K = NGRAM["num_speculative_tokens"]


def _request(rid: int, tokens: int, blocks: list[int]) -> Request:
    r = Request(str(rid), list(range(3, 3 + tokens)), SamplingParams(), 0, rid, 10_000, 0, frozenset())
    r.block_ids, r.num_computed_tokens = blocks, tokens - 1
    return r


class _Backend:
    graph_context_buckets = True


def test_a_verification_step_fits_a_wider_bucket_and_a_prefill_still_runs_eagerly():
    graphs = DecodeGraphs(None, _Backend(), [], BlockTable(16, 64, CPU), 16, 16, 1000, 8, CPU, widths=(1, 1 + K))
    decode = ScheduledChunk(_request(1, 20, [0, 1]), 19, 1)
    verify = DraftChunk(_request(2, 255, [0] * 16), 254, 3, 0, [7, 8])
    assert graphs.key_for([decode]) == GraphKey(1, 256)
    # the context bucket covers the padded row's last position (254 + 5 > 256)
    assert graphs.key_for([decode, verify]) == GraphKey(2, 512, width=1 + K)
    assert graphs.key_for([decode, ScheduledChunk(decode.request, 0, 19)]) is None
    assert graphs.key_for([DraftChunk(_request(3, 9, [0]), 8, 2 + K, 0, [1] * (1 + K))]) is None  # too many
    plain = DecodeGraphs(None, _Backend(), [], BlockTable(16, 64, CPU), 16, 16, 1000, 8, CPU)
    assert plain.widths == [1] and plain.key_for([decode, verify]) is None


def test_real_tokens_take_their_eager_slots_and_padding_the_scratch_block():
    bs, scratch = 4, 99
    table = BlockTable(8, 16, CPU, pad_block=scratch)
    chunks = [DraftChunk(_request(0, 10, [5, 1, 7]), 9, 3, 0, [40, 41]),  # positions 9-11: blocks 7, 7, 7
              ScheduledChunk(_request(1, 3, [3]), 2, 1),
              DraftChunk(_request(2, 14, [8, 2, 4, 6]), 13, 2, 0, [50])]
    rows = table.update(chunks, bs)
    starts, lens = torch.tensor([9, 2, 13, 0]), torch.tensor([3, 1, 2, 0])
    positions, meta = verify_metadata(table, torch.tensor(rows + [table.pad_row]), starts, lens, 3, 16, bs)
    _, _, eager_pos, eager, _ = build_step_inputs(chunks, bs, CPU, drafts=True)
    eager_slots = dict(zip(eager_pos.tolist(), eager.slot_mapping.tolist()))  # (positions differ per row here)
    slots = meta.slot_mapping.view(4, 3).tolist()
    assert positions.view(4, 3).tolist() == [[9, 10, 11], [2, 3, 4], [13, 14, 15], [0, 1, 2]]
    assert slots[0] == [eager_slots[p] for p in (9, 10, 11)] == [7 * bs + 1, 7 * bs + 2, 7 * bs + 3]
    assert slots[1] == [eager_slots[2], scratch * bs, scratch * bs]
    assert slots[2] == [eager_slots[13], eager_slots[14], scratch * bs] == [6 * bs + 1, 6 * bs + 2, scratch * bs]
    assert slots[3] == [scratch * bs] * 3
    assert meta.cu_seqlens_q.tolist() == [0, 3, 6, 9, 12] and meta.seqlens_k.tolist() == [12, 5, 16, 3]
    assert meta.num_decodes == 0 and meta.query_lens == [3] * 4 and meta.max_seqlen_q == 3


def _backend(name: str):
    """Each backend that captures verification steps, on CPU: the CPU kernel, the Triton kernel
    (interpreted), and the FlashAttention and varlen backends over stand-ins of their kernels' contract."""
    from engine.attention import create_backend
    from engine.attention.fa3 import FA3AttentionBackend
    from engine.attention.flash import FlashAttentionBackend
    from engine.attention.varlen import VarlenAttentionBackend
    from tests.test_attention import ref_fa2_kvcache, ref_fa2_varlen, ref_fa3_kvcache, ref_varlen
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(4, 2, D, 16, fresh_kernel=None), 16
    return {"cpu": (create_backend("cpu", CPU, 4, 2, D, 16, torch.float32), 16),
            "fa3": (FA3AttentionBackend(4, 2, D, 16, kernel=ref_fa3_kvcache), 16),
            "flash": (FlashAttentionBackend(4, 2, D, 256, kernels=(ref_fa2_varlen, ref_fa2_kvcache)), 256),
            "varlen": (VarlenAttentionBackend(4, 2, D, 256, kernel=ref_varlen), 256)}[name]


@pytest.mark.parametrize("name", ["cpu", "triton", "fa3", "flash", "varlen"])
def test_each_capturing_backend_attends_a_padded_row_as_the_eager_step_does(name):
    """Rows of 3, 1 and 5 real tokens, padded to 5, and a padding row: the real queries get dense causal
    attention over their own keys, and nothing but the real tokens' blocks and the scratch block is
    written. The first two rows' padding runs past their last block, whose table entries are 0: block 0,
    which no row holds here, shows a write there."""
    backend, bs = _backend(name)
    assert backend.verify_graphs
    gen = torch.Generator().manual_seed(0)
    contexts, lens, width = [bs - 3, 30, 40], [3, 1, 5], 5
    blocks = [list(range(1 + i * 3, 1 + i * 3 + -(-(c + n) // bs))) for i, (c, n) in enumerate(zip(contexts, lens))]
    scratch = 10
    cache = backend.allocate_cache(scratch + 1, torch.float32, CPU)
    k_all, v_all, q_all = ([torch.randn(c + n, h, D, generator=gen) for c, n in zip(contexts, lens)]
                           for h in (2, 2, 4))
    table = BlockTable(4, 8, CPU, pad_block=scratch)
    reqs = [_request(i, c + 1, b) for i, (c, b) in enumerate(zip(contexts, blocks))]
    backend.plan(first := build_step_inputs([ScheduledChunk(r, 0, c) for r, c in zip(reqs, contexts)], bs, CPU)[3])
    backend.forward(*(torch.cat([x[:c] for x, c in zip(xs, contexts)]) for xs in (q_all, k_all, v_all)), cache, first)
    before = [t.clone() for t in cache]
    rows = table.update([ScheduledChunk(r, c, n) for r, c, n in zip(reqs, contexts, lens)], bs) + [table.pad_row]
    _, meta = verify_metadata(table, torch.tensor(rows), torch.tensor(contexts + [0]), torch.tensor(lens + [0]),
                              width, 4 * bs, bs)

    def padded(xs, heads):  # each row's real tokens, then noise
        return torch.cat([torch.cat([x[c:], torch.randn(width - n, heads, D, generator=gen)])
                          for x, c, n in zip(xs, contexts, lens)] + [torch.randn(width, heads, D, generator=gen)])

    backend.plan(meta)
    out = backend.forward(padded(q_all, 4), padded(k_all, 2), padded(v_all, 2), cache, meta).view(4, width, -1)
    for i, (c, n) in enumerate(zip(contexts, lens)):
        want = _dense(q_all[i][c:], k_all[i], v_all[i], c)
        torch.testing.assert_close(out[i, :n], want, atol=1e-5, rtol=1e-5)
    written = {b for i, (c, n) in enumerate(zip(contexts, lens)) for b in blocks[i][c // bs:-(-(c + n) // bs)]}
    for new, old in zip(cache, before):
        changed = {b for b in range(scratch + 1) if not torch.equal(new[b], old[b])}
        assert changed <= written | {scratch} and scratch in changed


def _attach(llm: LLM) -> list[tuple[GraphKey, list[int]]]:
    """The target's steps through the static path with verification widths, as a GPU runner builds
    them; returns (key, each chunk's query tokens) per step that took it."""
    runner = llm.engine.runner
    runner.graphs = runner.step_graphs()
    assert runner.graphs.widths == [1, runner.graph_width] and runner.graph_width > 1
    used, run = [], runner.graphs.run
    runner.graphs.run = lambda chunks, key: (used.append((key, [c.num_tokens for c in chunks])), run(chunks, key))[1]
    return used


@pytest.mark.parametrize("blocks", [128, 18], ids=["roomy", "preempting"])
def test_padded_verification_steps_accept_what_eager_ones_accept(copy_model, blocks):
    """Greedy, seeded sampling and logprobs through the padded static path: the outputs are those
    without drafts, and the drafts accepted are the eager verification steps' (which the outputs alone
    cannot show), with rows of fewer than k drafts and padding rows among them."""
    path, copying, _ = copy_model
    # The last two end two and three tokens after their first: 1 and 2 drafts fit (engine.spec_decode).
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=47, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    prompts = _prompts(2, (20, 24, 28)) + [copying, copying]
    want, _ = _run(path, prompts, params, num_kv_blocks=blocks)
    _, eager = _run(path, prompts, params, num_kv_blocks=blocks, speculative_config=NGRAM)
    llm = LLM(str(path), **{**BASE, "num_kv_blocks": blocks}, speculative_config=NGRAM)
    used = _attach(llm)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for w, g in zip(want, got):
        assert [(c.token_ids, c.finish_reason) for c in g.outputs] == \
               [(c.token_ids, c.finish_reason) for c in w.outputs]
    for a, b in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert sorted(a) == sorted(b) and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    stats, eager_stats = llm.engine.stats(), eager.stats()
    assert stats.spec_decode_num_accepted_tokens == eager_stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens == eager_stats.spec_decode_num_draft_tokens
    assert (stats.num_preemptions > 0) == (blocks == 18)
    wide = [(key, lens) for key, lens in used if key.width == 1 + K]
    assert wide and any(key.width == 1 for key, _ in used)
    assert any(1 < n < 1 + K for _, lens in wide for n in lens)  # a row padded within itself
    assert any(key.batch > len(lens) or 1 in lens for key, lens in wide)  # padding rows, or a plain decode
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks


def test_a_padded_verification_step_keeps_each_rows_adapter(copy_model, tmp_path):
    """Every token of a row, drafts and padding alike, under its row's adapter: requests with an adapter
    and without it in the same steps get what they get without drafts."""
    path = copy_model[0]
    adapter = make_lora_dir(path, tmp_path / "adapter", rank=4, seed=2, scale=0.05)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in _prompts(23, (10, 20))]
    options = {**BASE, "lora": {"adapters": {"small": str(adapter)}, "max_loras": 2}}
    plain = LLM(str(path), **options)
    llm = LLM(str(path), **options, speculative_config=NGRAM)
    used = _attach(llm)
    # One batch: adapted and base requests side by side.
    want, got = (e.generate(prompts * 2, params, lora=["small", "small", None, None]) for e in (plain, llm))
    tokens = [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got] == tokens and tokens[:2] != tokens[2:]
    for w, g in zip(want, got):  # the sampled token's logprob, at every position: its row's adapter
        both = zip(w.outputs[0].token_ids, w.outputs[0].logprobs, g.outputs[0].logprobs)
        assert all(abs(a[t] - b[t]) < 1e-4 for t, a, b in both)
    assert any(key.lora and key.width == 1 + K for key, _ in used)
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    llm.engine.block_manager.check_invariants()


def test_an_eagle3_head_reads_its_streams_from_padded_steps(copy_model, heads):
    """The target's streams come back from the graphs' buffer at each row's padded offset: the head
    proposes what it proposes after eager steps (equal drafted and accepted counts), and greedy and
    seeded outputs are those without drafts."""
    path, k = copy_model[0], 3
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=32, ignore_eos=True)] * 2
    want, _ = _run(path, _prompts(0), params)
    _, eager = _run(path, _prompts(0), params, speculative_config=_eagle(heads["near"], k))
    llm = LLM(str(path), **BASE, speculative_config=_eagle(heads["near"], k))
    used = _attach(llm)
    graphs, model = llm.engine.runner.graphs, llm.engine.runner.model
    run, buffered = graphs.run, []  # what a replay leaves: streams in the graphs' own buffer
    graphs.run = lambda chunks, key: (run(chunks, key), buffered.append(
        model.aux_out.data_ptr() == graphs._streams.data_ptr()))[0]
    got = llm.generate([{"prompt_token_ids": p} for p in _prompts(0)], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert buffered and all(buffered)
    stats, eager_stats = llm.engine.stats(), eager.stats()
    assert stats.spec_decode_num_accepted_tokens == eager_stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens == eager_stats.spec_decode_num_draft_tokens
    assert any(key.width == 1 + k for key, _ in used) and any(key.width == 1 for key, _ in used)
    llm.engine.block_manager.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_captured_verification_steps_give_the_tokens_without_drafts(copy_model, heads, method):
    path = copy_model[0]
    spec = NGRAM if method == "ngram" else _eagle(heads["near"], K)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    opts = {"device": "cuda", "enforce_eager": False}
    want, _ = _run(path, _prompts(0), params, **opts)
    llm = LLM(str(path), **BASE, **opts, speculative_config=spec)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.widths == [1, 1 + K] and set(graphs._graphs) == set(graphs.keys)
    seen, run = set(), graphs.run
    graphs.run = lambda chunks, key: (seen.add(key.width), run(chunks, key))[1]
    got = llm.generate([{"prompt_token_ids": p} for p in _prompts(0)], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert seen == {1, 1 + K} and llm.engine.stats().spec_decode_num_accepted_tokens > 0
    llm.engine.block_manager.check_invariants()
