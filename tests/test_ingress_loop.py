"""The ingress's event loop stays free: work that grows with one request's size (its grammar's first
compilation, its prompt's logprobs turned into text) runs on a worker thread, so every other stream
on that ingress keeps going. Each case makes that work hold its thread until a stream running beside
it has received more tokens: on the event loop, that stream could not move, and the work would give
up waiting and fail the request."""

from __future__ import annotations

import asyncio
import threading

import deployments.frontend as frontend
import deployments.requests as requests
from deployments.requests import GenerateInput
from deployments.textstream import TextAssembler
from tests.serving_helpers import make_frontend, run
from tests.waits import async_wait_until

TOKENS_MEANWHILE = 5
WAIT_S = 30.0  # only a failing run waits this long


class _Beside:
    """A stream running beside the work, and the work's wait for it to move."""

    def __init__(self) -> None:
        self.started, self.moved = threading.Event(), threading.Event()
        self.tokens_meanwhile = 0

    def hold(self, fn):
        def held(*args, **kwargs):
            self.started.set()
            assert self.moved.wait(WAIT_S), "no stream moved while this work held its thread"
            return fn(*args, **kwargs)
        return held

    async def run(self, fe, work) -> None:
        req = await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 2000}))
        seen = 0

        async def consume():
            nonlocal seen
            async for delta in fe.stream(req):
                seen += 1
                if self.started.is_set():
                    self.tokens_meanwhile += len(delta.token_ids)
                    if self.tokens_meanwhile >= TOKENS_MEANWHILE:
                        self.moved.set()

        task = asyncio.create_task(consume())
        await async_wait_until(lambda: seen >= 3, "the stream beside under way")
        try:
            await work()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert self.tokens_meanwhile >= TOKENS_MEANWHILE


def test_a_new_grammar_compiles_off_the_loop(tokenizer, monkeypatch):
    beside = _Beside()
    monkeypatch.setattr(requests, "check_grammar", beside.hold(requests.check_grammar))

    async def main():
        fe, _ = make_frontend(tokenizer, step_delay_s=0.005)

        async def work():
            await fe.prepare(GenerateInput(prompt="x", sampling={"max_tokens": 4,
                                                                 "structured_outputs": {"json_object": True}}))
        await beside.run(fe, work)
    run(main())


def test_a_long_prompts_logprobs_become_text_off_the_loop(tokenizer, monkeypatch):
    beside = _Beside()
    monkeypatch.setattr(TextAssembler, "_prompt_logprobs", beside.hold(TextAssembler._prompt_logprobs))
    monkeypatch.setattr(frontend, "OFFLOAD_DECODES", 64)  # this prompt stands for a 32k-token one

    async def main():
        fe, _ = make_frontend(tokenizer, step_delay_s=0.005)
        echo = await fe.prepare(GenerateInput(prompt_token_ids=tuple(range(1, 65)),
                                              sampling={"max_tokens": 2, "prompt_logprobs": 1}))

        async def work():
            _, deltas = await fe.generate_all(echo)
            assert len(deltas[0].prompt_logprobs) == 64  # the work was done, and its result arrived
        await beside.run(fe, work)
    run(main())
