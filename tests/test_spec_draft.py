"""Speculative decoding with a draft model (engine.spec_draft): the output equals the output
without speculation, token for token, whatever the draft proposes.

The target is test_spec_decode's "copy" model, whose output soon cycles. Three drafts: the target
itself (every draft accepted), a one-layer model with the same successor map and other weights
(mostly right), and a random model (nearly always wrong). Every run ends with the block pool
whole (``check_invariants``, every block free).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from tests.factories import build_tokenizer, make_model_dir
from tests.test_spec_decode import (BASE, VOCAB, _copying, _prompts, _run, copy_model,  # noqa: F401 (a fixture)
                                    tensor_parallel_matches_one_rank)


def _draft(path, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, "cost_model": False}


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("near-draft")
    _copying("llama", VOCAB, seed=4, layers=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("random-draft"), "llama", seed=1, vocab_size=VOCAB,
                          with_tokenizer=False)


def _same(path, draft, prompts, params, k: int = 4, **options):
    """Outputs without and with the draft model are equal; returns (the drafting engine's stats,
    its outputs, the steps the other took, the drafting engine)."""
    want, plain = _run(path, prompts, params, **options)
    got, engine = _run(path, prompts, params, speculative_config=_draft(draft, k), **options)
    for w, g in zip(want, got):
        assert [(c.token_ids, c.finish_reason, c.text) for c in g.outputs] == \
               [(c.token_ids, c.finish_reason, c.text) for c in w.outputs]
    return engine.stats(), got, plain.stats().num_steps, engine


def test_a_draft_equal_to_the_target_has_every_draft_accepted(copy_model):
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # A 16-token budget: prompts go in chunks beside verifying decodes, and the draft catches up on them.
    stats, got, plain_steps, engine = _same(path, path, _prompts(0), params, max_num_batched_tokens=16)
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert stats.num_steps < 0.6 * plain_steps  # 5 tokens a decode step, prefill chunks as before
    assert sum(o.timing.num_accepted_tokens for o in got) == stats.spec_decode_num_accepted_tokens
    # The draft's pool has the target's blocks (the same ids serve both), its own tensors.
    draft = engine.drafter.runner
    assert draft.num_blocks == engine.runner.num_blocks and draft.kv_caches[0][0] is not engine.runner.kv_caches[0][0]


def test_a_near_draft_is_mostly_right_a_random_one_wrong_and_the_output_stays_exact(copy_model, near_draft,
                                                                                   random_draft):
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    stats, _, plain_steps, _ = _same(path, near_draft, _prompts(0), params, max_num_batched_tokens=16)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_steps < plain_steps
    stats, _, _, _ = _same(path, random_draft, _prompts(1, (5, 20, 43)), params)
    assert stats.spec_decode_num_accepted_tokens < 0.2 * stats.spec_decode_num_draft_tokens


def test_greedy_output_equals_without_drafts_under_preemption(copy_model):
    """A preempted request's blocks are freed: its draft KV starts over when it runs again (the
    target as its own draft still has every draft accepted, so none was read from stale blocks)."""
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    stats, _, _, _ = _same(path, path, _prompts(2, (20, 24, 28, 30)), params, num_kv_blocks=18)
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_prefix_hits_and_sampled_requests(copy_model, near_draft):
    """A request that starts from cached blocks computes its own draft KV; seeded sampled requests
    (n = 2 included) get the tokens they would get without drafts."""
    path = copy_model[0]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = _prompts(3, (13,))[0]
    llm = LLM(str(path), **BASE, speculative_config=_draft(near_draft))
    first = llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
    follow = prompt + first + [5]
    hits = llm.engine.stats().prefix_cache_hits
    second = llm.generate([{"prompt_token_ids": follow}], greedy)[0].outputs[0].token_ids
    assert llm.engine.stats().prefix_cache_hits - hits == (len(follow) - 1) // 8 * 8
    want, _ = _run(path, [follow], greedy, enable_prefix_caching=False)
    assert second == want[0].outputs[0].token_ids
    llm.engine.block_manager.check_invariants()

    sampled = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, seed=11, n=2, ignore_eos=True),
               SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)]
    stats, _, _, _ = _same(path, near_draft, _prompts(6, (5, 33)), sampled)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_the_draft_pool_shares_the_kv_budget(copy_model, near_draft):
    """With a KV budget in GiB, the target's pool and the draft's (as many blocks) fit in it together,
    split by what a token takes in each model's cache."""
    path = copy_model[0]
    options = {k: v for k, v in BASE.items() if k != "num_kv_blocks"}
    budget_gb = 1 / 1024  # 1 MiB
    plain = LLM(str(path), **options, kv_cache_memory_gb=budget_gb).engine
    engine = LLM(str(path), **options, kv_cache_memory_gb=budget_gb, speculative_config=_draft(near_draft)).engine
    # the draft has 1 layer to the target's 2, the same heads: it takes a third of the budget
    assert engine.runner.num_blocks == pytest.approx(plain.runner.num_blocks * 2 / 3, abs=1)
    assert engine.drafter.runner.num_blocks == engine.runner.num_blocks
    assert engine.stats().kv_cache_bytes <= budget_gb * (1 << 30) + 2 * plain.stats().kv_cache_bytes / plain.runner.num_blocks


@pytest.mark.timeout(180)
def test_tensor_parallel_target_with_a_whole_draft_on_rank_0(copy_model, near_draft):
    """tensor_parallel_size 2: the draft model runs whole beside rank 0's shard and proposes; every
    rank verifies. The output is TP=1's without drafts (preemption, logprobs and sampling included),
    and the draft's pool has the target's blocks."""
    engine, _ = tensor_parallel_matches_one_rank(copy_model[0], _draft(near_draft))
    assert engine.drafter.runner.group.world_size == 1 and engine.runner.group.world_size == 2
    assert engine.drafter.runner.num_blocks == engine.runner.num_blocks


def test_the_drafts_passes_take_its_graphs(copy_model, near_draft):
    """On a GPU the draft model captures graphs: its one-token passes replay decode graphs, and its
    catch-up passes (the last token and the drafts kept, 1 + k at most) ones padded to 1 + k tokens a
    row; on CPU the same static path runs uncaptured. It proposes what the eager passes propose: the
    accepted counts, which the exact outputs cannot show, are equal."""
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want, plain = _run(path, _prompts(0), params, speculative_config=_draft(near_draft))
    llm = LLM(str(path), **BASE, speculative_config=_draft(near_draft))
    runner = llm.engine.drafter.runner
    assert runner.graph_width == 1 + _draft(near_draft)["num_speculative_tokens"]
    runner.graphs = runner.step_graphs()
    used, wide, run = [], [], runner.graphs.run
    runner.graphs.run = lambda chunks, key: (used.append(len(chunks)), wide.append(key.width > 1), run(chunks, key))[2]
    got = llm.generate([{"prompt_token_ids": p} for p in _prompts(0)], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats, plain_stats = llm.engine.stats(), plain.stats()
    assert stats.spec_decode_num_accepted_tokens == plain_stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens == plain_stats.spec_decode_num_draft_tokens
    assert len(used) > 10 and max(used) > 1  # batched passes of several requests, not one at a time
    assert any(wide) and not all(wide)  # catch-up passes and one-token passes
    llm.engine.block_manager.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False])
def test_a_draft_model_on_cuda_gives_the_tokens_without_it(copy_model, near_draft, eager):
    """On a GPU, eagerly and with CUDA graphs (the draft's one-token passes replayed), with the pools
    sized by the GPU memory budget, the draft's weights and pool counted."""
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    stats, _, _, engine = _same(path, near_draft, _prompts(0), params, device="cuda", enforce_eager=eager,
                                num_kv_blocks=None, gpu_memory_utilization=0.5)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert engine.drafter.runner.num_blocks == engine.runner.num_blocks
    assert (engine.drafter.runner.graphs is None) == eager


def test_a_draft_that_cannot_serve_the_target_is_refused_by_name(copy_model, tmp_path):
    path = copy_model[0]
    bigger = make_model_dir(tmp_path / "bigger", "llama", vocab_size=VOCAB + 64, with_tokenizer=False)
    with pytest.raises(ModelLoadError, match="speculative_config.model .* vocabulary of 448 tokens, more than "
                                             "the target's 384"):
        LLM(str(path), **BASE, speculative_config=_draft(bigger))
    shorter = make_model_dir(tmp_path / "shorter", "llama", vocab_size=VOCAB, max_pos=256, with_tokenizer=False)
    with pytest.raises(ModelLoadError, match="reaches 256 positions, fewer than max_model_len \\(1024\\)"):
        LLM(str(path), **BASE, speculative_config=_draft(shorter))
    build_tokenizer().save_pretrained(shorter)  # with max_model_len within its reach it serves
    outs, _ = _run(path, _prompts(4, (9,)), SamplingParams(temperature=0, max_tokens=8),
                   max_model_len=256, speculative_config=_draft(shorter))
    assert len(outs[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="model \\(the draft model, or the EAGLE-3 head\\) is required with methods 'draft_model'"):
        LLM(str(path), **BASE, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_compiled_target_and_draft_give_the_eager_tokens(tmp_path):
    """Both models compiled in one process (test_compiled_model's shape and options, so its compiled
    code is reused), each with its own graphs."""
    from tests.test_compiled_model import OPTIONS
    from tests.test_spec_decode import _copying as copying

    path = tmp_path / "qwen3"
    copying("qwen3", 512).save_pretrained(path)
    draft = tmp_path / "qwen3-draft"
    copying("qwen3", 512, seed=4).save_pretrained(draft)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _run(path, _prompts(10), params, **{**OPTIONS, "enforce_eager": True})
    got, engine = _run(path, _prompts(10), params, **OPTIONS, speculative_config=_draft(draft))
    assert engine.runner.compiled is not None and engine.drafter.runner.compiled is not None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert engine.stats().spec_decode_num_accepted_tokens > 0
