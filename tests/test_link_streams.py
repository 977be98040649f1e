"""deployments.link_client: many requests' streams over one engine link, each its own.

Over real loopback links to EngineReplica over the fake engine (tests/test_link.py builds them);
the cases that need a replica to misbehave feed the client's reader by hand.
"""

from __future__ import annotations

import asyncio

import pytest
from msgspec.structs import replace

import deployments.link_client as link_client
from deployments.contract import EngineMessage
from deployments.engine_client import LocalEngineClient
from deployments.errors import Unavailable
from deployments.link import new_token
from deployments.link_client import LinkEngineClient
from deployments.contract import outputs
from engine.errors import EngineDeadError
from engine.sampling import SamplingParams
from tests.serving_helpers import run, wait_idle, wait_load
from tests.test_link import LONG, _linked, _replicas, _request, _running, _shutdown, _tokens


def test_many_streams_share_one_link_and_get_their_own_tokens(monkeypatch):
    batches: list[int] = []
    read = link_client.read_outputs

    async def counted(reader):
        batch = await read(reader)
        batches.append(len(batch))
        return batch

    monkeypatch.setattr(link_client, "read_outputs", counted)

    async def main():
        reps, _, client = await _linked(1)
        want = [(await _tokens(LocalEngineClient(reps).generate(_request(i))))[0] for i in range(8)]
        got = await asyncio.gather(*(_tokens(client.generate(_request(i))) for i in range(8)))
        assert [tokens for tokens, _ in got] == want
        assert all(messages[-1].finish_reason == "length" for _, messages in got)
        assert len(client._links) == 1
        # 8 requests x 12 tokens in far fewer frames than messages: one per engine step
        assert len(batches) < sum(len(messages) for _, messages in got) and max(batches) > 1
        await wait_idle(reps)
        await _shutdown(reps)
    run(main())


def test_an_abort_before_the_replica_is_known_ends_the_stream_and_nothing_runs():
    async def main():
        token = new_token()
        reps = _replicas(token)
        gate = asyncio.Event()

        class SlowServe(LocalEngineClient):
            async def link_address(self, request):
                await gate.wait()  # Serve's answer is late: the stream is aborted before it comes
                return await super().link_address(request)

        client = LinkEngineClient(SlowServe(reps), token)
        stream = client.generate(_request(0, max_tokens=LONG))
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        stream.abort()
        gate.set()
        message = await asyncio.wait_for(pending, 5)
        assert message.finish_reason == "abort" and message.token_ids == []
        assert reps[0].record_routing_stats()["link_requests"] == 0
        await _shutdown(reps)
    run(main())


def test_a_dead_engine_raises_in_every_stream_it_served():
    async def main():
        reps, _, client = await _linked(1)
        streams = await _running(client, 3)
        await wait_load(reps[0], 3)
        reps[0].engine.kill("boom")
        for s in streams:
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
    run(main())


class _Writer:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _hand_fed(*items) -> tuple[LinkEngineClient, asyncio.StreamReader]:
    """A client and a link to replica "rep" whose frames the test writes (``items``, then EOF)."""
    client = LinkEngineClient(None, "00" * 16)
    reader = asyncio.StreamReader()
    reader.feed_data(outputs(list(items)))
    reader.feed_eof()
    link = client._links["rep"] = link_client._Link("rep", reader, _Writer())
    client.spawn(client._read(link))
    return client, reader


def _message(tokens, finish=None, index=0, running=1) -> EngineMessage:
    return EngineMessage(tokens, finish, None, 3, len(tokens), 0, index=index, choices_running=running)


def _registered(client: LinkEngineClient, request: dict):
    stream = client.generate(request)
    stream.started, stream.replica_id = True, "rep"
    client._streams[stream.wire_id] = stream
    return stream


def test_a_resumed_attempt_never_hears_an_error_left_over_from_its_first():
    """The first attempt's error can still come on the link when the resumed one (same request id,
    next attempt) streams from the same replica: it belongs to the first one only."""
    async def main():
        resumed = replace(_request(0), attempt=1)
        client, _ = _hand_fed(("r0", None, Unavailable("the first attempt's link broke")),
                              (resumed.wire_id, _message([5, 6], "length", running=0), None))
        stream = _registered(client, resumed)
        assert [m.token_ids async for m in stream] == [[5, 6]]
        assert resumed.wire_id != _request(0).wire_id == "r0"
    run(main())


def test_a_stream_behind_gets_queued_messages_as_one_and_the_link_error_after_them():
    async def main():
        client = LinkEngineClient(None, "00" * 16)
        reader = asyncio.StreamReader()
        stream = _registered(client, _request(0))
        link = client._links["rep"] = link_client._Link("rep", reader, _Writer())
        reader.feed_data(outputs([("r0", _message([i]), None) for i in range(3)]))
        reader.feed_eof()  # then the replica closes the link
        await client._read(link)
        assert (await stream.__anext__()).token_ids == [0, 1, 2]
        with pytest.raises(Unavailable, match="closed its link"):
            await stream.__anext__()
        assert "rep" in client._avoid() and "rep" not in client._links
    run(main())


def test_choices_are_merged_apart_and_the_stream_ends_with_the_last_choice():
    async def main():
        client = LinkEngineClient(None, "00" * 16)
        stream = _registered(client, _request(0))
        for index, tokens, finish, running in [(0, [1], None, 2), (0, [2], None, 2), (1, [7], None, 2),
                                               (1, [8], "length", 1), (0, [3], "stop", 0)]:
            stream.queue.put_nowait((_message(tokens, finish, index, running), None))
        got = [await stream.__anext__() for _ in range(2)]
        assert [(m.index, m.token_ids, m.finish_reason) for m in got] == [
            (1, [7, 8], "length"), (0, [1, 2, 3], "stop")]  # the message that ends the request last
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    run(main())


def test_n_over_a_link_and_a_resume_of_the_running_choices():
    async def main():
        reps, _, client = await _linked(2)
        request = replace(_request(5), params=SamplingParams(max_tokens=12, ignore_eos=True, n=3))
        whole = {}
        async for m in client.generate(request):
            whole.setdefault(m.index, []).extend(m.token_ids)
        resumed = {}
        async for m in client.generate(replace(request, request_id="again",
                                        resume_choices={1: whole[1][:4], 2: whole[2][:9]})):
            resumed.setdefault(m.index, []).extend(m.token_ids)
        await _shutdown(reps)
        return whole, resumed

    whole, resumed = run(main())
    assert sorted(whole) == [0, 1, 2] and all(len(v) == 12 for v in whole.values())
    assert len({tuple(v) for v in whole.values()}) == 3
    assert resumed == {1: whole[1][4:], 2: whole[2][9:]}
