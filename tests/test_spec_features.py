"""Speculative decoding keeps every request feature's meaning: logprobs, prompt logprobs, penalties,
grammars (drafts masked by the grammar, the matcher rolled back after a rejection) and LoRA
adapters give what they give without drafts, while those requests really draft.

test_spec_decode's "copy" model (its output soon cycles, so n-gram drafts are often right); every run
ends with the block pool whole.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from engine.kv.block_manager import BlockManager
from engine.request import Request
from engine.spec_decode import Speculator
from tests.factories import make_lora_dir
from tests.test_spec_decode import (BASE, NGRAM, _prompts, _run, copy_model,  # noqa: F401 (a fixture)
                                    tensor_parallel_matches_one_rank)


def _both(path, prompts, params, **options):
    """(outputs without drafts, outputs with n-gram drafts, the drafting engine's stats)."""
    want, _ = _run(path, prompts, params, **options)
    got, engine = _run(path, prompts, params, speculative_config=NGRAM, **options)
    return want, got, engine.stats()


def _tokens(outs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def test_logprobs_and_prompt_logprobs_are_those_of_each_position(copy_model):
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    want, got, stats = _both(path, _prompts(20, (9, 30)), params)
    assert _tokens(got) == _tokens(want)
    assert stats.spec_decode_num_accepted_tokens > 0 and all(o.timing.num_accepted_tokens > 0 for o in got)
    # The audit trail says what each request drafted (and a gRPC AuditEvent carries it).
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
    from engine.outputs import audit_records
    for o in got:
        event = next(e for e in audit_records(o.timing) if e["event"] == "speculated")
        t = o.timing
        assert (event["drafts"], event["draft_tokens"], event["accepted_tokens"]) == \
            (t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens)
        assert pb.AuditEvent(**event).accepted_tokens == t.num_accepted_tokens
    assert not any(e["event"] == "speculated" for e in audit_records(want[0].timing))
    for w, g in zip(want, got):
        assert [sorted(e) for e in g.prompt_logprobs[1:]] == [sorted(e) for e in w.prompt_logprobs[1:]]
        lw, lg = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert len(lg) == len(lw) == 32
        for a, b in zip(lw, lg):  # the same alternatives; values up to a verify chunk's float rounding
            assert sorted(a) == sorted(b)
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.6},
                                     {"presence_penalty": 0.8}])
def test_penalties_count_the_drafts_before_each_row(copy_model, penalty):
    """A row after j drafts is penalised as if they were output already: without that the rows
    would sample other tokens than decoding one at a time does, and the outputs would differ."""
    path = copy_model[0]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **penalty),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, **penalty)]
    want, got, stats = _both(path, _prompts(21, (12, 25)), params)
    assert _tokens(got) == _tokens(want)
    assert stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("seed", [None, 4])
def test_drafts_follow_the_grammar_and_a_rejection_rolls_it_back(copy_model, seed):
    """Drafts past what the grammar allows are cut; rejected drafts leave the matcher where the kept
    tokens put it, so the constrained output is the one without drafts."""
    path = copy_model[0]
    temperature = 0 if seed is None else 0.9
    specs = [{"regex": "([ab][cd] ){4,30}x"}, {"choice": ["abab abab abab abab", "cdcd cdcd cdcd"]},
             {"regex": "(la ){10}[a-z ]{0,40}"}]
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=60, structured_outputs=spec)
              for spec in specs]
    want, got, stats = _both(path, [_prompts(22, (7,))[0]] * len(specs), params)
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # and some rejected


def test_lora_requests_draft_and_keep_their_adapter(copy_model, tmp_path):
    path = copy_model[0]
    adapter = make_lora_dir(path, tmp_path / "adapter", rank=4, seed=2, scale=0.05)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(23, (10, 20))]
    outs = {}
    for name, spec in (("plain", None), ("drafts", NGRAM)):
        llm = LLM(str(path), **BASE, lora={"adapters": {"small": str(adapter)}, "max_loras": 2},
                  speculative_config=spec)
        outs[name] = llm.generate(prompts, params, lora="small"), llm.generate(prompts, params)
        llm.engine.block_manager.check_invariants()
    (adapted, base), (adapted_drafts, base_drafts) = outs["plain"], outs["drafts"]
    assert _tokens(adapted_drafts) == _tokens(adapted) != _tokens(base) == _tokens(base_drafts)
    assert sum(o.timing.num_accepted_tokens for o in adapted_drafts) > 0


def test_min_tokens_and_draft_model_grammars_stay_one_token_a_step(copy_model):
    """Short of ``min_tokens`` a request decodes alone (EOS is masked per request, not per row);
    with a draft model a grammar request does too (its drafts come after scheduling, unchecked)."""
    path, prompt, _ = copy_model
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    held = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=20)
    outs, _ = _run(path, [prompt] * 2, [plain, held], speculative_config=NGRAM)
    assert outs[0].timing.num_drafts > 0 and outs[1].timing.num_drafts == 0
    blocks = BlockManager(64, 8, True)
    for method, extra in (("ngram", {}), ("draft_model", {"model": "m"})):
        spec = Speculator(SpeculativeConfig(method=method, num_speculative_tokens=4, **extra), blocks)
        req = Request("x", prompt, plain, 0, 0, 1000, 0, frozenset())
        req.token_ids.append(1)  # its first output token
        req.num_computed_tokens = len(prompt)
        req.matcher = object()
        assert spec._room(req, 64) == (4 if method == "ngram" else 0)


def test_a_draft_row_is_penalised_as_a_decode_after_its_drafts_would_be():
    """apply_penalties' rows after j drafts equal the rows of a request whose output already holds
    those drafts: repetition, frequency and presence alike."""
    import torch

    from engine.sampler import apply_penalties
    from engine.spec_decode import _DraftState

    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)
    prompt, output, drafts = [5, 6, 7], [8, 8, 9], [9, 10, 10]

    def request(out):
        req = Request("x", prompt, params, 0, 0, 100, 0, frozenset())
        req.token_ids.extend(out)
        req.spec = _DraftState(req, False)
        req.spec.drafts = drafts
        return req

    logits = torch.randn(len(drafts) + 1, 16, generator=torch.Generator().manual_seed(0))
    req = request(output)
    got = apply_penalties(logits, [req] * len(logits), list(range(len(logits))))
    for j in range(len(logits)):
        want = apply_penalties(logits[j:j + 1], [request(output + drafts[:j])])
        torch.testing.assert_close(got[j:j + 1], want, rtol=0, atol=0)
    assert not torch.equal(got[1], apply_penalties(logits[1:2], [req])[0])  # the drafts do count


@pytest.mark.timeout(180)
def test_tensor_parallel_ranks_verify_drafts_alike(copy_model):
    """With tensor_parallel_size 2 every rank's LM head computes a row per draft position (the step
    message says which chunks verify drafts): the output is TP=1's without drafts, under preemption,
    logprobs and sampling included."""
    tensor_parallel_matches_one_rank(copy_model[0], NGRAM)
