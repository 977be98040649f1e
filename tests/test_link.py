"""deployments.link: engine replicas and an ingress over real loopback connections, no Ray.

The replicas are EngineReplica over the fake engine, each serving a link; the ingress side
is LinkEngineClient, as RouterIngress builds it. The Ray path (the router
choosing, the node address, Serve's fallback) is exercised by test_serving_e2e's "link" mode.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
from msgspec.structs import replace

from deployments.contract import EngineRequest
from deployments.contract import EngineMessage
from deployments.engine_client import LocalEngineClient
from deployments.errors import Unavailable
from deployments.link import Connection, LinkServer, check_token, new_token
from deployments.link_client import LinkEngineClient
from deployments.contract import Hello, frame
from deployments.replica import EngineReplica
from engine.errors import EngineDeadError
from engine.sampling import SamplingParams
from tests.fake_engine import FakeAsyncEngine
from tests.serving_helpers import run, wait_idle, wait_load

LONG = 2000  # tokens: runs until the test ends it


def _replicas(token: str, n: int = 1) -> list[EngineReplica]:
    options = {"vocab_size": 256, "eos_token_id": 10**6, "max_num_seqs": 8, "max_waiting": 8,
               "step_delay_s": 0.002}
    return [EngineReplica("fake-model", options, FakeAsyncEngine, drain_timeout_s=1, link_token=token)
            for _ in range(n)]


def _request(i: int, max_tokens: int = 12) -> dict:
    return EngineRequest(request_id=f"r{i}", prompt_token_ids=[1 + i, 2, 3], params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


class RoundRobin:
    """The router's part: a replica with a link, in turn; None while ``ready`` is False."""

    def __init__(self, reps) -> None:
        self.reps, self.calls, self.ready = reps, 0, True

    def __call__(self, request: dict, avoid: frozenset):
        reps = [r for r in self.reps if r.replica_id not in avoid]
        if not self.ready or not reps:
            return None
        rep = reps[self.calls % len(reps)]
        self.calls += 1
        return rep.replica_id, rep.record_routing_stats()["link"]


async def _linked(n: int = 1):
    token = new_token()
    reps = _replicas(token, n)
    await asyncio.sleep(0)  # the link servers start on this loop
    chooser = RoundRobin(reps)
    return reps, chooser, LinkEngineClient(LocalEngineClient(reps), token, chooser)

async def _running(client, n: int) -> list:
    """``n`` long streams on ``client``, each past its first message."""
    streams = [client.generate(_request(i, max_tokens=LONG)) for i in range(n)]
    for s in streams:
        await s.__anext__()
    return streams


async def _tokens(stream) -> tuple[list[int], list[dict]]:
    messages = [m async for m in stream]
    return [t for m in messages for t in m.token_ids], messages


async def _shutdown(reps) -> None:
    for rep in reps:
        await rep.shutdown()


def test_requests_over_links_get_the_same_tokens_as_in_process():
    async def main():
        reps, chooser, client = await _linked(2)
        plain = LocalEngineClient(reps)
        want = [(await _tokens(plain.generate(_request(i))))[0] for i in range(8)]
        got = await asyncio.gather(*(_tokens(client.generate(_request(i))) for i in range(8)))
        assert [tokens for tokens, _ in got] == want
        assert all(messages[-1].finish_reason == "length" for _, messages in got)
        assert chooser.calls == 8  # every request routed by the chooser, none through "Serve"
        assert all(r.record_routing_stats()["num_finished"] >= 4 for r in reps)  # both replicas served
        await wait_idle(reps)
        await _shutdown(reps)
    run(main())


def test_before_the_router_knows_a_link_requests_go_through_serve_and_read_the_link():
    async def main():
        reps, chooser, client = await _linked(1)
        chooser.ready = False
        tokens, messages = await _tokens(client.generate(_request(0)))
        assert len(tokens) == 12 and messages[-1].finish_reason == "length"
        assert chooser.calls == 0 and list(client._links) == [reps[0].replica_id]
        await _shutdown(reps)
    run(main())


def test_closing_a_stream_aborts_its_request_over_the_link():
    async def main():
        reps, _, client = await _linked(1)
        stream = client.generate(_request(0, max_tokens=LONG))
        assert (await stream.__anext__()).token_ids
        await wait_load(reps[0], 1)
        await stream.aclose()
        await wait_idle(reps)
        await _shutdown(reps)
    run(main())


def test_one_choice_is_aborted_over_the_link_and_the_others_go_on():
    async def main():
        reps, _, client = await _linked(1)
        request = replace(_request(0), params=SamplingParams(max_tokens=LONG, ignore_eos=True, n=3))
        stream = client.generate(request)
        first = await stream.__anext__()
        stream.abort(1)
        ended = {}
        while len(ended) < 1:
            m = await stream.__anext__()
            if m.finish_reason is not None:
                ended[m.index] = m.finish_reason
        assert ended == {1: "abort"} and first.token_ids
        await wait_load(reps[0], 2)  # two choices still run
        await stream.aclose()
        await wait_idle(reps)
        await _shutdown(reps)
    run(main())


def test_an_abort_by_request_id_reaches_a_stream_another_ingress_holds():
    async def main():
        token = new_token()
        reps = _replicas(token, 2)
        await asyncio.sleep(0)
        holder, other = (LinkEngineClient(LocalEngineClient(reps), token, RoundRobin(reps)) for _ in range(2))
        stream = holder.generate(_request(0, max_tokens=LONG))
        assert (await stream.__anext__()).token_ids
        assert await other.abort("r0") is True  # asked over its own links to both replicas
        assert [m async for m in stream][-1].finish_reason == "abort"
        assert await other.abort("r0") is False and await other.abort("no-such-request") is False
        assert len(other._links) == 2 and not other._replies
        await wait_idle(reps)
        await _shutdown(reps)
    run(main())


def test_a_lost_link_raises_in_its_streams_and_aborts_their_requests():
    async def main():
        reps, _, client = await _linked(1)
        streams = await _running(client, 3)
        await wait_load(reps[0], 3)
        client._links[reps[0].replica_id].writer.transport.abort()  # the connection drops
        for s in streams:
            with pytest.raises(Unavailable, match="closed its link"):
                async for _ in s:
                    pass
        await wait_idle(reps)  # the replica saw its ingress go and freed the slots
        # the next request opens a new link
        tokens, _ = await _tokens(client.generate(_request(9)))
        assert len(tokens) == 12
        await _shutdown(reps)
    run(main())


def test_a_replica_whose_link_failed_is_not_chosen_while_the_router_still_lists_it():
    async def main():
        reps, chooser, client = await _linked(2)
        lost = client.generate(_request(0, max_tokens=LONG))  # round robin: the first replica
        await lost.__anext__()
        await reps[0]._link.close()  # its process is gone, as far as links go
        with pytest.raises(Unavailable):
            async for _ in lost:
                pass
        # The router (here: the round-robin chooser) still lists both; the next requests avoid it.
        for i in range(1, 4):
            tokens, _ = await _tokens(client.generate(_request(i)))
            assert len(tokens) == 12
        assert reps[0].record_routing_stats()["link_requests"] == 1
        assert reps[1].record_routing_stats()["link_requests"] == 3
        await _shutdown(reps)
    run(main())


def test_a_replica_shutting_down_ends_its_link_after_draining():
    async def main():
        reps, _, client = await _linked(1)
        stream = client.generate(_request(0, max_tokens=LONG))
        await stream.__anext__()
        stopping = asyncio.ensure_future(reps[0].shutdown())  # drain 1 s, then abort what still runs
        messages = [m async for m in stream]
        assert messages[-1].finish_reason == "abort"
        await stopping
        with pytest.raises((Unavailable, EngineDeadError)):  # its link is closed, and Serve's way refuses
            await _tokens(client.generate(_request(1)))
    run(main())


def test_an_unreachable_replica_fails_the_request_with_unavailable():
    async def main():
        token = new_token()
        client = LinkEngineClient(LocalEngineClient(_replicas(token)), token,
                                  lambda request, avoid: ("gone", "127.0.0.1:9"))  # nothing listens on port 9
        with pytest.raises(Unavailable, match="unreachable"):
            await _tokens(client.generate(_request(0)))
    run(main())


def test_a_connection_without_the_token_is_refused_before_any_frame_is_read():
    async def main():
        reps = _replicas(new_token())
        await asyncio.sleep(0)
        host, port = reps[0].record_routing_stats()["link"].rsplit(":", 1)

        class Boom:
            def __reduce__(self):
                return (pytest.fail, ("a frame from a peer without the token was unpickled",))

        reader, writer = await asyncio.open_connection(host, int(port))
        # A nonce, a proof made without the token, then frames that would fail the test if unpickled.
        writer.write(b"\1" * 16 + b"\0" * 32 + frame(Hello("x")) + pickle.dumps(Boom()))
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        assert len(answer) == 16 + 32  # the replica's nonce and proof, then it closed
        writer.close()
        await _shutdown(reps)
    run(main())


@pytest.mark.parametrize("token", ["", "abc", "zz" * 16, "00" * 15])
def test_a_bad_token_is_refused_naming_the_setting(token):
    with pytest.raises(ValueError, match="SLOTSERVE_LINK_TOKEN.*32 hex digits"):
        check_token(token)


def test_a_forwarder_cancelled_as_its_drain_finishes_ends():
    """A replica's shutdown cancels its links' forwarders, often while they drain the last
    outputs. ``asyncio.wait_for`` around that drain (Python 3.11) returned the drain's result
    instead of raising when the cancellation came as the drain finished: the forwarder went
    on waiting for outputs and ``LinkServer.close()`` never returned, so the replica never
    finished its shutdown. The writer here cancels the forwarder from inside ``drain()``, which
    is that moment, every time."""
    class Writer:
        forwarder: asyncio.Task

        def write(self, data: bytes) -> None:
            pass

        def is_closing(self) -> bool:
            return False

        async def drain(self) -> None:
            self.forwarder.cancel()

    async def main():
        server = LinkServer(replica=None, token=new_token())
        writer, connection = Writer(), Connection("ingress")
        writer.forwarder = asyncio.ensure_future(server.forward(connection, writer))
        await asyncio.sleep(0)  # waiting for outputs
        connection.push(("r0", EngineMessage([1], None, None, 3, 1, 0, choices_running=1), None))
        done, _ = await asyncio.wait([writer.forwarder], timeout=5)
        assert done and writer.forwarder.cancelled(), "the forwarder went on after its cancellation"
        server._sock.close()
    run(main())


def _two(a: str, b: str) -> str:
    return f"{a},{b}"


T_OLD, T_NEW = new_token(), new_token()
ROTATION = [  # (ingress's token, replica's token): the three deploys of a rotation, and their mixes
    (T_OLD, _two(T_OLD, T_NEW)), (_two(T_OLD, T_NEW), T_OLD),  # step 1: old proves, new is accepted
    (_two(T_OLD, T_NEW), _two(T_NEW, T_OLD)), (_two(T_NEW, T_OLD), _two(T_OLD, T_NEW)),  # step 1 meets step 2
    (_two(T_NEW, T_OLD), T_NEW), (T_NEW, _two(T_NEW, T_OLD)),  # step 2 meets step 3
]


@pytest.mark.parametrize("ingress_token, replica_token", ROTATION)
def test_a_token_rotation_keeps_every_pair_of_its_steps_linked(ingress_token, replica_token):
    async def main():
        (rep,) = _replicas(replica_token)
        await asyncio.sleep(0)
        chooser = lambda request, avoid: (rep.replica_id, rep.record_routing_stats()["link"])  # noqa: E731
        client = LinkEngineClient(LocalEngineClient([rep]), ingress_token, chooser)
        tokens, messages = await _tokens(client.generate(_request(0)))
        assert len(tokens) == 12 and messages[-1].finish_reason == "length"
        assert rep._link.requests == 1  # it came over the link, not Serve's way
        await _shutdown([rep])
    run(main())


def test_peers_without_a_common_token_do_not_link():
    async def main():
        (rep,) = _replicas(_two(T_NEW, new_token()))
        await asyncio.sleep(0)
        chooser = lambda request, avoid: (rep.replica_id, rep.record_routing_stats()["link"])  # noqa: E731
        client = LinkEngineClient(None, T_OLD, chooser)
        with pytest.raises(Unavailable, match="does not hold this application's engine link token"):
            await _tokens(client.generate(_request(0)))
        await _shutdown([rep])
    run(main())


@pytest.mark.parametrize("token", [_two(T_OLD, ""), ",".join([T_OLD] * 3), T_OLD + ",zz"])
def test_a_bad_pair_of_tokens_is_refused_naming_the_setting(token):
    with pytest.raises(ValueError, match="SLOTSERVE_LINK_TOKEN.*separated by a comma"):
        check_token(token)
