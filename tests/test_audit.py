"""The scheduling audit trail: recorded by the engine (queued, scheduled, prefill chunks,
preempted / resumed, first token, finished), returned in the last gRPC message and in the
OpenAI usage extension when asked for."""

from __future__ import annotations

import asyncio
import json
import re

import httpx2
import pytest

from deployments.openai_api import AUDIT_HEADER, build_openai_app
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from engine import LLMEngine, SamplingParams
from engine.outputs import AUDIT_DETAILS, MAX_AUDIT_EVENTS, audit_records
from engine.request import Request
from tests.real_serving import LONG, GrpcContext, GrpcService, real_frontend

_LETTERS = {"queued": "q", "scheduled": "s", "prefill_chunk": "p", "preempted": "x", "resumed": "r",
            "first_token": "f", "finished": "d"}
# Admitted, prefilled in chunks, maybe preempted and resumed (a recompute whose last token is
# cached or sampled has no prefill chunk left), one first token, finished.
_GRAMMAR = re.compile(r"qsp+(xrp*)*f(xrp*)*d")


def _check_trail(events: list[dict], prompt_len: int, max_tokens: int) -> None:
    assert _GRAMMAR.fullmatch("".join(_LETTERS[e["event"]] for e in events)), [e["event"] for e in events]
    assert events[0]["time_s"] == 0.0
    assert [e["time_s"] for e in events] == sorted(e["time_s"] for e in events)
    assert all(set(e) == {"time_s", "event", *AUDIT_DETAILS[e["event"]]} for e in events)
    # Every admission's prefill chunks are contiguous from what the prefix cache held.
    position = None
    for e in events:
        if e["event"] in ("scheduled", "resumed"):
            position = e["cached_tokens"]
        elif e["event"] == "prefill_chunk":
            assert e["start"] == position and e["tokens"] > 0
            position += e["tokens"]
        elif e["event"] == "first_token":
            assert position == prompt_len  # the whole prompt was computed first
        elif e["event"] == "preempted":
            assert e["reason"] == "kv_cache_full" and e["tokens"] >= position
    assert events[-1] == {**events[-1], "reason": "length", "tokens": max_tokens}


def test_engine_records_why_a_request_waited_and_was_preempted(tiny_model_dir):
    # 8 blocks of 8 tokens cannot hold two requests of 20 + 24 tokens: the later one is preempted.
    engine = LLMEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=8,
                                    max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [engine.requests[engine.add_request(list(range(3 + 30 * i, 23 + 30 * i)), params)][0] for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    trails = [audit_records(r.timing) for r in reqs]
    for trail in trails:
        _check_trail(trail, 20, 24)
    # Queued behind the others (two slots), the third waited: its "queued" says why.
    assert [(t[0]["waiting"], t[0]["running"]) for t in trails] == [(0, 0), (1, 0), (2, 0)]
    preempted = [r for r in reqs if r.timing.num_preemptions]
    assert preempted and all(sum(e["event"] == "preempted" for e in audit_records(r.timing))
                             == r.timing.num_preemptions for r in preempted)


def test_an_aborted_request_ends_its_trail_with_abort(tiny_model_dir):
    engine = LLMEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=16)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    req = engine.requests[rid][0]
    engine.step()
    engine.step()
    engine.abort(rid)
    trail = audit_records(req.timing)
    assert [e["event"] for e in trail] == ["queued", "scheduled", "prefill_chunk", "first_token", "finished"]
    assert trail[-1]["reason"] == "abort" and trail[-1]["tokens"] == 2


def test_a_long_trail_is_capped_but_keeps_its_end():
    req = Request("r", [1, 2], SamplingParams(), 0, 0, 64, 0, frozenset())
    for i in range(MAX_AUDIT_EVENTS + 10):
        req.record(float(i), "prefill_chunk", i, 1, 0)
    req.record(999.0, "finished", "length", 1)
    assert len(req.timing.events) == MAX_AUDIT_EVENTS + 1 and req.timing.events[-1][1] == "finished"


# -- returned to clients ---------------------------------------------------------------------

def test_grpc_last_message_carries_the_trail_when_asked(tiny_model_dir, tokenizer):
    async def main():
        async with real_frontend(tiny_model_dir, tokenizer) as (frontend, _):
            service = GrpcService(frontend)

            async def generate(first: int, audit: bool):
                msg = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(first, first + 20))),
                                         sampling=pb.SamplingOptions(max_tokens=LONG, temperature=0, ignore_eos=True),
                                         return_audit=audit)
                return [m async for m in service.Generate(msg.SerializeToString(), grpc_context=GrpcContext())]

            # Two long requests in a 128-token pool: one is preempted, and its trail says so.
            return await asyncio.gather(generate(3, True), generate(60, True), generate(120, False))

    replies = asyncio.run(asyncio.wait_for(main(), 120))
    trails = []
    for messages in replies[:2]:
        assert all(not m.audit for m in messages[:-1])  # the last message only
        trail = [{"time_s": e.time_s, "event": e.event,
                  **{k: getattr(e, k) for k in AUDIT_DETAILS[e.event]}} for e in messages[-1].audit]
        _check_trail(trail, 20, LONG)
        trails.append(trail)
    assert any(e["event"] == "preempted" for t in trails for e in t)
    assert not replies[2][-1].audit  # not asked for


def test_openai_usage_extension_carries_the_trail_when_asked(tiny_model_dir, tokenizer):
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer) as (frontend, _):
            transport = httpx2.ASGITransport(app=build_openai_app(frontend))
            async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
                whole = await http.post("/v1/completions", json=body, headers={AUDIT_HEADER: "true"})
                plain = await http.post("/v1/completions", json=body)
                stream = await http.post("/v1/completions", headers={AUDIT_HEADER: "1"},
                                         json={**body, "stream": True, "stream_options": {"include_usage": True}})
                refused = [await http.post("/v1/completions", json={**body, "stream": True},
                                           headers={AUDIT_HEADER: "true"}),
                           await http.post("/v1/completions", json=body, headers={AUDIT_HEADER: "yes please"})]
                return whole, plain, stream, refused

    whole, plain, stream, refused = asyncio.run(asyncio.wait_for(main(), 60))
    assert whole.status_code == 200 and plain.status_code == 200
    _check_trail(whole.json()["usage"]["audit"], 4, 5)
    assert "audit" not in plain.json()["usage"]
    chunks = [json.loads(line[6:]) for line in stream.text.split("\n\n") if line.startswith("data: {")]
    assert all(c.get("usage") is None for c in chunks[:-1])
    _check_trail(chunks[-1]["usage"]["audit"], 4, 5)
    assert [r.status_code for r in refused] == [400, 400]
    assert [r.json()["error"]["param"] for r in refused] == ["stream_options", AUDIT_HEADER]


@pytest.mark.parametrize("value", ["false", "0", ""])
def test_openai_audit_header_off_values(tiny_model_dir, tokenizer, value):
    async def main():
        async with real_frontend(tiny_model_dir, tokenizer) as (frontend, _):
            transport = httpx2.ASGITransport(app=build_openai_app(frontend))
            async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
                return await http.post("/v1/completions", headers={AUDIT_HEADER: value},
                                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2})

    r = asyncio.run(asyncio.wait_for(main(), 60))
    assert r.status_code == 200 and "audit" not in r.json()["usage"]
