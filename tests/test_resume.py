"""A request outlives its engine replica: it resumes elsewhere from the tokens already sent.

Engine level: ``resume_token_ids`` recomputes what was produced and goes on with exactly
the tokens an undisturbed run produces (greedy and seeded). Serving level (fake engines,
no Ray): a replica killed mid-stream, a full replica's refusal, and a request that runs
out of replicas.
"""

from __future__ import annotations

import pytest

from deployments.errors import Overloaded, Unavailable
from deployments.frontend import MAX_RESUMES
from deployments.requests import GenerateInput
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from tests.serving_helpers import make_frontend, run
from tests.waits import async_wait_until

PROMPT = [5, 9, 13, 200, 7, 31]
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)


def _tokens(engine: LLMEngine, params: SamplingParams, resume=()) -> list[int]:
    engine.add_request(PROMPT, params, "r", resume_token_ids=resume)
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            last = o
    assert last.num_output_tokens == params.max_tokens
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
], ids=["greedy", "seeded"])
def test_engine_resume_gives_the_undisturbed_tokens(tiny_model_dir, params):
    full = _tokens(LLMEngine.from_options(str(tiny_model_dir), **ENGINE), params)
    for cut in (1, 7, 15):
        # A fresh engine, as another replica would be; the resumed tokens are not sent again.
        rest = _tokens(LLMEngine.from_options(str(tiny_model_dir), **ENGINE), params, full[:cut])
        assert rest == full[cut:], cut


def test_engine_resume_is_validated(tiny_model_dir):
    engine = LLMEngine.from_options(str(tiny_model_dir), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4)
    for resume, needle in [([1, 2, 3, 4], "leaves nothing to generate"), ([-1], "integers"),
                           ([10**9], "integers")]:
        with pytest.raises(InvalidRequestError, match=needle):
            engine.add_request(PROMPT, params, "r", resume_token_ids=resume)
    assert not engine.has_unfinished()


# -- serving ---------------------------------------------------------------------------

def _frontend(tokenizer, replicas=2, **options):
    return make_frontend(tokenizer, replicas=replicas, **options)


async def _ids(fe, max_tokens=60, **kw):
    req = await fe.prepare(GenerateInput(prompt_token_ids=(3, 4, 5), sampling={"max_tokens": max_tokens}, **kw))
    _, deltas = await fe.generate_all(req)
    return [t for d in deltas for t in d.token_ids], deltas[-1]


def test_stream_resumes_on_another_replica_without_gaps_or_duplicates(tokenizer):
    async def main():
        want, _ = await _ids(_frontend(tokenizer, replicas=1)[0])
        fe, reps = _frontend(tokenizer, step_delay_s=0.01)
        req = await fe.prepare(GenerateInput(prompt_token_ids=(3, 4, 5), sampling={"max_tokens": 60}))
        got, last = [], None
        async for delta in fe.stream(req):
            got += delta.token_ids
            last = delta
            running = [r for r in reps if r.engine.stats().running]
            if len(got) >= 10 and running and all(r.healthy() for r in reps):
                running[0].engine.kill()  # the replica dies mid-stream
        assert sum(not r.healthy() for r in reps) == 1
        assert got == want and last.finish_reason == "length"
        assert last.usage.completion_tokens == 60 == len(got)
    run(main())


def test_request_that_runs_out_of_replicas_fails_unavailable(tokenizer):
    async def main():
        fe, reps = _frontend(tokenizer, replicas=1, step_delay_s=0.01)
        req = await fe.prepare(GenerateInput(prompt_token_ids=(3, 4, 5), sampling={"max_tokens": 60}))
        stream = fe.stream(req)
        await stream.__anext__()
        reps[0].engine.kill()
        with pytest.raises(Unavailable, match="not resumed again"):
            async for _ in stream:
                pass
    run(main())


def test_a_request_that_crashes_replicas_is_given_up_after_two(tokenizer):
    """A poison request must not take down every replica in turn."""
    async def main():
        fe, reps = _frontend(tokenizer, replicas=4, step_delay_s=0.01)
        req = await fe.prepare(GenerateInput(prompt_token_ids=(3, 4, 5), sampling={"max_tokens": 400}))
        with pytest.raises(Unavailable, match="2 times"):
            async for _ in fe.stream(req):
                for rep in reps:  # whichever replica runs it dies
                    if rep.healthy() and rep.engine.stats().running:
                        rep.engine.kill()
        assert sum(not r.healthy() for r in reps) == MAX_RESUMES + 1
    run(main())


def test_a_request_whose_replicas_are_lost_twice_is_given_up(tokenizer):
    """A replica whose link drops (its process killed, its node gone) counts as one whose engine loop
    died: the ingress cannot tell a poison request's kernel fault from a lost node."""
    async def main():
        fe, reps = _frontend(tokenizer, replicas=4, step_delay_s=0.01)
        req = await fe.prepare(GenerateInput(prompt_token_ids=(3, 4, 5), sampling={"max_tokens": 400}))
        lost = set()
        with pytest.raises(Unavailable, match="2 times"):
            async for _ in fe.stream(req):
                for rep in reps:  # whichever replica runs it vanishes
                    if rep.replica_id not in lost and rep.engine.stats().running:
                        lost.add(rep.replica_id)
                        await rep._link.close()
        assert 1 <= len(lost) <= 2  # at most one more replica than the first
        assert sum(not r.healthy() for r in reps) == 0  # links gone, engines fine: nothing crashed
    run(main())


def test_full_replica_is_retried_on_one_with_room_else_refused_at_once(tokenizer):
    async def main():
        fe, (a, b) = _frontend(tokenizer, max_num_seqs=1, max_waiting=0, step_delay_s=0.01)
        busy = await fe.prepare(GenerateInput(prompt_token_ids=(3, 4), sampling={"max_tokens": 400}))
        holder = fe.stream(busy)
        await holder.__anext__()                      # a: full
        await _ids(fe, max_tokens=2)                  # b, done: the next pick is a again
        assert (a.engine.stats().running, b.engine.stats().running) == (1, 0)
        ids, last = await _ids(fe, max_tokens=5)      # a refuses; b has room and serves it
        assert len(ids) == 5 and last.finish_reason == "length" and b.engine.stats().num_finished == 2
        # Both full: the client hears at once, no retry loop.
        other = fe.stream(await fe.prepare(GenerateInput(prompt_token_ids=(7, 8), sampling={"max_tokens": 400})))
        await other.__anext__()
        await async_wait_until(lambda: b.engine.stats().running == 1, "b full")
        with pytest.raises(Overloaded):
            await _ids(fe, max_tokens=5)
        await holder.aclose()
        await other.aclose()
    run(main())
