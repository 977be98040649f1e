"""deployments.mux: one subscription per (ingress, replica) carrying every request's messages.

In-process: EngineReplica over the fake engine, LocalEngineClient as the transport. The
Ray transport is exercised by the end-to-end tests (test_serving_e2e, test_fault_e2e).
"""

from __future__ import annotations

import asyncio

import pytest

from deployments import mux
from deployments.engine_client import LocalEngineClient
from deployments.errors import Unavailable
from deployments.mux import MuxEngineClient, merge_messages
from deployments.replica import EngineReplica
from engine.errors import EngineDeadError
from engine.sampling import SamplingParams
from tests.fake_engine import FakeAsyncEngine
from tests.serving_helpers import run, wait_idle, wait_load
from tests.waits import async_wait_until


LONG = 2000  # tokens: runs for seconds, until the test ends it


def _replicas(n=1, **options):
    options = {"vocab_size": 256, "eos_token_id": 10**6, "max_num_seqs": 8, "max_waiting": 8,
               "step_delay_s": 0.002, **options}
    return [EngineReplica("fake-model", options, FakeAsyncEngine, drain_timeout_s=5) for _ in range(n)]


def _request(i: int, max_tokens: int = 12) -> dict:
    return {"request_id": f"r{i}", "prompt_token_ids": [1 + i, 2, 3],
            "params": SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)}


async def _tokens(stream) -> tuple[list[int], list[dict]]:
    messages = [m async for m in stream]
    return [t for m in messages for t in m["token_ids"]], messages


class CountingTransport:
    """LocalEngineClient, counting the batches each subscription delivers."""

    def __init__(self, client: LocalEngineClient) -> None:
        self.client = client
        self.batches: list[int] = []
        self.subscriptions = 0

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def subscribe(self, replica_id, ingress_id):
        self.subscriptions += 1
        async for batch in self.client.subscribe(replica_id, ingress_id):
            self.batches.append(len(batch))
            yield batch


def test_many_streams_share_one_subscription_and_get_their_own_tokens():
    async def main():
        reps = _replicas()
        plain = LocalEngineClient(reps)
        want = [(await _tokens(plain.generate(_request(i))))[0] for i in range(8)]
        transport = CountingTransport(LocalEngineClient(reps))
        client = MuxEngineClient(transport)
        got = await asyncio.gather(*(_tokens(client.generate(_request(i))) for i in range(8)))
        assert [tokens for tokens, _ in got] == want
        assert all(messages[-1]["finish_reason"] == "length" for _, messages in got)
        assert transport.subscriptions == 1
        # 8 requests x 12 tokens in far fewer batches than messages: one per engine step
        assert len(transport.batches) < sum(len(messages) for _, messages in got)
        assert max(transport.batches) > 1
        await wait_idle(reps)
    run(main())


def test_closing_a_stream_aborts_its_request_and_frees_the_slot():
    async def main():
        reps = _replicas()
        client = MuxEngineClient(LocalEngineClient(reps))
        stream = client.generate(_request(0, max_tokens=LONG))
        first = await stream.__anext__()
        assert first["token_ids"]
        await wait_load(reps[0], 1)
        await stream.aclose()
        await wait_idle(reps)
    run(main())


def test_abort_while_submitting_reaches_the_replica_once_it_is_known():
    async def main():
        reps = _replicas()
        local = LocalEngineClient(reps)
        gate = asyncio.Event()

        class SlowSubmit(CountingTransport):
            async def submit(self, request):
                replica_id = await self.client.submit(request)
                await gate.wait()  # the reply is late: the stream is closed before it arrives
                return replica_id

        client = MuxEngineClient(SlowSubmit(local))
        stream = client.generate(_request(0, max_tokens=LONG))
        pending = asyncio.ensure_future(stream.__anext__())
        await wait_load(reps[0], 1)  # running on the replica, reply not back yet
        pending.cancel()
        await stream.aclose()
        gate.set()
        await wait_idle(reps)
    run(main())


def test_a_dead_engine_raises_in_every_stream_it_served():
    async def main():
        reps = _replicas()
        client = MuxEngineClient(LocalEngineClient(reps))
        streams = [client.generate(_request(i, max_tokens=LONG)) for i in range(3)]
        for s in streams:
            await s.__anext__()
        reps[0].engine.kill("boom")
        for s in streams:
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
    run(main())


def test_a_resumed_attempt_never_hears_an_error_left_over_from_its_first():
    """The first attempt's error can still be queued for the ingress when the resumed one (same
    request id, next attempt) streams from the same replica: it belongs to the first one only."""
    async def main():
        reps = _replicas()

        class Leftover(CountingTransport):
            async def subscribe(self, replica_id, ingress_id):
                yield [("r0", None, Unavailable("the first attempt's replica link broke"))]
                async for batch in self.client.subscribe(replica_id, ingress_id):
                    yield batch

        client = MuxEngineClient(Leftover(LocalEngineClient(reps)))
        tokens, messages = await _tokens(client.generate({**_request(0), "attempt": 1}))
        assert len(tokens) == 12 and messages[-1]["finish_reason"] == "length"
        assert mux.wire_id({**_request(0), "attempt": 1}) != mux.wire_id(_request(0)) == "r0"
    run(main())


def test_a_lost_subscription_raises_its_error_in_every_open_stream():
    async def main():
        reps = _replicas()
        local = LocalEngineClient(reps)

        class Breaks(CountingTransport):
            async def subscribe(self, replica_id, ingress_id):
                async for batch in self.client.subscribe(replica_id, ingress_id):
                    yield batch
                    raise ConnectionError("replica actor died")

        client = MuxEngineClient(Breaks(local))
        streams = [client.generate(_request(i, max_tokens=LONG)) for i in range(2)]
        for s in streams:
            # the subscription's own error, or (a stream submitted after it broke, read on the
            # next one) the replica's word that it cut the request when the first one went
            with pytest.raises((ConnectionError, Unavailable)):
                async for _ in s:
                    pass
        await wait_idle(reps)  # the replica saw its subscription go and aborted them
    run(main())


def test_requests_of_an_ingress_that_never_subscribes_are_aborted(monkeypatch):
    monkeypatch.setattr(mux, "ORPHAN_S", 0.2)

    async def main():
        reps = _replicas()
        await reps[0].submit({**_request(0, max_tokens=LONG), "ingress_id": "gone"})
        await wait_load(reps[0], 1)
        await wait_idle(reps)
    run(main())


def test_merged_messages_keep_every_token_and_the_latest_counts():
    a = {"token_ids": [1, 2], "logprobs": None, "finish_reason": None, "num_output_tokens": 2}
    b = {"token_ids": [3], "logprobs": None, "finish_reason": "length", "num_output_tokens": 3}
    assert merge_messages(a, b) == {"token_ids": [1, 2, 3], "logprobs": None, "finish_reason": "length",
                                    "num_output_tokens": 3}
    la, lb = {**a, "logprobs": [{1: -0.1}, {2: -0.2}]}, {**b, "logprobs": [{3: -0.3}]}
    assert merge_messages(la, lb)["logprobs"] == [{1: -0.1}, {2: -0.2}, {3: -0.3}]


def _hand_fed_stream():
    """A stream whose queue the test fills itself (no replica feeds it)."""
    client = MuxEngineClient(LocalEngineClient(_replicas()))
    stream = client.generate(_request(0))
    stream._started = True
    client._streams[stream.request_id] = stream
    return stream


def test_a_stream_behind_gets_queued_messages_as_one_and_an_error_after_them():
    async def main():
        stream = _hand_fed_stream()
        for i in range(3):
            stream.queue.put_nowait(({"token_ids": [i], "logprobs": None, "finish_reason": None}, None))
        stream.queue.put_nowait((None, Unavailable("replica gone")))
        assert (await stream.__anext__())["token_ids"] == [0, 1, 2]
        with pytest.raises(Unavailable):
            await stream.__anext__()
    run(main())


def test_choices_are_merged_apart_and_the_stream_ends_with_the_last_choice():
    async def main():
        stream = _hand_fed_stream()
        for index, tokens, finish, running in [(0, [1], None, 2), (0, [2], None, 2), (1, [7], None, 2),
                                               (1, [8], "length", 1), (0, [3], "stop", 0)]:
            stream.queue.put_nowait(({"token_ids": tokens, "logprobs": None, "finish_reason": finish,
                                      "index": index, "choices_running": running}, None))
        got = [await stream.__anext__() for _ in range(2)]
        assert [(m["index"], m["token_ids"], m["finish_reason"]) for m in got] == [
            (1, [7, 8], "length"), (0, [1, 2, 3], "stop")]  # the message that ends the request last
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    run(main())


def test_n_through_the_mux_and_a_resume_of_the_running_choices():
    async def main():
        client = MuxEngineClient(LocalEngineClient(_replicas(2)))
        request = {**_request(5), "params": SamplingParams(max_tokens=12, ignore_eos=True, n=3)}
        whole = {}
        async for m in client.generate(dict(request)):
            whole.setdefault(m["index"], []).extend(m["token_ids"])
        resumed = {}
        async for m in client.generate({**request, "request_id": "again",
                                        "resume_choices": {1: whole[1][:4], 2: whole[2][:9]}}):
            resumed.setdefault(m["index"], []).extend(m["token_ids"])
        return whole, resumed

    whole, resumed = run(main())
    assert sorted(whole) == [0, 1, 2] and all(len(v) == 12 for v in whole.values())
    assert len({tuple(v) for v in whole.values()}) == 3
    assert resumed == {1: whole[1][4:], 2: whole[2][9:]}


def test_streams_a_replica_no_longer_knows_are_unavailable():
    async def main():
        class Empty(CountingTransport):
            async def subscribe(self, replica_id, ingress_id):
                self.subscriptions += 1
                return
                yield  # ends at once, every time: the replica has nothing for this ingress

        transport = Empty(LocalEngineClient(_replicas()))
        client = MuxEngineClient(transport)
        with pytest.raises(Unavailable):
            await _tokens(client.generate(_request(0, max_tokens=LONG)))
        assert transport.subscriptions == 1  # not read again: the link it came over is gone
    run(main())


def test_a_second_subscription_of_an_ingress_takes_over_from_the_first():
    async def main():
        reps = _replicas()
        old = reps[0].hub.subscribe("i")
        old_next = asyncio.ensure_future(old.__anext__())
        hub = reps[0]._hub
        await async_wait_until(lambda: "i" in hub._channels and hub._channels["i"].subscriber, "first subscribed")
        await reps[0].submit({**_request(0), "ingress_id": "i"})
        new = reps[0].hub.subscribe("i")
        tokens = []
        async for batch in new:
            tokens += [t for _, message, _ in batch for t in message["token_ids"]]
            if any(message["finish_reason"] for _, message, _ in batch):
                break
        await new.aclose()
        with pytest.raises(StopAsyncIteration):  # replaced: ends without taking the new one's messages
            await old_next
        assert len(tokens) == 12
        await wait_idle(reps)
    run(main())
