"""n > 1: several choices of one prompt, each its own sequence, sharing the prompt's KV blocks."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError

PROMPT = list(range(10, 43))  # 33 tokens: 4 full blocks of 8 and one token more


def _engine(model_dir, **options) -> LLMEngine:
    kw = dict(dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=8)
    kw.update(options)
    return LLMEngine.from_options(str(model_dir), **kw)


def _run(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def _choices(outs: list, request_id: str) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for out in outs:
        if out.request_id == request_id:
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    return tokens


def test_seeded_choices_draw_with_seed_plus_index(tiny_model_dir):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7, n=3)
    eng = _engine(tiny_model_dir)
    eng.add_request(PROMPT, params, request_id="r")
    got = _choices(_run(eng), "r")
    assert sorted(got) == [0, 1, 2]
    for i in range(3):
        alone = _engine(tiny_model_dir)
        alone.add_request(PROMPT, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7 + i))
        assert got[i] == [t for out in _run(alone) for t in out.new_token_ids]
    assert len({tuple(v) for v in got.values()}) == 3  # three distinct draws


def test_choices_share_the_prompt_blocks(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=3), request_id="r")
    outs = _run(eng)
    s = eng.stats()
    assert s.prefix_cache_queries == 3 * 33
    assert s.prefix_cache_hits == 2 * 32  # the lead computes the prompt; each sibling finds its 4 full blocks
    assert {o.index: o.num_cached_tokens for o in outs if o.finished} == {0: 0, 1: 32, 2: 32}
    greedy = _choices(outs, "r")
    assert greedy[0] == greedy[1] == greedy[2]  # greedy: the same tokens, however they were computed
    assert s.kv_blocks_used == 0 and s.num_finished == 1


def test_one_output_ends_the_request_and_it_comes_last(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    eng.add_request(PROMPT, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=2, seed=1),
                    request_id="a")
    eng.add_request(PROMPT[:5], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=2, seed=2),
                    request_id="b")
    outs = _run(eng)
    for rid in "ab":
        mine = [o for o in outs if o.request_id == rid]
        assert [o.request_finished for o in mine].count(True) == 1 and mine[-1].request_finished
        assert sorted(o.index for o in mine if o.finished) == [0, 1]
        assert all(o.choices_running >= 1 for o in mine[:-1])


def test_abort_a_choice_or_the_request(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    params = SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True, n=3, seed=3)
    eng.add_request(PROMPT, params, request_id="r")
    eng.step()
    eng.step()
    assert eng.abort("r", index=1)
    assert not eng.abort("r", index=1)
    outs = _run(eng)
    aborted = [o for o in outs if o.index == 1]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and not aborted[0].request_finished
    assert {o.index for o in outs if o.finish_reason == "length"} == {0, 2}
    assert outs[-1].request_finished and eng.stats().kv_blocks_used == 0

    eng.add_request(PROMPT, params, request_id="s")
    eng.step()
    assert eng.abort("s")
    outs = eng.step()
    assert sorted(o.index for o in outs) == [0, 1, 2] and all(o.finish_reason == "abort" for o in outs)
    assert outs[-1].request_finished and not eng.has_unfinished() and eng.stats().kv_blocks_used == 0


def test_aborting_the_lead_before_its_prefill_releases_its_siblings(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=3), request_id="r")
    assert eng.abort("r", index=0)
    outs = _run(eng)
    assert {o.index for o in outs if o.finish_reason == "length"} == {1, 2}


def test_preemption_keeps_every_choice_seeded(tiny_model_dir):
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, n=4, seed=11)
    roomy = _engine(tiny_model_dir)
    roomy.add_request(PROMPT, params, request_id="r")
    expected = _choices(_run(roomy), "r")
    tight = _engine(tiny_model_dir, num_kv_blocks=14)  # 4 shared blocks + 3 own per choice at the end: 16
    tight.add_request(PROMPT, params, request_id="r")
    assert _choices(_run(tight), "r") == expected
    assert tight.stats().num_preemptions > 0


def test_resume_choices(tiny_model_dir):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=5)
    eng = _engine(tiny_model_dir)
    eng.add_request(PROMPT, params, request_id="r")
    full = _choices(_run(eng), "r")
    again = _engine(tiny_model_dir)
    again.add_request(PROMPT, params, request_id="r", resume_choices={1: full[1][:4], 2: full[2][:7]})
    got = _choices(_run(again), "r")
    assert got == {1: full[1][4:], 2: full[2][7:]}  # choice 0 had finished: not run again

    for bad, match in [({3: []}, "resume_choices keys"), ({}, "resume_choices must map"),
                       ({0: list(range(10))}, "max_tokens"), ({"0": []}, "resume_choices keys"),
                       ({1: [], "0": []}, "resume_choices keys")]:
        with pytest.raises(InvalidRequestError, match=match):
            again.add_request(PROMPT, params, resume_choices=bad)
    with pytest.raises(InvalidRequestError, match="resume_choices for n > 1"):
        again.add_request(PROMPT, params, resume_token_ids=[1, 2])
    assert not again.has_unfinished()


@pytest.mark.parametrize("n", [0, 65, True, 1.5])
def test_n_out_of_range(tiny_model_dir, n):
    with pytest.raises(InvalidRequestError, match=r"n must|n: "):
        SamplingParams(n=n)


def test_offline_llm_returns_n_completions(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=3, seed=2)
    [out] = llm.generate({"prompt_token_ids": PROMPT}, params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert not llm.engine.has_unfinished()


def test_async_engine_streams_every_choice(tiny_model_dir):
    async def main():
        engine = AsyncEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64)
        try:
            params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=2, seed=4)
            outs = [out async for out in engine.generate(PROMPT, params)]
        finally:
            engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].request_finished and sum(o.request_finished for o in outs) == 1
    assert {i: sum(len(o.new_token_ids) for o in outs if o.index == i) for i in (0, 1)} == {0: 6, 1: 6}


# -- served: the openai SDK and the gRPC methods over one real engine (tests.real_serving) ---------------------

SERVED = {"max_num_seqs": 4, "num_kv_blocks": 40, "max_model_len": 256}
TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill."


def test_openai_n_over_a_real_engine(tiny_model_dir, tokenizer):
    """Three seeded choices whole and streamed (chat), each the offline LLM's choice of that index;
    usage counts every choice once; the siblings found the prompt's blocks in the prefix cache."""
    import httpx2
    import openai

    from deployments.openai_api import build_openai_app
    from tests.real_serving import ENGINE, real_frontend

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, **SERVED) as (frontend, replica):
            http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_openai_app(frontend)))
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
            whole = await client.completions.create(model="tiny", prompt=TEXT, n=3, seed=7, max_tokens=8,
                                                    temperature=1.0, extra_body={"ignore_eos": True})
            hits = replica.engine.stats().prefix_cache_hits
            messages = [{"role": "user", "content": TEXT}]
            chat = await client.chat.completions.create(model="tiny", messages=messages, n=2, seed=3, max_tokens=6,
                                                        temperature=1.0)
            stream = await client.chat.completions.create(model="tiny", messages=messages, n=2, seed=3,
                                                          max_tokens=6, temperature=1.0, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            await http.aclose()
            return whole, hits, chat, chunks

    whole, hits, chat, chunks = asyncio.run(asyncio.wait_for(main(), 120))
    llm = LLM(str(tiny_model_dir), **{**ENGINE, **SERVED})
    [want] = llm.generate(TEXT, SamplingParams(n=3, seed=7, max_tokens=8, temperature=1.0, ignore_eos=True))
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [o.text for o in want.outputs]
    assert len({c.text for c in whole.choices}) == 3
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens == len(tokenizer.encode(TEXT))
    assert hits >= 2 * 16 * ((len(want.prompt_token_ids) - 1) // 16) > 0  # both siblings reused the lead's blocks
    # streamed: a role chunk per choice, each choice's deltas reassemble to the whole reply
    streamed = {0: "", 1: ""}
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in chat.choices}
    assert sorted(c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason) == ["length"] * 2
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens == 12


def test_grpc_n_indexes_every_message(tiny_model_dir, tokenizer):
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
    from tests.real_serving import GrpcContext, GrpcService, real_frontend

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, **SERVED) as (frontend, _):
            request = pb.GenerateRequest(prompt=TEXT, sampling=pb.SamplingOptions(n=2, seed=9, max_tokens=5,
                                                                                   temperature=1.0, ignore_eos=True))
            return [m async for m in GrpcService(frontend).Generate(request.SerializeToString(), GrpcContext())]

    messages = asyncio.run(asyncio.wait_for(main(), 60))
    tokens = {i: [t for m in messages if m.index == i for t in m.token_ids] for i in (0, 1)}
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=16, num_kv_blocks=40)
    [want] = llm.generate(TEXT, SamplingParams(n=2, seed=9, max_tokens=5, temperature=1.0, ignore_eos=True))
    assert tokens == {o.index: list(o.token_ids) for o in want.outputs}
    assert [m.HasField("usage") for m in messages].count(True) == 1 and messages[-1].usage.completion_tokens == 10
    assert sorted(m.index for m in messages if m.finish_reason) == [0, 1]


def test_a_choice_ended_by_a_stop_string_stops_in_the_engine(tiny_model_dir, tokenizer):
    """Its sequence is aborted at once (the engine generates ~one choice's budget, not two)."""
    from deployments.requests import GenerateInput
    from tests.real_serving import real_frontend

    async def run_once(frontend, stop):
        sampling = {"n": 2, "seed": 6, "max_tokens": 40, "temperature": 1.0, "ignore_eos": True, "stop": stop}
        deltas = [d async for d in frontend.stream(await frontend.prepare(GenerateInput(prompt=TEXT,
                                                                                        sampling=sampling)))]
        return {i: ("".join(d.text for d in deltas if d.index == i),
                    [d.finish_reason for d in deltas if d.index == i and d.finish_reason]) for i in (0, 1)}

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, **SERVED) as (frontend, replica):
            free = await run_once(frontend, None)
            stop = next(free[0][0][k:k + 2] for k in range(5, 30) if free[0][0][k:k + 2] not in free[1][0])
            before = replica.engine.stats().num_generated_tokens
            stopped = await run_once(frontend, [stop])
            await asyncio.sleep(0.2)  # the abort message of choice 0 is handed back after the stream ended
            return free, stop, stopped, replica.engine.stats().num_generated_tokens - before

    free, stop, stopped, generated = asyncio.run(asyncio.wait_for(main(), 60))
    assert stopped[0] == (free[0][0][:free[0][0].index(stop)], ["stop"])
    assert stopped[1] == (free[1][0], ["length"])
    assert generated < 60  # 40 for choice 1, a few for choice 0 (80 if it ran to its budget)


def test_aborting_a_held_choice_never_runs_it_and_held_choices_count_as_waiting(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=3), request_id="r")
    assert eng.stats().waiting == 3  # the lead queued, its two siblings held for its prefill
    assert eng.abort("r", index=2)
    assert eng.stats().waiting == 2
    outs = _run(eng)
    assert [o.finish_reason for o in outs if o.index == 2] == ["abort"]
    assert {o.index for o in outs if o.finish_reason == "length"} == {0, 1}
    s = eng.stats()
    assert (s.num_finished, s.kv_blocks_used, s.waiting) == (1, 0, 0)
