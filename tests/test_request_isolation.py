"""Requests kept apart and the ingress kept responsive (no Ray, fake engines).

Server-side request ids (a client's id is echoed, never a key), API keys rotated from
a file, huge prompts tokenized off the event loop, OpenAI's "developer" role.
"""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from deployments.engine_client import LocalEngineClient
from deployments.errors import Unauthenticated
from deployments.frontend import Frontend, FrontendConfig
from deployments.requests import GenerateInput
from router.policy import RoutingStats
from tests.serving_helpers import make_frontend, run, wait_idle, wait_load


def test_same_client_request_id_twice_is_served_twice_and_isolated(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer, step_delay_s=0.02)
        reqs = [await fe.prepare(GenerateInput(prompt="hi", request_id="dup", sampling={"max_tokens": 300}))
                for _ in range(2)]
        assert reqs[0].request_id != reqs[1].request_id
        streams = [fe.stream(r) for r in reqs]
        firsts = [await s.__anext__() for s in streams]
        assert [f.client_request_id for f in firsts] == ["dup", "dup"]
        # A second ingress over the same engine replicas finds the first one's stream; the twin runs on.
        other = Frontend(fe.config, tokenizer, LocalEngineClient(reps))
        assert await other.abort(firsts[0].request_id)
        assert [d async for d in streams[0]][-1].finish_reason == "abort"
        assert reps[0].engine.stats().running == 1
        assert not await other.abort(firsts[0].request_id)  # already gone
        assert await fe.abort(firsts[1].request_id)
        assert [d async for d in streams[1]][-1].finish_reason == "abort"
        await wait_idle(reps)
    run(main())


def test_api_keys_file_rotates_without_restart(tokenizer, tmp_path, monkeypatch):
    from deployments.tenants import KeyList

    monkeypatch.setattr(KeyList, "CHECK_PERIOD_S", 0.0)  # re-check on every request
    keys = tmp_path / "keys"
    keys.write_text("# one per line\nfirst-key-1\n\nsecond-key-2\n")
    fe = Frontend(FrontendConfig(served_model_name="tiny", model="m", api_keys=("fixed-key-0",),
                                 api_keys_file=str(keys)), tokenizer, None)
    for good in ("Bearer first-key-1", "second-key-2", "fixed-key-0"):
        fe.authorize(good)
    keys.write_text("third-key-33\n")  # rotated: the old file keys stop working at once
    fe.authorize("third-key-33")
    with pytest.raises(Unauthenticated):
        fe.authorize("first-key-1")
    keys.write_text("short\n")  # a bad rotation keeps the last good keys
    fe.authorize("third-key-33")
    keys.unlink()
    fe.authorize("third-key-33")
    with pytest.raises(FileNotFoundError):  # a missing file at start fails the replica, loudly
        Frontend(FrontendConfig(served_model_name="tiny", model="m", api_keys_file=str(keys)), tokenizer, None)


def test_a_huge_prompt_is_tokenized_off_the_event_loop(tokenizer, monkeypatch):
    """The small request's first token arrives while the huge prompt is still being tokenized:
    its tokenizer call is held until then, which would deadlock were it on the event loop."""
    import threading

    from deployments.frontend import OFFLOAD_CHARS

    async def main():
        fe, reps = make_frontend(tokenizer)
        small_started = threading.Event()
        encode = tokenizer.encode

        def held_encode(text, *args, **kwargs):
            if len(text) >= OFFLOAD_CHARS:
                assert small_started.wait(30), "the small request got no token while the big one tokenized"
            return encode(text[:64], *args, **kwargs)

        monkeypatch.setattr(tokenizer, "encode", held_encode)
        big = asyncio.ensure_future(fe.prepare(GenerateInput(prompt="x" * 2_000_000, sampling={"max_tokens": 2})))
        small = await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 2}))
        stream = fe.stream(small)
        await stream.__anext__()
        small_started.set()
        await stream.aclose()
        assert len((await big).prompt_token_ids) > 0
        await wait_idle(reps)
    run(main())


def test_a_developer_message_is_served_as_a_system_message(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer)
        messages = ({"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"})
        req = await fe.prepare(GenerateInput(messages=messages, sampling={"max_tokens": 3}))
        as_system = fe.tokenize_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        assert list(req.prompt_token_ids) == as_system
        text, deltas = await fe.generate_all(req)
        assert deltas[-1].finish_reason == "length"
        await wait_idle(reps)
    run(main())


def test_streams_past_the_engines_capacity_are_refused_at_the_door(tokenizer, monkeypatch):
    from deployments.admission import Admission
    from deployments.errors import Overloaded

    monkeypatch.setattr(Admission, "REFRESH_S", 0.0)

    async def main():
        # 2 replicas x (1 slot + 1 queued): 4 streams fit in the engines, the 5th is refused by the ingress.
        fe, reps = make_frontend(tokenizer, replicas=2, max_num_seqs=1, max_waiting=1, step_delay_s=0.01)
        held = [asyncio.ensure_future(fe.generate_all(
            await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 400})))) for _ in range(4)]
        for rep in reps:
            await wait_load(rep, running=1, waiting=1)
        with pytest.raises(Overloaded, match="retry later"):
            await fe.generate_all(await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 4})))
        assert all((r.engine.stats().running, r.engine.stats().waiting) == (1, 1) for r in reps)  # never sent
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await wait_idle(reps)
        text, deltas = await fe.generate_all(await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 4})))
        assert deltas[-1].finish_reason == "length"
        await wait_idle(reps)
    run(main())


def _stats(healthy: bool, max_num_seqs: int, max_waiting: int) -> RoutingStats:
    return RoutingStats(free_slots=max_num_seqs, running=0, waiting=0, max_num_seqs=max_num_seqs, kv_blocks_used=0,
                        kv_blocks_total=64, block_size=16, updated_at=0.0, healthy=healthy, max_waiting=max_waiting)


def test_each_ingress_admits_its_share():
    from deployments.admission import Admission

    async def loads():
        return [_stats(True, 8, 4), _stats(False, 8, 0), _stats(True, 8, 4)]

    assert asyncio.run(Admission(loads, ingress_replicas=3).limit()) == 8   # ceil(24 / 3)
    assert asyncio.run(Admission(loads).limit()) == 24

    async def none():
        return [RoutingStats.unknown("r0")]

    assert asyncio.run(Admission(none).limit()) is None  # nothing known: refuse nothing


def test_a_known_limit_is_refreshed_without_holding_the_request(monkeypatch):
    from deployments.admission import Admission

    monkeypatch.setattr(Admission, "REFRESH_S", 0.0)
    capacity, release = [8], None

    async def loads():
        if release is not None:
            await release.wait()  # a slow report: replicas busy, GCS far away
        return [_stats(True, capacity[0], 0)]

    async def main():
        nonlocal release
        admission = Admission(loads)
        assert await admission.limit() == 8  # nothing known yet: the first request waits for it
        release, capacity[0] = asyncio.Event(), 16
        assert await asyncio.wait_for(admission.limit(), 1.0) == 8  # the report is late: the last limit
        release.set()
        for _ in range(100):
            await asyncio.sleep(0)
        assert await admission.limit() == 16  # the background refresh landed

    asyncio.run(main())


def test_concurrent_first_requests_share_one_model_info_call(tokenizer):
    """32 first requests at once: one engine call, not 32 (they would all land on one replica)."""
    async def main():
        fe, reps = make_frontend(tokenizer, replicas=2)
        calls = []
        original = fe._engine.model_info

        async def counted():
            calls.append(1)
            await asyncio.sleep(0.05)  # still in flight when the others arrive
            return await original()

        fe._engine.model_info = counted
        prepared = await asyncio.gather(*(fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 2}))
                                          for _ in range(32)))
        assert len(prepared) == 32 and calls == [1]
    run(main())


def test_a_first_request_cut_off_leaves_the_shared_model_info_call_running(tokenizer):
    """Serve cancels the calls a request made when its client goes away. The first request's call for
    the engines' model facts is shared by every request that arrives while the engines start, so
    cancelling that request must leave the call running: the requests after it are served (each got a
    500, for good, when the call was tied to the first request)."""
    serve_request = contextvars.ContextVar("serve_request", default=None)

    async def main():
        fe, _ = make_frontend(tokenizer, replicas=1)
        original, ready, started, made_by = fe._engine.model_info, asyncio.Event(), asyncio.Event(), {}

        async def model_info():  # what Serve does: it notes which request made the call
            made_by.setdefault(serve_request.get(), []).append(asyncio.current_task())
            started.set()
            await ready.wait()  # the engines are still starting
            return await original()

        async def request(request_id):
            serve_request.set(request_id)
            return await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 2}))

        fe._engine.model_info = model_info
        first = asyncio.ensure_future(request("first"))
        await started.wait()
        first.cancel()  # its client went away, and Serve cancels what it called
        for task in made_by.get("first", ()):
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.ensure_future(request("second"))
        await asyncio.sleep(0.01)
        ready.set()
        prepared = await asyncio.wait_for(second, 5.0)
        assert prepared.prompt_token_ids
        assert fe.known_engine_info is not None and list(made_by) == [None]  # one call, tied to no request
    run(main())
