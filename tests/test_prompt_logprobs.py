"""Prompt logprobs: computed in the prefill (chunked, preempted, beside cached prefixes), equal to HF's."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from tests.factories import make_model_dir

PROMPTS = [list(range(3, 40)), [7, 9, 11], [5] + list(range(100, 160))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_model_dir(tmp_path_factory.mktemp("plp"), "llama", seed=3, with_tokenizer=False)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf(hf, prompt: list[int], k: int) -> list[dict | None]:
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    out: list[dict | None] = [None]
    for q in range(len(prompt) - 1):
        entry = {prompt[q + 1]: raw[q, prompt[q + 1]].item()}
        vals, ids = raw[q].topk(k)
        for t, v in zip(ids.tolist(), vals.tolist()):
            entry.setdefault(t, v)
        out.append(entry)
    return out


def _close(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert set(g) == set(w) or len(g) == len(w)  # a near-tie may swap the last alternative
        for t, v in w.items():
            if t in g:
                assert math.isclose(g[t], v, abs_tol=1e-4), (t, g[t], v)


@pytest.mark.parametrize("knobs", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4},
                                   {"num_kv_blocks": 12, "max_num_seqs": 3, "max_tokens": 30}],
                         ids=["default", "chunked", "preempted"])
def test_prompt_logprobs_equal_hf(model, knobs):
    path, hf = model
    knobs = dict(knobs)
    max_tokens = knobs.pop("max_tokens", 6)
    llm = LLM(str(path), dtype="float32", block_size=8, **{"num_kv_blocks": 64, **knobs})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        _close(out.prompt_logprobs, _hf(hf, prompt, 3))
        assert len(out.outputs[0].token_ids) == max_tokens
    if "num_kv_blocks" in knobs:
        assert llm.engine.stats().num_preemptions > 0


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(model):
    path, hf = model
    eng = LLMEngine.from_options(str(path), dtype="float32", block_size=8, num_kv_blocks=64)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.add_request(PROMPTS[0], plain)
    while eng.has_unfinished():
        eng.step()
    hits = eng.stats().prefix_cache_hits
    eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0),
                    request_id="scored")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.stats().prefix_cache_hits == hits  # nothing taken from the cache
    first = next(o for o in outs if o.request_id == "scored" and o.new_token_ids)
    _close(first.prompt_logprobs, _hf(hf, PROMPTS[0], 0))
    assert all(o.prompt_logprobs is None for o in outs if o is not first)


def test_only_the_first_choice_scores_the_prompt(model):
    path, hf = model
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=64)
    [out] = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(
        n=3, seed=1, max_tokens=3, ignore_eos=True, prompt_logprobs=1))
    _close(out.prompt_logprobs, _hf(hf, PROMPTS[2], 1))
    assert llm.engine.stats().prefix_cache_hits == 2 * 56  # the siblings still share the prompt's blocks


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range(bad):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_the_scored_choice_comes_first(model):
    path, _ = model
    eng = LLMEngine.from_options(str(path), dtype="float32", block_size=8, num_kv_blocks=64,
                                 enable_prefix_caching=False)
    eng.add_request(PROMPTS[0], SamplingParams(n=3, max_tokens=2, ignore_eos=True, prompt_logprobs=0), "r")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].index == 0 and outs[0].prompt_logprobs is not None  # before any sibling's output


# -- served: echo over the openai SDK, prompt_logprobs over gRPC (one real engine, tests.real_serving) ---------

def _hf_tiny(model_dir, prompt_ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0], dim=-1)
    return [raw[q, prompt_ids[q + 1]].item() for q in range(len(prompt_ids) - 1)]


def test_echo_with_logprobs_over_the_openai_sdk_and_prompt_logprobs_over_grpc(tiny_model_dir, tokenizer):
    import httpx2
    import openai

    from deployments.openai_api import build_openai_app
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
    from tests.real_serving import GrpcContext, GrpcService, real_frontend

    prompt = "the quick brown fox jumps over the lazy dog"

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, num_kv_blocks=32, max_model_len=256) as (frontend, _):
            http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_openai_app(frontend)))
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
            args = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True)
            whole = await client.completions.create(logprobs=2, **args)
            streamed = [c async for c in await client.completions.create(logprobs=2, stream=True, **args)]
            plain = await client.completions.create(**args)
            await http.aclose()
            request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingOptions(max_tokens=2, prompt_logprobs=1))
            grpc_out = [m async for m in GrpcService(frontend).Generate(request.SerializeToString(), GrpcContext())]
            return whole, streamed, plain, grpc_out

    whole, streamed, plain, grpc_out = asyncio.run(asyncio.wait_for(main(), 60))
    ids = tokenizer.encode(prompt)
    want = _hf_tiny(tiny_model_dir, ids)
    (choice,) = whole.choices
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and plain.choices[0].text == choice.text
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(math.isclose(g, w, abs_tol=1e-4) for g, w in zip(lp.token_logprobs[1:len(ids)], want))
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [t for c in streamed for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    first = grpc_out[0].prompt_logprobs
    assert [e.token_id for e in first] == ids[1:]
    assert all(math.isclose(e.logprob, w, abs_tol=1e-4) for e, w in zip(first, want))
    assert all(not m.prompt_logprobs for m in grpc_out[1:])


def test_a_resumed_request_does_not_score_its_prompt_again():
    from deployments.requests import PreparedRequest

    req = PreparedRequest("r", (1, 2, 3), SamplingParams(prompt_logprobs=2, n=2))
    assert req.engine_request().params.prompt_logprobs == 2
    assert req.engine_request(resume_choices={0: [], 1: []}).params.prompt_logprobs == 2  # none came yet
    assert req.engine_request(resume_choices={1: [4]}).params.prompt_logprobs is None
    single = PreparedRequest("s", (1, 2, 3), SamplingParams(prompt_logprobs=2))
    assert single.engine_request(resume_token_ids=[4, 5]).params.prompt_logprobs is None


def test_a_step_scores_at_most_max_scored_tokens_and_the_gpu_profile_counts_them(model, monkeypatch):
    import engine.runner as runner_module
    from engine.scheduler import MAX_SCORED_TOKENS

    path, hf = model
    eng = LLMEngine.from_options(str(path), dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=1024,
                                 max_num_batched_tokens=2048)
    long = [3 + (i * 7) % 400 for i in range(MAX_SCORED_TOKENS + 100)]
    eng.add_request(long, SamplingParams(max_tokens=1, prompt_logprobs=0), request_id="scored")
    eng.add_request(long[::-1], SamplingParams(max_tokens=1), request_id="plain")
    sched = eng.scheduler.schedule()
    assert {c.request.request_id: c.num_tokens for c in sched.chunks} == {"scored": MAX_SCORED_TOKENS,
                                                                          "plain": len(long)}
    eng.scheduler.after_step(sched)  # (the step itself is not run here)
    # The GPU memory profile runs the worst step with MAX_SCORED_TOKENS logits rows more: here on CPU.
    seen = []
    monkeypatch.setattr(runner_module, "measure_peak", lambda step, device: seen.append(step()) or 0)
    assert eng.runner._profile_largest_step() == 0 and seen == [None]
