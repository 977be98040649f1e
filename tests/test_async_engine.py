"""AsyncEngine: concurrent streams, coalescing, cancellation, overload, health."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import AsyncEngine, EngineDeadError, EngineOverloadedError, InvalidRequestError, LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randrange(2, 50))] for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=128,
                                   max_num_seqs=4, max_waiting=16)
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, params=GREEDY, **kw):
    msgs = [out async for out in engine.generate(prompt, params, **kw)]
    return [t for m in msgs for t in m.new_token_ids], msgs


async def _until(cond, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def _wait_idle(engine, timeout=5.0):
    async def wait():
        for _ in range(int(timeout / 0.02)):
            s = engine.stats()
            if s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0:
                return s
            await asyncio.sleep(0.02)
        raise AssertionError(f"engine not idle: {engine.stats()}")
    return asyncio.run(wait())


def test_concurrent_streams_equal_offline(engine, tiny_model_dir):
    prompts = _prompts(10, seed=1)
    offline = LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in offline.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]

    async def run():
        return await asyncio.gather(*(_collect(engine, p, request_id=f"c{i}") for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    assert [toks for toks, _ in results] == want
    for toks, msgs in results:
        assert msgs[-1].finished and msgs[-1].finish_reason == "length"
        assert msgs[-1].timing.first_token_time is not None
    _wait_idle(engine)


def test_slow_consumer_gets_coalesced_messages(engine):
    async def run():
        msgs = []
        async for out in engine.generate(_prompts(1, seed=2)[0], GREEDY):
            msgs.append(out)
            await asyncio.sleep(0.15)  # the loop keeps stepping meanwhile
        return msgs

    msgs = asyncio.run(run())
    assert sum(len(m.new_token_ids) for m in msgs) == 12
    assert len(msgs) < 12
    assert max(len(m.new_token_ids) for m in msgs) > 1


def test_cancelled_stream_frees_slot_and_blocks(engine):
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def run():
        gen = engine.generate(_prompts(1, seed=3)[0], long, request_id="to-cancel")
        await gen.__anext__()
        assert engine.stats().running >= 1
        await gen.aclose()  # what a disconnecting client does

    asyncio.run(run())
    stats = _wait_idle(engine)
    assert stats.num_aborted >= 1


def test_task_cancellation_aborts(engine):
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def run():
        task = asyncio.create_task(_collect(engine, _prompts(1, seed=4)[0], long))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    _wait_idle(engine)


def test_invalid_requests_are_rejected_before_queueing(engine):
    async def first(prompt, params=GREEDY, **kw):
        return await engine.generate(prompt, params, **kw).__anext__()

    for bad in ([], [10**6], "text", [1.5]):
        with pytest.raises(InvalidRequestError):
            asyncio.run(first(bad))
    with pytest.raises(InvalidRequestError, match="prompt has"):
        asyncio.run(first([5] * 2000))
    assert engine.stats().waiting == 0


def test_overload_raises_and_others_keep_running(tiny_model_dir):
    eng = AsyncEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64,
                                   max_num_seqs=1, max_waiting=2)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def run():
        prompts = _prompts(3, seed=5)
        tasks = [asyncio.create_task(_collect(eng, prompts[0], long))]
        await _until(lambda: eng.stats().running == 1)
        tasks += [asyncio.create_task(_collect(eng, p, long)) for p in prompts[1:]]
        await _until(lambda: eng.stats().waiting == 2)
        with pytest.raises(EngineOverloadedError, match="max_waiting"):
            await _collect(eng, _prompts(1, seed=6)[0], long)
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
        assert all(len(toks) == 40 for toks, _ in results)
    finally:
        eng.shutdown()


def test_health_fails_after_the_loop_dies(tiny_model_dir):
    eng = AsyncEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=32)
    eng.check_health()

    def boom():
        raise RuntimeError("simulated kernel failure")

    eng.engine.step = boom

    async def run():
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            await _collect(eng, [5, 6, 7])

    asyncio.run(run())
    with pytest.raises(EngineDeadError):
        eng.check_health()
    eng.shutdown()
