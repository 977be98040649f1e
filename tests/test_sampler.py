"""Sampling: seeded batch invariance, filters, penalties, min_tokens, stop ids, logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import (SAMPLING_EPS, Sampler, SamplingBatch, apply_penalties, greedy_tokens, hashed_uniform,
                            inverse_cdf)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randrange(2, 40))]} for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=256, max_num_seqs=32)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_seeded_sampling_is_batch_invariant(llm, tiny_model_dir):
    target = _prompts(1, seed=42)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm, [target], sp)[0]
    others = _prompts(31, seed=7)
    mixed_params = [SamplingParams(temperature=0.7 + 0.01 * i, max_tokens=5 + i, ignore_eos=True)
                    for i in range(31)]
    batch = llm.generate(others[:15] + [target] + others[15:], mixed_params[:15] + [sp] + mixed_params[15:])
    assert batch[15].outputs[0].token_ids == alone
    # After preemption and recompute: a pool too small for 32 concurrent requests.
    small = LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=40, max_num_seqs=32)
    out = small.generate(others[:15] + [target] + others[15:], mixed_params[:15] + [sp] + mixed_params[15:])
    assert small.engine.stats().num_preemptions > 0
    assert out[15].outputs[0].token_ids == alone
    # A different seed gives a different sample (24 tokens from a ~380-token vocabulary).
    assert _tokens(llm, [target], SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True))[0] != alone


def test_filters_that_leave_one_token_equal_greedy(llm):
    prompts = _prompts(4, seed=3)
    greedy = _tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for sp in (SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True, seed=1),
               SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, ignore_eos=True, seed=2),
               SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8, ignore_eos=True, seed=3)):
        assert _tokens(llm, prompts, sp) == greedy, sp


def test_unseeded_sampling_varies_and_stays_in_top_k(llm):
    prompt = _prompts(1, seed=11)
    runs = [_tokens(llm, prompt, SamplingParams(temperature=1.0, top_k=5, max_tokens=16, ignore_eos=True))[0]
            for _ in range(3)]
    assert len({tuple(r) for r in runs}) > 1


def test_hashed_uniform_is_uniform_and_deterministic():
    seeds = torch.arange(50_000, dtype=torch.int64) * 7919 - 2**40
    pos = torch.arange(50_000, dtype=torch.int64) % 300
    u = hashed_uniform(seeds, pos)
    assert torch.equal(u, hashed_uniform(seeds, pos))
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - 5_000).abs().max() < 300  # ~4 sigma of a binomial(50k, 0.1)
    assert hashed_uniform(seeds[:1], pos[:1] + 1).item() != u[0].item()


def _batch(temperature, **filters):
    n = len(temperature)
    t = torch.tensor(temperature, dtype=torch.float32)
    top_k = torch.tensor(filters.get("top_k", [0] * n))
    top_p = torch.tensor(filters.get("top_p", [1.0] * n))
    min_p = torch.tensor(filters.get("min_p", [0.0] * n))
    return SamplingBatch(
        requests=[None] * n, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p,
        seeds=torch.arange(n, dtype=torch.int64) * 1_000_003, positions=torch.full((n,), 3),
        all_greedy=False, all_random=bool((t >= SAMPLING_EPS).all()), any_top_k=bool((top_k > 0).any()),
        any_top_p=bool((top_p < 1).any()), any_min_p=bool((min_p > 0).any()), any_penalty=False,
        any_min_tokens=False, any_logit_bias=False, any_structured=False, max_logprobs=None)


def test_samples_follow_the_tempered_distribution():
    """4,000 rows of one distribution, each with its own seed: frequencies match softmax(l / T)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -30.0, 1.5, -0.5])
    rows = 4_000
    for temp in (1.0, 0.5):
        tokens, _ = Sampler()(logits.repeat(rows, 1), _batch([temp] * rows))
        freq = torch.bincount(torch.tensor(tokens), minlength=8).float() / rows
        want = torch.softmax(logits / temp, dim=-1)
        sigma = (want * (1 - want) / rows).sqrt()
        assert ((freq - want).abs() <= 4 * sigma + 1e-3).all(), (temp, freq, want)


def test_filters_are_respected_and_greedy_rows_stay_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 2
    batch = _batch([1.0, 1.0, 1.0, 0.0, 2.0, 1.0], top_k=[5, 0, 0, 0, 0, 3], top_p=[1.0, 0.3, 1.0, 1.0, 1.0, 0.9],
                   min_p=[0.0, 0.0, 0.2, 0.0, 0.0, 0.0])
    for seed_shift in range(20):
        batch.positions = torch.full((6,), seed_shift)
        tokens, _ = Sampler()(logits, batch)
        assert tokens[0] in logits[0].topk(5).indices.tolist()
        probs = torch.softmax(logits[1], -1)
        ordered = probs.sort(descending=True)
        nucleus = ordered.indices[:int((ordered.values.cumsum(0) - ordered.values < 0.3).sum())]
        assert tokens[1] in nucleus.tolist()
        p2 = torch.softmax(logits[2], -1)
        assert p2[tokens[2]] >= 0.2 * p2.max()
        assert tokens[3] == logits[3].argmax().item()
        assert tokens[5] in logits[5].topk(3).indices.tolist()


def test_inverse_cdf_never_lands_on_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0], [0.25, 0.0, 0.0, 0.0, 0.0]])
    for u in (1e-12, 0.4999, 0.5, 1 - 2.0 ** -53):  # the last rounds to 1.0 in float32
        got = inverse_cdf(probs.clone(), torch.full((3,), u, dtype=torch.float64)).tolist()
        assert got[0] == (1 if u < 0.5 else 3) and got[1:] == [2, 0], (u, got)


def test_penalties_match_a_naive_implementation():
    from engine.request import Request

    torch.manual_seed(0)
    logits = torch.randn(2, 20)
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams()]
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", [1, 2, 3], p, 0, i, 100, 0, frozenset())
        r.token_ids += [3, 4, 4]
        reqs.append(r)
    got = apply_penalties(logits, reqs)
    want = logits.clone()
    for t in {1, 2, 3, 4}:  # repetition: prompt + output
        want[0, t] = want[0, t] / 1.5 if want[0, t] > 0 else want[0, t] * 1.5
    for t, c in {3: 1, 4: 2}.items():  # presence / frequency: output only
        want[0, t] -= 0.25 * c + 0.5
    assert torch.allclose(got, want)
    assert torch.equal(got[1], logits[1])


def test_min_tokens_and_stop_token_ids(llm):
    prompt = _prompts(1, seed=21)
    first = _tokens(llm, prompt, SamplingParams(temperature=0, max_tokens=1))[0][0]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first]))[0]
    assert stopped.outputs[0].token_ids == [first]
    assert stopped.outputs[0].finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first], min_tokens=4))[0]
    assert len(held.outputs[0].token_ids) >= 4
    assert first not in held.outputs[0].token_ids[:4]


def test_logprobs_match_hf(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = _prompts(1, seed=5)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True))[0].outputs[0]
    ids = prompt["prompt_token_ids"] + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(prompt["prompt_token_ids"])
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[n - 1 + j]
        assert abs(lp[tok] - row[tok].item()) < 1e-4
        top = row.topk(4).indices.tolist()
        assert set(top) <= set(lp)
        assert len(lp) == 4  # the greedy token is the top-1


def test_max_tokens_none_stops_at_context_length(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=40, block_size=8, num_kv_blocks=32)
    out = llm.generate(_prompts(1, seed=2), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert out.outputs[0].finish_reason == "length"


def test_logit_bias_matches_hf_sequence_bias_in_a_mixed_batch(llm, tiny_model_dir):
    """Greedy with ``logit_bias`` equals HF's ``generate(sequence_bias=...)``, each request its own bias,
    in one batch with requests that have none; -100 bans a token the model would pick."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = _prompts(4, seed=21)
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    greedy = _tokens(llm, prompts, plain)
    banned = greedy[0][0]
    biases = [{banned: -100.0}, {t: 7.5 for t in greedy[1][:3]} | {5: -2.0}, None, {17: 100.0}]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=b) for b in biases]
    got = _tokens(llm, prompts, params)
    for prompt, bias, tokens in zip(prompts, biases, got):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        extra = {"sequence_bias": {(t,): v for t, v in bias.items()}} if bias else {}
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                               do_sample=False, pad_token_id=0, **extra)[0, ids.shape[1]:].tolist()
        assert tokens == want, bias
    assert got[2] == greedy[2]  # no bias: untouched by its neighbours'
    assert banned not in got[0] and got[3] == [17] * 10


def test_logit_bias_outside_the_vocabulary_is_refused_naming_it(llm):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate(_prompts(1), SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))
    assert llm.generate(_prompts(1), SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_tiny_temperatures_are_greedy_and_broken_rows_stay_in_the_vocabulary():
    """1e-38 passes validation but overflows l / T: below 1e-5 a row is greedy. A NaN row (a broken
    model) draws the last id, never one past the vocabulary (which would crash the step)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[2] = float("nan")
    tokens, _ = Sampler()(logits.clone(), _batch([1e-38, 1.0, 1.0]))
    assert tokens[0] == logits[0].argmax().item()
    assert all(0 <= t < 50 for t in tokens)


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    logits = torch.randn(5, 300)
    logits[:, [17, 40, 299]] = 50.0
    logits[4, 3] = 60.0
    assert greedy_tokens(logits).tolist() == [17, 17, 17, 17, 3] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_says_what_its_requests_ask(seed):
    """The batch's flags and tensors against the requests' own parameters, over random mixes (the
    rows are cached per request, so a request sampled in two batches is checked twice)."""
    from engine.request import Request

    rng = random.Random(seed)
    choices = [dict(temperature=0.0), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.9),
               dict(temperature=1.0, min_p=0.1, logprobs=3), dict(temperature=0.0, presence_penalty=0.5),
               dict(temperature=0.5, logit_bias={3: 1.0}), dict(temperature=1.0, min_tokens=4, max_tokens=8),
               dict(temperature=0.0, top_k=-1, logprobs=0)]
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(**rng.choice(choices)), 0, i, 100, rng.randrange(1 << 40),
                    frozenset()) for i in range(12)]
    for r in reqs:
        r.token_ids += [4] * rng.randrange(6)
    for batch_reqs in (reqs, rng.sample(reqs, 5), reqs[:1]):
        b = SamplingBatch.build(batch_reqs, torch.device("cpu"))
        ps = [r.params for r in batch_reqs]
        assert b.temperature.tolist() == pytest.approx([p.temperature for p in ps])
        assert b.top_k.tolist() == [max(p.top_k, 0) for p in ps]
        assert b.top_p.tolist() == pytest.approx([p.top_p for p in ps])
        assert b.min_p.tolist() == pytest.approx([p.min_p for p in ps])
        assert b.seeds.tolist() == [r.seed for r in batch_reqs]
        assert b.positions.tolist() == [r.num_output_tokens for r in batch_reqs]
        assert b.all_greedy == all(p.temperature < SAMPLING_EPS for p in ps)
        assert b.all_random == all(p.temperature >= SAMPLING_EPS for p in ps)
        assert (b.any_top_k, b.any_top_p, b.any_min_p) == (any(p.top_k > 0 for p in ps), any(p.top_p < 1 for p in ps),
                                                           any(p.min_p > 0 for p in ps))
        assert b.any_penalty == any(p.uses_penalties for p in ps)
        assert b.any_logit_bias == any(bool(p.logit_bias) for p in ps)
        assert b.any_min_tokens == any(r.num_output_tokens < r.params.min_tokens for r in batch_reqs)
        logprobs = [p.logprobs for p in ps if p.logprobs is not None]
        assert b.max_logprobs == (max(logprobs) if logprobs else None)
