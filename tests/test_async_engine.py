"""AsyncEngine: concurrent streams, slow consumers, cancellation, overload, health."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from engine import AsyncEngine, EngineDeadError, EngineOverloadedError, InvalidRequestError, LLM, SamplingParams
from engine import async_engine
from tests.waits import async_wait_until, wait_until

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


def _wait_idle(engine):
    def idle():
        s = engine.stats()
        return s if (s.running, s.waiting, s.kv_blocks_used) == (0, 0, 0) else None

    return wait_until(idle, "engine idle, no KV block in use")


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


def test_a_slow_consumer_never_holds_the_loop_and_gets_every_output(engine):
    async def run():
        done = engine.stats().num_finished
        stream = engine.generate(_prompts(1, seed=2)[0], GREEDY)
        msgs = [await stream.__anext__()]
        # The consumer looks away: the loop runs the request to its end meanwhile.
        await async_wait_until(lambda: engine.stats().num_finished > done, "the request finished")
        msgs += [out async for out in stream]
        return msgs

    msgs = asyncio.run(run())
    # One output per step, none merged here: joining them is the reader's side's (deployments.contract).
    assert [len(m.new_token_ids) for m in msgs] == [1] * 12
    assert [m.finished for m in msgs] == [False] * 11 + [True]


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
        await async_wait_until(lambda: eng.stats().running == 1, "one running")
        tasks += [asyncio.create_task(_collect(eng, p, long)) for p in prompts[1:]]
        await async_wait_until(lambda: eng.stats().waiting == 2, "two waiting")
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


# ----------------------------------------------------------------------------- loop faults
class _StepGate:
    """Stands in for LLMEngine.step: signals ``entered``, blocks until ``release``, then
    raises ``error`` (the loop dies) or runs the real step."""

    def __init__(self, engine, error: BaseException | None = None) -> None:
        self.step, self.error = engine.step, error
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self):
        self.entered.set()
        if not self.release.wait(10):
            raise RuntimeError("step gate never released")
        if self.error is not None:
            raise self.error
        return self.step()


@pytest.fixture()
def small_engine(tiny_model_dir):
    engines = []

    def build(**options):
        engines.append(AsyncEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8,
                                                num_kv_blocks=32, **options))
        return engines[-1]

    yield build
    for eng in engines:
        eng.shutdown(timeout_s=5)


def test_a_request_registering_while_the_loop_dies_fails(small_engine, monkeypatch):
    eng = small_engine()
    gate = _StepGate(eng.engine, RuntimeError("simulated kernel failure"))
    monkeypatch.setattr(eng.engine, "step", gate)
    check_request = eng.engine.check_request

    def check_then_let_the_loop_die(prompt, *args):
        out = check_request(prompt, *args)
        if prompt == [9, 9, 9]:  # past the health check, not yet registered: the loop dies now
            gate.release.set()
            eng._thread.join(5)
            assert not eng._thread.is_alive()
        return out

    monkeypatch.setattr(eng.engine, "check_request", check_then_let_the_loop_die)

    async def run():
        first = asyncio.create_task(_collect(eng, [5, 6, 7]))
        assert await asyncio.to_thread(gate.entered.wait, 5)
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            await asyncio.wait_for(_collect(eng, [9, 9, 9]), 5)  # without the fix: waits forever
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            await asyncio.wait_for(first, 5)

    asyncio.run(run())


def test_shutdown_fails_open_streams_and_refuses_new_requests(small_engine, monkeypatch):
    eng = small_engine()
    gate = _StepGate(eng.engine)
    monkeypatch.setattr(eng.engine, "step", gate)

    async def run():
        task = asyncio.create_task(_collect(eng, [5, 6, 7]))
        assert await asyncio.to_thread(gate.entered.wait, 5)
        eng.shutdown(timeout_s=0)  # the loop is mid-step; the stream must not wait for it
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 5)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(_collect(eng, [1, 2, 3]), 5)

    asyncio.run(run())
    with pytest.raises(EngineDeadError, match="shut down"):
        eng.check_health()
    gate.release.set()
    eng._thread.join(5)
    assert not eng._thread.is_alive()


def test_a_loop_without_progress_fails_health_and_an_idle_one_never(small_engine, monkeypatch):
    timeout = 1.0  # as if check_health were called every `timeout` seconds: caught within two calls
    eng = small_engine(stuck_timeout_s=timeout)
    time.sleep(timeout * 1.5)  # idle for longer than the timeout
    eng.check_health()
    gate = _StepGate(eng.engine)
    monkeypatch.setattr(eng.engine, "step", gate)

    async def run():
        task = asyncio.create_task(_collect(eng, [5, 6, 7]))
        assert await asyncio.to_thread(gate.entered.wait, 5)
        eng.check_health()  # one step under way is not stuck yet
        error = await async_wait_until(lambda: _health_error(eng), "stuck loop reported", timeout_s=2 * timeout)
        assert "engine loop stuck" in error
        gate.release.set()  # progress again: healthy again
        toks, _ = await asyncio.wait_for(task, 10)
        assert len(toks) == GREEDY.max_tokens
        eng.check_health()

    asyncio.run(run())


def _health_error(eng) -> str | None:
    try:
        eng.check_health()
    except EngineDeadError as exc:
        return str(exc)
    return None


class _WaitSpy(threading.Event):
    """The loop's wake event, telling the test when the loop has gone to sleep on it."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeping = threading.Event()

    def wait(self, timeout=None):
        self.sleeping.set()
        return super().wait(timeout)


def test_an_add_wakes_the_idle_loop_at_once(small_engine, monkeypatch):
    eng = small_engine()
    monkeypatch.setattr(async_engine, "IDLE_WAIT_S", 600.0)  # a missed wake-up would hang
    old, spy = eng._wake, _WaitSpy()
    eng._wake = spy
    old.set()  # get the loop off the old event
    assert spy.sleeping.wait(5)

    async def run():
        return await asyncio.wait_for(_collect(eng, [5, 6, 7]), 10)

    toks, _ = asyncio.run(run())
    assert len(toks) == GREEDY.max_tokens
