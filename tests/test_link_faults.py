"""deployments.link under faults: each test is a failure an engine link must survive without
losing a request, a slot or a stream (over real loopback connections, no Ray)."""

from __future__ import annotations

import asyncio
import pickle
import socket

import msgspec
from msgspec.structs import asdict
import pytest

import deployments.link as link
import deployments.link_client as link_client
from deployments.contract import EngineMessage
from deployments.errors import Unavailable
from deployments.link import Connection, LinkServer, new_token
from deployments.link_client import LinkEngineClient
from deployments.contract import HEADER, Abort, Output, Submit, as_item, frame, outputs, read_outputs
from tests.serving_helpers import run, wait_idle, wait_load
from tests.test_link import LONG, _linked, _replicas, _request, _running, _shutdown, _tokens


def _message(token_ids: list[int], finish_reason: str | None = None) -> EngineMessage:
    """As a replica sends one (of a request with one choice)."""
    return EngineMessage(token_ids, finish_reason, None, 3, len(token_ids), 0, choices_running=0 if finish_reason else 1)


async def _raw_ingress(rep, token: str, ingress_id: str = "raw"):
    """A connection to ``rep``'s link, past the handshake, as ingress ``ingress_id``."""
    host, port = rep.record_routing_stats()["link"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    speaker = LinkEngineClient(None, token)
    speaker.ingress_id = ingress_id
    await speaker._handshake(reader, writer)
    return reader, writer


async def _until_final(reader, request_id: str, timeout_s: float = 5.0) -> tuple[list, list]:
    """Every item of ``request_id`` read from a raw link up to its last one; and the others seen."""
    mine, others = [], []
    while not mine or (mine[-1][2] is None and mine[-1][1].finish_reason is None):
        for item in await asyncio.wait_for(read_outputs(reader), timeout_s):
            (mine if item[0] == request_id else others).append(item)
    return mine, others


def test_an_abort_read_together_with_its_submit_ends_the_request_before_it_runs():
    async def main():
        token = new_token()
        (rep,) = _replicas(token)
        await asyncio.sleep(0)
        reader, writer = await _raw_ingress(rep, token)
        request = {**asdict(_request(0, max_tokens=LONG)), "ingress_id": "raw"}
        writer.write(frame(Submit(request)) + frame(Abort("r0")))  # one segment: one read
        mine, _ = await _until_final(reader, "r0")
        assert [item[1].finish_reason for item in mine] == ["abort"]
        assert sum(len(item[1].token_ids) for item in mine) == 0
        assert rep.engine.stats().running == 0 and rep.engine.stats().waiting == 0
        writer.close()
        await _shutdown([rep])
    run(main())


class _HeldServe:
    """Serve's way in (``link_address``) where the answer waits for ``release``: the window in
    which the link to the replica it names can drop."""

    def __init__(self, plain) -> None:
        self.plain, self.asked, self.release = plain, asyncio.Event(), asyncio.Event()

    async def link_address(self, request: dict):
        answer = await self.plain.link_address(request)
        self.asked.set()
        await self.release.wait()
        return answer


def test_a_link_lost_while_serve_names_its_replica_costs_that_stream_nothing():
    async def main():
        reps, chooser, client = await _linked(1)
        first = client.generate(_request(0, max_tokens=LONG))
        await first.__anext__()  # the link is open
        chooser.ready = False  # the next request asks Serve
        held = client._serve = _HeldServe(client._serve)
        second = asyncio.ensure_future(_tokens(client.generate(_request(1))))
        await held.asked.wait()
        client._links[reps[0].replica_id].writer.transport.abort()  # the connection drops
        with pytest.raises(Unavailable):
            async for _ in first:
                pass
        held.release.set()
        tokens, messages = await asyncio.wait_for(second, 10)  # sent on a new link
        assert len(tokens) == 12 and messages[-1].finish_reason == "length"
        await wait_idle(reps)
        await _shutdown(reps)
    run(main())


def test_a_newer_link_of_the_same_ingress_ends_the_stale_one_and_its_requests():
    async def main():
        token = new_token()
        (rep,) = _replicas(token)
        await asyncio.sleep(0)
        old_reader, old_writer = await _raw_ingress(rep, token, "ingress-a")
        old_writer.write(frame(Submit({**asdict(_request(0, max_tokens=LONG)), "ingress_id": "ingress-a"})))
        await wait_load(rep, 1)
        # The ingress gave the old connection up (its node's network broke) without the replica
        # hearing of it, and connects again: the old request must not be adopted and run on.
        reader, writer = await _raw_ingress(rep, token, "ingress-a")
        writer.write(frame(Submit({**asdict(_request(1)), "ingress_id": "ingress-a"})))
        mine, others = await _until_final(reader, "r1")
        assert mine[-1][1].finish_reason == "length"
        assert others == []  # the stale link's request is not adopted by the new one
        await wait_idle([rep])
        while await asyncio.wait_for(old_reader.read(65536), 5):  # the stale connection was closed
            pass
        for w in (writer, old_writer):
            w.close()
        await _shutdown([rep])
    run(main())


def test_a_keepalive_timeout_on_a_link_fails_its_streams_as_unavailable():
    async def main():
        reps, _, client = await _linked(1)
        streams = await _running(client, 2)
        # What the kernel reports when keepalive probes or TCP_USER_TIMEOUT expire.
        client._links[reps[0].replica_id].reader.set_exception(TimeoutError(110, "Connection timed out"))
        for s in streams:
            with pytest.raises(Unavailable, match="closed its link"):
                async for _ in s:
                    pass
        assert reps[0].replica_id in client._avoid()
        await _shutdown(reps)
    run(main())


def test_both_ends_of_a_link_probe_it_with_keepalive(monkeypatch):
    probed: list[socket.socket] = []
    monkeypatch.setattr(link, "keepalive", lambda sock: probed.append(sock))
    monkeypatch.setattr(link_client, "keepalive", lambda sock: probed.append(sock))

    async def main():
        reps, _, client = await _linked(1)
        await _tokens(client.generate(_request(0)))
        assert len(probed) == 2  # the ingress's socket and the one the replica accepted
        assert {s.getsockname() for s in probed} != {probed[0].getsockname()}
        await _shutdown(reps)
    run(main())


def test_an_ingress_refuses_a_peer_without_the_token_before_reading_anything():
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("a frame from a replica without the token was unpickled",))

    async def main():
        token, heard = new_token(), []

        async def impostor(reader, writer):
            heard.append(await reader.read(16))
            writer.write(b"\2" * 16 + b"\0" * 32 + frame([("r0", _message([1]), None)]) + pickle.dumps(Boom()))
            await writer.drain()
            heard.append(await reader.read(65536))

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = LinkEngineClient(None, token, lambda request, avoid: ("impostor", f"127.0.0.1:{port}"))
        with pytest.raises(Unavailable, match="does not hold"):
            await _tokens(client.generate(_request(0)))
        await asyncio.sleep(0.1)
        assert heard and bytes.fromhex(token) not in b"".join(heard)  # the token never crossed
        assert "impostor" in client._avoid()
        server.close()
    run(main())


def test_a_stalled_ingress_has_its_link_closed_and_its_requests_aborted(monkeypatch):
    monkeypatch.setattr(link, "WRITE_STALL_S", 0.3)

    class NeverDrains:
        def __init__(self) -> None:
            self.written = 0

        def write(self, data: bytes) -> None:
            self.written += len(data)

        def is_closing(self) -> bool:
            return False

        async def drain(self) -> None:
            await asyncio.Event().wait()

    async def main():
        token = new_token()
        (rep,) = _replicas(token)
        server, connection = LinkServer(rep, token), Connection("slow")
        server.submit(connection, _request(0, max_tokens=LONG))
        writer = NeverDrains()
        await asyncio.wait_for(server.forward(connection, writer), 5)
        assert writer.written > 0
        await wait_idle([rep])  # the forwarder gave up and the request was aborted
        await _shutdown([rep])
    run(main())


def test_a_backlog_beyond_the_bound_closes_the_link_and_a_large_one_goes_in_several_frames(monkeypatch):
    batch = [(f"r{i}", _message([i]), None) for i in range(2500)]
    data = outputs(batch)
    sent = []
    while data:
        (size,) = HEADER.unpack(data[:4])
        sent.append([as_item(o) for o in msgspec.msgpack.decode(data[4:4 + size], type=list[Output])])
        data = data[4 + size:]
    assert [len(f) for f in sent] == [1024, 1024, 452] and sum(sent, []) == batch

    monkeypatch.setattr(link, "MAX_BACKLOG_ITEMS", 3)

    async def main():
        token = new_token()
        (rep,) = _replicas(token)
        server, connection = LinkServer(rep, token), Connection("behind")
        for i in range(4):
            server.submit(connection, _request(i, max_tokens=LONG))
        await wait_load(rep, 4)
        await asyncio.sleep(0.05)  # outputs pile up with no forwarder writing them

        class Writer:
            written = 0

            def write(self, data):
                Writer.written += len(data)

            def is_closing(self):
                return False

        await asyncio.wait_for(server.forward(connection, Writer()), 5)
        assert Writer.written == 0  # closed without sending the backlog
        await wait_idle([rep])
        await _shutdown([rep])
    run(main())
