"""Hostile peers on an engine replica's link port (deployments.link), over real loopback.

Each peer is refused: its connection ends, nothing it sent runs (no request reaches the engine,
no payload is deserialized into code) and the replica goes on serving a real ingress.
"""

from __future__ import annotations

import ast
import asyncio
import os
import pickle
import secrets
import struct
from pathlib import Path

import msgspec
from msgspec.structs import asdict
import pytest

import deployments.link as link
from deployments.contract import EngineRequest, Hello, Submit, decode_ingress_frame, frame, read_outputs
from deployments.link import new_token
from deployments.link_auth import MAC_BYTES, NONCE_BYTES, mac
from deployments.link_client import LinkEngineClient
from engine.errors import InvalidRequestError
from tests.serving_helpers import run
from tests.test_link import _replicas, _request, _shutdown, _tokens


class _Marker:
    """Unpickling this creates ``path``: the file existing afterwards means a payload ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _framed(data: bytes) -> bytes:
    return struct.pack("!I", len(data)) + data


async def _handshake(reader, writer, token: str) -> None:
    ingress = LinkEngineClient(None, token)
    ingress.ingress_id = "hostile"
    await ingress._handshake(reader, writer)


def _submit_with(**changes) -> bytes:
    request = {**asdict(_request(0)), "ingress_id": "hostile", **changes}
    return frame(Submit(request))


PAST_HANDSHAKE = {
    "a pickle that runs code when loaded": lambda marker: _framed(pickle.dumps(_Marker(marker))),
    "garbage": lambda marker: _framed(secrets.token_bytes(64)),
    "a frame longer than the limit": lambda marker: struct.pack("!I", 1 << 31) + b"\0" * 64,
    "a second hello": lambda marker: frame(Hello("again")),
    "a submit that names no request": lambda marker: frame(Submit({
        key: value for key, value in asdict(_request(0)).items() if key != "request_id"})),
}

REFUSED = {  # a request the replica cannot take, and the field its error must name
    "token ids of the wrong type": ({"prompt_token_ids": ["1", "2"]}, "prompt_token_ids"),
    "sampling parameters out of range": ({"params": {"temperature": -1.0}}, "temperature"),
    "a sampling field that does not exist": ({"params": {"__class__": "os.system"}}, "__class__"),
}


async def _still_serves(rep, token: str) -> None:
    """A real ingress gets a whole answer, and the hostile connection left no request behind."""
    from deployments.engine_client import LocalEngineClient
    
    chooser = lambda request, avoid: (rep.replica_id, rep.record_routing_stats()["link"])  # noqa: E731
    client = LinkEngineClient(LocalEngineClient([rep]), token, chooser)
    tokens, messages = await _tokens(client.generate(_request(1)))
    assert len(tokens) == 12 and messages[-1].finish_reason == "length"
    stats = rep.engine.stats()
    assert stats.num_finished == 1 and stats.running == 0 and stats.waiting == 0


async def _connect(rep):
    host, port = rep.record_routing_stats()["link"].rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _closed(reader) -> bytes:
    """Everything the replica sends until it closes the connection (it must, within 5 s)."""
    return await asyncio.wait_for(reader.read(), 5)


async def _hostile_peer(send, marker: Path) -> bytes:
    """A replica, a peer connected to its link doing ``send(reader, writer, token)``: what the
    replica answered before it closed the connection; then the checks every case shares."""
    token = new_token()
    (rep,) = _replicas(token)
    await asyncio.sleep(0)
    reader, writer = await _connect(rep)
    await send(reader, writer, token)
    await writer.drain()
    answer = await _closed(reader)
    writer.close()
    assert not marker.exists(), "a payload read from the link ran"
    await _still_serves(rep, token)
    await _shutdown([rep])
    return answer


@pytest.mark.parametrize("case", list(PAST_HANDSHAKE))
def test_a_peer_holding_the_token_that_sends_a_bad_frame_is_cut_off_and_nothing_runs(case, tmp_path):
    marker = tmp_path / "ran"

    async def send(reader, writer, token):
        await _handshake(reader, writer, token)
        writer.write(PAST_HANDSHAKE[case](marker))

    assert run(_hostile_peer(send, marker)) == b""  # no output: the request (if any) never started


@pytest.mark.parametrize("case", ["no token", "a wrong token", "garbage", "a pickle in place of the proof"])
def test_a_peer_without_the_token_is_refused_before_any_frame_is_read(case, tmp_path, monkeypatch):
    monkeypatch.setattr(link, "HELLO_TIMEOUT_S", 0.5)
    marker = tmp_path / "ran"
    payload = _framed(pickle.dumps(_Marker(marker)))

    async def send(reader, writer, token):
        if case == "a wrong token":
            try:
                await _handshake(reader, writer, new_token())  # the replica proves first: the peer sees it fail
            except Exception:  # noqa: BLE001 - expected: "does not hold this application's token"
                pass
            writer.write(secrets.token_bytes(32) + _submit_with())
        elif case == "garbage":
            writer.write(os.urandom(4096))
        elif case == "a pickle in place of the proof":
            writer.write(b"\1" * 16 + payload + _submit_with())
        # "no token": says nothing, and the replica gives up after HELLO_TIMEOUT_S

    assert len(run(_hostile_peer(send, marker))) in (0, 16 + 32)  # at most the replica's nonce and proof


def test_a_submit_arrives_as_the_request_the_ingress_sent():
    sent = {**asdict(_request(3)), "ingress_id": "i", "priority": 2, "attempt": 1, "resume_token_ids": [7, 8],
            "trace_context": {"traceparent": "00-ab-cd-01"}, "operation": "chat", "cache_salt": "tenant-a",
            "tenant": "team-a", "tenant_weight": 2.5, "routing": {"reason": "prefix", "time_ns": 5}}
    key, got = decode_ingress_frame(frame(Submit(sent))[4:]).take()
    assert key == "r3~1" and got == EngineRequest(**sent)  # the router's note included


def test_a_resumed_n_request_and_every_output_field_cross_the_link_unchanged():
    from deployments.contract import Output, as_item, outputs
    from deployments.contract import EngineMessage
    from engine.outputs import RequestTiming, StreamOutput

    sent = {**asdict(_request(4)), "ingress_id": "i", "resume_choices": {1: [5, 6], 2: []}}
    _, got = decode_ingress_frame(frame(Submit(sent))[4:]).take()
    assert got.resume_choices == {1: [5, 6], 2: []}
    out = StreamOutput("r", [9], finished=True, finish_reason="stop", new_logprobs=[{9: -0.5, 3: -1.0}],
                       num_prompt_tokens=3, num_output_tokens=1,
                       timing=RequestTiming(arrival_time=0.0, first_scheduled_time=0.25), index=2,
                       choices_running=1, prompt_logprobs=[None, {4: -2.0}, {5: -0.25, 1: -3.0}],
                       embedding=[0.5, -0.25])
    message = EngineMessage.of(out, first=True)
    assert message.queue_time_s == 0.25  # the engine's queue time, for the ingress's per-tenant histogram
    [item] = [as_item(o) for o in msgspec.msgpack.decode(outputs([("w", message, None)])[4:], type=list[Output])]
    assert item == ("w", message, None)


def test_the_link_reads_typed_frames_only():
    """A batch of outputs is MessagePack any reader can decode, and no module of the serving layer
    imports a deserializer that can run code."""
    raw = frame([("r0", {"token_ids": [1]}, None)])
    assert msgspec.msgpack.decode(raw[4:]) == [["r0", {"token_ids": [1]}, None]]
    for path in Path(link.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            assert not {"pickle", "marshal", "cloudpickle", "dill"} & set(names), f"{path} imports {names}"


async def _finals(reader, keys: set[str]) -> dict[str, list]:
    """Every item read from a raw link until each of ``keys`` has had its last one."""
    items: dict[str, list] = {key: [] for key in keys}
    done = lambda item: item[2] is not None or item[1].finish_reason is not None  # noqa: E731
    while not all(seen and done(seen[-1]) for seen in items.values()):
        for item in await asyncio.wait_for(read_outputs(reader), 5):
            items.setdefault(item[0], []).append(item)
    return items


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_submit_the_replica_cannot_take_fails_alone_and_its_link_serves_on(case):
    """A version skew or a hostile field costs its own request an error, not the link's other streams."""
    changes, field = REFUSED[case]

    async def main():
        token = new_token()
        (rep,) = _replicas(token)
        await asyncio.sleep(0)
        reader, writer = await _connect(rep)
        await _handshake(reader, writer, token)
        busy = frame(Submit({**asdict(_request(0, max_tokens=40)), "ingress_id": "hostile"}))
        # a field this replica does not know (a newer ingress's, in a rolling update) is ignored
        after = frame(Submit({**asdict(_request(2)), "ingress_id": "hostile", "a_newer_field": {"x": 1}}))
        writer.write(busy + _submit_with(request_id="bad", **changes) + after)  # one read
        items = await _finals(reader, {"r0", "bad", "r2"})
        (refused,) = items["bad"]
        assert refused[1] is None and isinstance(refused[2], InvalidRequestError) and field in str(refused[2])
        for key, want in (("r0", 40), ("r2", 12)):
            assert sum(len(item[1].token_ids) for item in items[key]) == want
            assert items[key][-1][1].finish_reason == "length"
        writer.write(frame(Submit({**asdict(_request(3)), "ingress_id": "hostile"})))  # the link is still open
        assert sum(len(item[1].token_ids) for item in (await _finals(reader, {"r3"}))["r3"]) == 12
        writer.close()
        stats = rep.engine.stats()
        assert stats.num_finished == 3 and stats.running == 0 and stats.waiting == 0
        await _shutdown([rep])
    run(main())


@pytest.mark.parametrize("hello", [{"type": "hello", "ingress_id": "older"},  # before versions were sent
                                   {"type": "hello", "ingress_id": "newer", "version": 99, "a_newer_field": [1]}])
def test_an_ingress_of_another_link_version_is_served(hello):
    """A rolling update pairs old and new ingresses with new and old replicas: both link and serve."""
    async def main():
        token = new_token()
        (rep,) = _replicas(token)
        await asyncio.sleep(0)
        reader, writer = await _connect(rep)
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(nonce)
        answer = await reader.readexactly(NONCE_BYTES + MAC_BYTES)
        key = bytes.fromhex(token)
        writer.write(mac(key, b"ingress", nonce, answer[:NONCE_BYTES]) + frame(hello))
        writer.write(frame(Submit({**asdict(_request(0)), "ingress_id": hello["ingress_id"]})))
        items = (await _finals(reader, {"r0"}))["r0"]
        assert sum(len(item[1].token_ids) for item in items) == 12
        writer.close()
        await _shutdown([rep])
    run(main())
