"""Speculative decoding with n-gram drafts (engine.spec_decode, engine.spec_verify): the output equals
the output without it, token for token, while drafts are really proposed, accepted and rejected.

Two tiny models: the usual random one (drafts found in its output are almost always wrong) and a
"copy" model whose next token is mostly a fixed function of the current one, cycling through
cycles of 7 tokens, so its output repeats and n-gram drafts are mostly right. Every test ends
with the block pool whole (``check_invariants``, every block free).
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.request import Request
from engine.sampler import Sampler, SamplingBatch
from engine.spec_decode import NgramProposer, Speculator
from engine.spec_verify import accepted_prefix, draft_rows
from tests.factories import build_tokenizer, make_model, make_model_dir

VOCAB = 384  # the tiny tokenizer's
PERIOD = 7
CYCLE_AT = 12
BASE = dict(dtype="float32", block_size=8, num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=64)
# Drafts whenever found: these tests check what drafting does, not when it pays (tests/test_spec_cost.py).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "cost_model": False}


def _copying(arch: str, vocab: int, seed: int = 3, layers: int = 2):
    """A tiny HF model whose greedy next token is mostly a fixed successor of the current one (the
    same successors whatever ``seed`` draws for the rest of its weights)."""
    model = make_model(arch, seed=seed, vocab_size=vocab, layers=layers)
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    successor = torch.empty(vocab, dtype=torch.long)
    for i in range(0, vocab, PERIOD):
        cycle = order[i:i + PERIOD]
        successor[cycle] = torch.roll(cycle, -1)
    with torch.no_grad():
        model.lm_head.weight[successor] = model.model.embed_tokens.weight.clone()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    return model


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory):
    """(model dir with a tokenizer, a prompt, the model's greedy output after it).

    The residual stream keeps 5 % of attention and MLP, and the LM head maps each token's embedding
    to its successor in a cycle of ``PERIOD`` tokens, so the output soon repeats. The prompt is a
    random one followed by the first ``CYCLE_AT`` tokens of its own output, so the output after it
    is the rest of that output (greedy decoding is deterministic), in its cycle. The model's EOS
    is the token 4 tokens into that rest: it occurred one period earlier, so a draft carries it."""
    path = tmp_path_factory.mktemp("copy-model")
    model = _copying("llama", VOCAB)
    start = _prompts(11, (9,))[0]
    ids = torch.tensor([start])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CYCLE_AT + 2 * PERIOD,
                         do_sample=False, pad_token_id=0)[0, len(start):].tolist()
    rest = out[CYCLE_AT:]
    assert rest[:PERIOD] == out[CYCLE_AT - PERIOD:CYCLE_AT] and len(set(rest[:PERIOD])) == PERIOD  # in its cycle
    model.config.eos_token_id = model.generation_config.eos_token_id = rest[3]
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path, start + out[:CYCLE_AT], rest


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("random-model"), "llama", seed=1, with_tokenizer=False)


def _prompts(seed: int, lengths=(5, 20, 43, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _run(path, prompts, params, **options):
    """(outputs, engine) of one engine over ``prompts``; the block pool checked whole afterwards."""
    llm = LLM(str(path), **{**BASE, **options})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free == bm.num_blocks
    return outs, llm.engine


TP_PARAMS = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
TP_PROMPTS = _prompts(24, (20, 26, 30))


def tensor_parallel_matches_one_rank(path, speculative_config):
    """tensor_parallel_size 2 with ``speculative_config`` against TP=1 without drafts: the same tokens
    for ``TP_PROMPTS`` (16 KV blocks: preemption), logprobs (within 1e-4) and seeded sampling included;
    returns (the engine, its stats)."""
    params, prompts = TP_PARAMS, TP_PROMPTS
    want, _ = _run(path, prompts, params, num_kv_blocks=16)
    llm = LLM(str(path), **{**BASE, "num_kv_blocks": 16}, tensor_parallel_size=2,
              speculative_config=speculative_config)
    try:
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.stats()
        llm.engine.block_manager.check_invariants()
    finally:
        llm.shutdown()
    assert [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in got] == \
           [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in want]
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_preemptions > 0
    for a, b in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert sorted(a) == sorted(b) and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    return llm.engine, stats


def _same(path, prompts, params, **options):
    """Outputs without and with n-gram drafts are equal; returns (the speculating engine's stats, its
    outputs, the steps the other took)."""
    want, plain = _run(path, prompts, params, **options)
    got, engine = _run(path, prompts, params, speculative_config=NGRAM, **options)
    for w, g in zip(want, got):
        assert [(c.token_ids, c.finish_reason, c.text) for c in g.outputs] == \
               [(c.token_ids, c.finish_reason, c.text) for c in w.outputs]
    assert plain.stats().spec_decode_num_drafts == 0
    return engine.stats(), got, plain.stats().num_steps


# ---------------------------------------------------------------------------- the proposer


def test_ngram_proposer_prefers_the_longest_match_then_the_fullest_continuation():
    prop = NgramProposer(min_n=1, max_n=3)
    #                    0  1  2  3  4  5  6  7  8  9
    tokens = np.array([5, 1, 2, 9, 8, 1, 2, 3, 4, 1, 2])
    # suffix [1, 2] occurs at 1-2 (then 9 8 ...) and 5-6 (then 3 4 ...); the 3-gram [4, 1, 2] nowhere
    # earlier; both 2-gram matches give 4 tokens: the latest wins
    assert prop.propose(tokens, 4) == [3, 4, 1, 2]
    assert prop.propose(tokens, 2) == [3, 4]
    # a longer match beats a later one: [8, 1, 2] only at 4-6
    assert prop.propose(np.array([8, 1, 2, 7, 7, 1, 2, 6, 8, 1, 2]), 3) == [7, 7, 1]
    # a periodic tail, matches equally long: the latest has 2 tokens after it, an earlier one the full k
    assert NgramProposer(min_n=1, max_n=2).propose(np.array([3, 4, 3, 4, 3, 4]), 3) == [3, 4, 3]
    assert prop.propose(np.array([3, 4, 3, 4, 3, 4]), 3) == [3, 4]  # but a longer match comes first


def test_ngram_proposer_respects_min_n_and_finds_nothing_without_a_match():
    assert NgramProposer(2, 4).propose(np.array([1, 2, 3, 4, 2]), 3) == []   # only a 1-gram recurs
    assert NgramProposer(1, 4).propose(np.array([1, 2, 3, 4, 2]), 3) == [3, 4, 2]
    assert NgramProposer(1, 4).propose(np.array([1, 2, 3, 4, 5]), 3) == []
    assert NgramProposer(1, 4).propose(np.array([7]), 3) == []
    assert NgramProposer(1, 4).propose(np.array([7, 7]), 0) == []


def test_config_names_the_field_and_what_is_allowed():
    assert EngineConfig.from_options("m").speculative_config is None  # off by default
    with pytest.raises(ValueError, match="speculative_config.method must be 'ngram', 'draft_model' or 'eagle3', got 'medusa'"):
        EngineConfig.from_options("m", speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in \\[1, 16\\]"):
        EngineConfig.from_options("m", speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_max must be >= prompt_lookup_min"):
        EngineConfig.from_options("m", speculative_config={**NGRAM, "prompt_lookup_min": 4})
    assert EngineConfig.from_options("m", speculative_config=NGRAM, tensor_parallel_size=2).speculative_config
    for method in ("draft_model", "eagle3"):
        assert EngineConfig.from_options("m", tensor_parallel_size=2, speculative_config={
            "method": method, "model": "d", "num_speculative_tokens": 2}).speculative_config


# ---------------------------------------------------------------------------- exact greedy output


def test_greedy_output_equals_without_drafts_with_chunked_prefill_and_acceptance(copy_model, random_model):
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # A 16-token budget: prompts go in chunks beside verifying decodes.
    stats, got, plain_steps = _same(path, _prompts(0), params, max_num_batched_tokens=16)
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # some rejected
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert stats.num_steps < plain_steps
    assert sum(o.timing.num_accepted_tokens for o in got) == stats.spec_decode_num_accepted_tokens
    # The random model's drafts are wrong nearly always: rejected, and the output is still exact.
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    stats, _, _ = _same(random_model, _prompts(1, (5, 20, 43)), params)
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens


def test_greedy_output_equals_without_drafts_under_preemption(copy_model):
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    stats, _, _ = _same(path, _prompts(2, (20, 24, 28, 30)), params, num_kv_blocks=18)
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_blocks_filled_by_accepted_drafts_serve_prefix_hits(copy_model):
    """A second request whose prompt is the first's prompt and output reuses the blocks the drafts
    filled: were any of them wrong, its output would differ from the engine's without drafts."""
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = _prompts(3, (13,))[0]
    llm = LLM(str(path), **BASE, speculative_config=NGRAM)
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    follow = prompt + first + [5]
    hits = llm.engine.stats().prefix_cache_hits
    second = llm.generate([{"prompt_token_ids": follow}], params)[0].outputs[0].token_ids
    # every full block but the one with the last token came from the cache
    assert llm.engine.stats().prefix_cache_hits - hits == (len(follow) - 1) // 8 * 8
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    want, _ = _run(path, [follow], params, enable_prefix_caching=False)
    assert second == want[0].outputs[0].token_ids
    llm.engine.block_manager.check_invariants()


# ---------------------------------------------------------------------------- stops inside a draft


def test_eos_stop_tokens_max_tokens_and_min_tokens_inside_drafts(copy_model):
    """The second step drafts the next 4 tokens of the cycle, which hold the EOS (3rd) and the stop
    token (2nd): the tokens after them are dropped, as they were never generated."""
    path, prompt, rest = copy_model
    eos, stop = rest[3], rest[2]
    cases = [(SamplingParams(temperature=0, max_tokens=30), rest[:4], "stop"),
             (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]), rest[:3], "stop"),
             (SamplingParams(temperature=0, max_tokens=30, min_tokens=6), None, None),  # EOS suppressed first
             *[(SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), rest[:m], "length")
               for m in (1, 2, 3, 5)]]
    prompts = [prompt] * len(cases)
    stats, got, _ = _same(path, prompts, [params for params, _, _ in cases])
    for (params, tokens, reason), out in zip(cases, got):
        if tokens is not None:
            assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (tokens, reason)
    assert got[0].outputs[0].token_ids[-1] == eos and got[0].timing.num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0


def test_stop_strings_cut_the_same_text(copy_model):
    path = copy_model[0]
    prompts = _prompts(5, (6, 30))
    want, _ = _run(path, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    # each prompt's stop string: 3 characters from the middle of its own text
    stops = [out.outputs[0].text[len(out.outputs[0].text) // 2:][:3] for out in want]
    assert all(stop.strip() for stop in stops)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]) for stop in stops]
    stats, got, _ = _same(path, prompts, params)
    assert all(o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) < 40 for o in got)
    assert stats.spec_decode_num_accepted_tokens > 0


# ---------------------------------------------------------------------------- sampled requests


def test_sampled_requests_get_the_tokens_they_would_get_without_drafts(copy_model):
    """Row j of a draft samples with the uniform of its output position: seeded (and engine-seeded)
    requests, n > 1 included, give the same tokens as without drafts, in any batch."""
    path = copy_model[0]
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, seed=11, n=2, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)]  # seeded by the engine
    stats, got, _ = _same(path, _prompts(6, (5, 33)), params)
    assert stats.spec_decode_num_accepted_tokens > 0
    again, _ = _run(path, _prompts(6, (5, 33)), params, speculative_config=NGRAM)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in got]


def test_rejection_sampling_keeps_the_target_distribution():
    """One draft token x against a fixed distribution p over 6 tokens, 6,000 seeds: x is accepted
    with frequency p(x), and the tokens emitted (x or the correction) follow p, as do the
    corrections p without x. Chi-square tests at 0.1 % each: a correct sampler fails one of the
    three with probability < 0.3 % per set of seeds; the seeds are fixed, so the outcome is too."""
    p = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    draft, trials = 1, 6000
    reqs = []
    for s in range(trials):
        r = Request(f"r{s}", [7], SamplingParams(temperature=1.0, seed=s), 0, s, 100, s, frozenset())
        r.token_ids.append(3)  # one output already: rows sample output positions 1 and 2
        reqs.append(r)
    rows, offsets = [], []
    for r in reqs:
        rows += [r, r]
        offsets += [0, 1]
    logits = torch.tensor(np.log(p), dtype=torch.float32).repeat(2 * trials, 1)
    tokens, _ = Sampler()(logits, SamplingBatch.build(rows, torch.device("cpu"), offsets))
    first = tokens[0::2]
    accepted = sum(accepted_prefix(tokens[2 * i:2 * i + 2], [draft]) for i in range(trials))
    from scipy.stats import binomtest, chisquare
    assert binomtest(accepted, trials, p[draft]).pvalue > 1e-3
    counts = Counter(first)
    assert chisquare([counts[t] for t in range(6)], p * trials).pvalue > 1e-3
    others = [t for t in range(6) if t != draft]
    rest = Counter(t for t in first if t != draft)
    q = p[others] / p[others].sum() * sum(rest.values())
    assert chisquare([rest[t] for t in others], q).pvalue > 1e-3
    assert draft_rows([]) == ([], [])


# ---------------------------------------------------------------------------- who speculates


def test_no_drafts_while_more_run_than_disable_by_batch_size(copy_model):
    """(Which requests draft at all: tests/test_spec_features.py.)"""
    path, prompt, _ = copy_model  # a prompt whose output is a cycle its tail already holds
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # More running than disable_by_batch_size: no step drafts (four requests that run side by side).
    prompts = [prompt] * 4
    for limit, drafted in ((3, False), (4, True)):
        _, engine = _run(path, prompts, plain, speculative_config={**NGRAM, "disable_by_batch_size": limit})
        assert (engine.stats().spec_decode_num_drafts > 0) == drafted


def test_a_request_whose_drafts_fail_backs_off():
    from engine.kv.block_manager import BlockManager
    from engine.config import SpeculativeConfig

    spec = Speculator(SpeculativeConfig(**NGRAM), BlockManager(16, 8))
    req = Request("x", [4, 5, 6, 4, 5], SamplingParams(temperature=0), 0, 0, 100, 0, frozenset())
    req.token_ids.append(6)
    req.num_computed_tokens = 5
    waits = []
    for _ in range(4):
        assert spec._room(req, 64) == 4
        spec.record(req, 4, 0)
        skipped = 0
        while spec._room(req, 64) == 0:
            skipped += 1
        waits.append(skipped)
    assert waits == [2, 4, 8, 16]
    spec.record(req, 4, 2)
    assert spec._room(req, 64) == 4 and req.timing.num_accepted_tokens == 2


def test_compiled_engine_with_drafts_gives_the_eager_tokens(tmp_path):
    """Verification steps are many-token steps: the compiled graph's general path, never the C++
    decode-only one. test_compiled_model's model shape and options, so its compiled code is reused."""
    from tests.test_compiled_model import OPTIONS

    path = tmp_path / "qwen3"
    _copying("qwen3", 512).save_pretrained(path)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _run(path, _prompts(10), params, **{**OPTIONS, "enforce_eager": True})
    got, engine = _run(path, _prompts(10), params, **OPTIONS, speculative_config=NGRAM)
    assert engine.runner.compiled is not None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_verification_steps_leave_the_decode_only_attention_path(copy_model):
    from engine.attention.cpu import CpuAttentionBackend
    from engine.attention.metadata import build_step_inputs
    from engine.scheduler import ScheduledChunk
    from engine.spec_decode import DraftChunk

    reqs = []
    for n in (9, 12):
        r = Request(f"r{n}", list(range(3, 3 + n)), SamplingParams(), 0, n, 100, 0, frozenset())
        r.block_ids, r.num_computed_tokens = [0, 1] if n == 9 else [2, 3], n - 1
        reqs.append(r)
    decode, draft = ScheduledChunk(reqs[0], 8, 1), DraftChunk(reqs[1], 11, 4, 0, [7, 8, 9])
    backend = CpuAttentionBackend(4, 2, 16, 8)
    sampling, ids, _, meta, rows = build_step_inputs([decode, draft], 8, torch.device("cpu"), drafts=True)
    assert [c.request for c in sampling] == reqs and ids.tolist() == [11, 14, 7, 8, 9]
    assert rows.tolist() == [0, 1, 2, 3, 4] and backend.decode_step_index(meta) == []
    _, _, _, meta, rows = build_step_inputs([decode], 8, torch.device("cpu"))
    assert rows.tolist() == [0] and len(backend.decode_step_index(meta)) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False])
def test_ngram_drafts_on_cuda_give_the_tokens_without_them(copy_model, eager):
    """On a GPU, eagerly and with CUDA graphs (decode and verification steps captured: tests/test_verify_graphs.py)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    stats, _, _ = _same(copy_model[0], _prompts(0), params, device="cuda", enforce_eager=eager)
    assert stats.spec_decode_num_accepted_tokens > 0
