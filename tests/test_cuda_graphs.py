"""Decode CUDA graphs: buckets, padding rows into the scratch block, and the static decode path.

On CPU the graph runner's static path (padded buffers, device-side metadata) runs without
capture, so everything but the capture itself is checked here against the eager engine.
The `gpu` tests compare captured replay with eager steps on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.block_table import BlockTable
from engine.attention.metadata import build_step_inputs
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, GraphKey, batch_buckets, context_buckets, decode_metadata
from engine.request import Request
from engine.scheduler import ScheduledChunk
from tests.factories import make_model_dir

CPU = torch.device("cpu")


def test_batch_buckets_are_small_powers_then_every_eight_up_to_the_slots():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


def test_context_buckets_double_up_to_the_model_length():
    assert context_buckets(4096) == [256, 512, 1024, 2048, 4096]
    assert context_buckets(1000) == [256, 512, 1000]
    assert context_buckets(100) == [100]


def _decode(rid: str, start: int, blocks: list[int]) -> ScheduledChunk:
    r = Request(rid, list(range(start + 1)), SamplingParams(), 0, int(rid), 10_000, 0, frozenset())
    r.block_ids = blocks
    return ScheduledChunk(r, start, 1)


class _Backend:
    graph_context_buckets = True


def test_step_picks_the_smallest_bucket_it_fits_and_prefill_runs_eagerly():
    table = BlockTable(16, 64, CPU)
    graphs = DecodeGraphs(None, _Backend(), [], table, 16, 16, 1000, 8, CPU)
    decodes = [_decode(str(i), s, [0] * 63) for i, s in enumerate([10, 300, 7])]
    assert graphs.key_for(decodes) == GraphKey(4, 512)
    assert graphs.key_for(decodes[:1]) == GraphKey(1, 256)
    assert graphs.key_for([_decode("9", 999, [0] * 63)]) == GraphKey(1, 1000)
    prefill = ScheduledChunk(decodes[0].request, 0, 11)
    assert graphs.key_for(decodes + [prefill]) is None
    assert graphs.key_for([_decode(str(i), 5, [0]) for i in range(17)]) is None


def test_padding_rows_read_and_write_only_the_scratch_block():
    bs, scratch = 4, 99
    table = BlockTable(8, 16, CPU, pad_block=scratch)
    chunks = [_decode("0", 9, [5, 1, 7]), _decode("1", 2, [3]), _decode("2", 13, [8, 2, 4, 6])]
    rows = table.update(chunks, bs)
    positions = torch.tensor([c.start for c in chunks] + [0])
    meta = decode_metadata(table, torch.tensor(rows + [table.pad_row]), positions, 16, bs)
    # Real rows: exactly what the eager builder computes for the same requests.
    _, _, _, eager, _ = build_step_inputs(chunks, bs, CPU)
    by_id = {c.request.request_id: i for i, c in enumerate(chunks)}
    eager_slots = eager.slot_mapping.tolist()
    order = [by_id[r] for r in ("2", "0", "1")]  # the eager order: decodes by decreasing context
    assert [meta.slot_mapping.tolist()[i] for i in order] == eager_slots
    assert meta.slot_mapping.tolist()[3] == scratch * bs
    assert meta.seqlens_k.tolist() == [10, 3, 14, 1]
    assert meta.cu_seqlens_k.tolist() == [0, 10, 13, 27, 28]
    assert meta.block_table[3].tolist() == [scratch] * 4
    assert meta.kv_lens == [16] * 4 and meta.num_gathered == 4


def test_scratch_block_is_past_the_pool_the_block_manager_hands_out(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=12, block_size=8).engine
    runner, blocks = engine.runner, engine.block_manager
    assert runner.scratch_block == runner.num_blocks == blocks.num_blocks == 12
    # the cpu layouts: K [blocks, kv_heads, d, block_size], V [blocks, kv_heads, block_size, d]
    k_cache, v_cache = runner.kv_caches[0]
    assert (k_cache.shape[:2], k_cache.shape[3], v_cache.shape[:3]) == ((13, 2), 8, (13, 2, 8))
    assert runner.scratch_block not in blocks.allocate(blocks.num_free)
    table = runner.block_table
    assert table.table[table.pad_row].tolist() == [runner.scratch_block] * table.max_blocks


def test_enforce_eager_is_a_checked_engine_option():
    assert EngineConfig.from_options("m", enforce_eager=True).enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig.from_options("m", enforce_eager="yes")


# ---------------------------------------------------------------- the static decode path, end to end
SHORT = [[5 + i, 9, 13 + 2 * i, 200 - i] * (1 + i % 4) for i in range(11)]
LONG = SHORT[:4] + [list(range(3, 253))]  # one context passes the first context bucket (256)


def _generate(llm: LLM, prompts, max_tokens=None):
    """Greedy; output lengths differ per request (``8 + 3 i``) unless ``max_tokens`` is given,
    so the running batch shrinks step by step through the batch buckets."""
    params = [SamplingParams(temperature=0, max_tokens=max_tokens or 8 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _attach_graphs(llm: LLM) -> list[tuple[GraphKey, int]]:
    """The runner's decode steps go through DecodeGraphs' static path; returns (key, rows) per step."""
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.decoder, runner.backend, runner.kv_caches, runner.block_table, runner.block_size,
                          llm.engine.config.scheduler.max_num_seqs, runner.max_model_len, llm.engine.vocab_size,
                          runner.device)
    used = []
    run = graphs.run
    graphs.run = lambda chunks, key: (used.append((key, len(chunks))), run(chunks, key))[1]
    runner.graphs = graphs
    return used


@pytest.mark.parametrize("prompts,blocks,contexts,preempts", [
    (LONG, 64, {256, 300}, False), (SHORT, 14, {256}, True)], ids=["long-context", "preempting"])
def test_padded_static_decode_path_gives_the_eager_tokens(tiny_model_dir, prompts, blocks, contexts, preempts):
    # The torch backend: its padded decode batches are the ones keyed by context bucket.
    options = {"device": "cpu", "dtype": "float32", "block_size": 8, "max_num_seqs": 6, "max_model_len": 300,
               "num_kv_blocks": blocks, "attention_backend": "torch"}
    want = _generate(LLM(str(tiny_model_dir), **options), prompts)
    llm = LLM(str(tiny_model_dir), **options)
    used = _attach_graphs(llm)
    assert _generate(llm, prompts) == want
    assert {k.context for k, _ in used} == contexts
    assert {k.batch for k, _ in used} >= ({1, 2, 4, 6} if len(prompts) > 6 else {1, 2, 4})
    assert any(k.batch > n for k, n in used)  # some steps had padding rows
    runner = llm.engine.runner
    assert runner.kv_caches[0][0][:, runner.scratch_block * 8].abs().sum() > 0  # padding rows wrote there
    assert (llm.engine.stats().num_preemptions > 0) == preempts


# ---------------------------------------------------------------- captured graphs (CUDA)
GPU_PROMPTS = [list(range(10 + i, 210 + i)) for i in range(16)]


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("graphs"), "llama", seed=4, with_tokenizer=False,
                          hidden=128, heads=8, kv_heads=2, max_pos=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,compare", [("float32", None), ("bfloat16", 4)], ids=["fp32-all", "bf16-first"])
def test_captured_replay_gives_the_eager_tokens_for_every_bucket(gpu_model_dir, dtype, compare):
    opts = {"device": "cuda", "dtype": dtype, "block_size": 16, "max_num_seqs": 16, "max_model_len": 512,
            "num_kv_blocks": 600}
    eager = LLM(str(gpu_model_dir), enforce_eager=True, **opts)
    graphed = LLM(str(gpu_model_dir), enforce_eager=False, **opts)
    runner = graphed.engine.runner
    assert eager.engine.runner.graphs is None and runner.graphs is not None
    assert set(runner.graphs._graphs) == set(runner.graphs.keys)
    seen = set()
    run = runner.graphs.run
    runner.graphs.run = lambda chunks, key: (seen.add(key), run(chunks, key))[1]
    # Contexts run from ~200 past 256, so each batch size meets both context buckets.
    for n in runner.graphs.batches + [3, 11]:
        want = _generate(eager, GPU_PROMPTS[:n], 100)
        got = _generate(graphed, GPU_PROMPTS[:n], 100)
        if compare is not None:  # bf16: the first token comes from prefill, the next ones from graphs
            want, got = [t[:compare] for t in want], [t[:compare] for t in got]
        assert got == want, n
    assert seen == set(runner.graphs.keys)
