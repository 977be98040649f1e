"""The ingress's event loop stays free: work that grows with one request's size (its grammar's first
compilation, its prompt's logprobs turned into text) runs on a worker thread, so every other stream
on that ingress keeps its pace. Each case makes that work take SLOW_S and measures the longest gap
between the tokens of a stream running beside it."""

from __future__ import annotations

import asyncio
import time

import deployments.frontend as frontend
import deployments.requests as requests
from deployments.requests import GenerateInput
from deployments.textstream import TextAssembler
from tests.serving_helpers import make_frontend, run
from tests.waits import async_wait_until

SLOW_S = 0.6
STEP_S = 0.01


async def _longest_gap_while(fe, work) -> tuple[float, float]:
    """(the longest gap between a running stream's tokens while ``work()`` ran, how long it ran)."""
    req = await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 400}))
    stamps: list[float] = []

    async def consume():
        async for _ in fe.stream(req):
            stamps.append(time.monotonic())

    task = asyncio.create_task(consume())
    await async_wait_until(lambda: len(stamps) >= 5, "the stream under way")
    t0 = time.monotonic()
    await work()
    took = time.monotonic() - t0
    await asyncio.sleep(5 * STEP_S)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    before = max(i for i, t in enumerate(stamps) if t < t0)  # the gap that spans t0 counts
    during = [t for t in stamps[before:] if t <= t0 + took + STEP_S]
    return max(b - a for a, b in zip(during, during[1:])), took


def _slow(fn):
    def slow(*args, **kwargs):
        time.sleep(SLOW_S)  # blocks whatever thread runs it, as a large compile or decode does
        return fn(*args, **kwargs)
    return slow


def test_a_new_grammar_compiles_off_the_loop(tokenizer, monkeypatch):
    monkeypatch.setattr(requests, "check_grammar", _slow(requests.check_grammar))

    async def main():
        fe, _ = make_frontend(tokenizer, step_delay_s=STEP_S)

        async def work():
            await fe.prepare(GenerateInput(prompt="x", sampling={"max_tokens": 4,
                                                                 "structured_outputs": {"json_object": True}}))
        gap, took = await _longest_gap_while(fe, work)
        assert took >= SLOW_S and gap < SLOW_S / 2, (gap, took)
    run(main())


def test_a_long_prompts_logprobs_become_text_off_the_loop(tokenizer, monkeypatch):
    monkeypatch.setattr(TextAssembler, "_prompt_logprobs", _slow(TextAssembler._prompt_logprobs))
    monkeypatch.setattr(frontend, "OFFLOAD_DECODES", 64)  # this prompt stands for a 32k-token one

    async def main():
        fe, _ = make_frontend(tokenizer, step_delay_s=STEP_S)
        echo = await fe.prepare(GenerateInput(prompt_token_ids=tuple(range(1, 65)),
                                              sampling={"max_tokens": 2, "prompt_logprobs": 1}))

        async def work():
            _, deltas = await fe.generate_all(echo)
            assert len(deltas[0].prompt_logprobs) == 64  # the work was done, and its result arrived

        gap, took = await _longest_gap_while(fe, work)
        assert took >= SLOW_S and gap < SLOW_S / 2, (gap, took)
    run(main())
