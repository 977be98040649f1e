"""The serving path in one process, no Ray: replica + frontend + gRPC methods + OpenAI API.

Engine replicas run ``tests.fake_engine.FakeAsyncEngine`` (deterministic tokens,
real slot / queue / abort semantics) so these tests are about the serving logic; the
real engine behind Ray is covered by test_serving_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest
from msgspec.structs import replace
from grpc_health.v1 import health_pb2

from deployments.contract import EngineRequest
from deployments.errors import BadRequest, DeadlineExceeded, ModelNotFound, Overloaded, Unauthenticated
from deployments.grpc_service import SlotServeGrpcMixin
from deployments.openai_api import build_openai_app
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.requests import GenerateInput
from engine.errors import EngineDeadError
from tests.serving_helpers import make_frontend, run, wait_idle, wait_load
from tests.waits import async_wait_until


# -- frontend ----------------------------------------------------------------------------

def test_stream_text_is_the_decode_of_the_tokens(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer)
        req = await fe.prepare(GenerateInput(prompt="hello world", sampling={"max_tokens": 24}))
        text, deltas = await fe.generate_all(req)
        ids = [t for d in deltas for t in d.token_ids]
        assert len(ids) == 24 and deltas[-1].finish_reason == "length"
        assert text == tokenizer.decode(ids)
        assert deltas[-1].usage.prompt_tokens == len(tokenizer.encode("hello world"))
        assert deltas[-1].usage.completion_tokens == 24
        await wait_idle(reps)
    run(main())


def test_sampling_params_are_validated_at_the_ingress_and_where_the_link_decodes_them(tokenizer, monkeypatch):
    import deployments.requests as requests
    from engine.sampling import SamplingParams

    built, init = [], SamplingParams.__init__

    def counted_init(self, *args, **kwargs):  # dataclasses.replace and the link's decode come here
        built.append("init")
        init(self, *args, **kwargs)

    class CountedAdapter:
        def validate_python(self, values):
            built.append("ingress")
            return adapter.validate_python(values)

    adapter = requests._SAMPLING
    monkeypatch.setattr(requests, "_SAMPLING", CountedAdapter())
    monkeypatch.setattr(SamplingParams, "__init__", counted_init)

    async def main():
        fe, reps = make_frontend(tokenizer)  # linked: the request crosses a loopback socket
        req = await fe.prepare(GenerateInput(prompt="hello", sampling={"max_tokens": 4, "stop": ["zz"]}))
        _, deltas = await fe.generate_all(req)
        assert deltas[-1].finish_reason == "length"
        await wait_idle(reps)
    run(main())
    assert built == ["ingress", "init"]


def test_stop_string_cuts_text_and_tokens_and_frees_the_slot(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer)
        base = await fe.prepare(GenerateInput(prompt="the quick brown fox", sampling={"max_tokens": 40}))
        full, _ = await fe.generate_all(base)
        # an ASCII stop string from the second half (byte tokens decode to U+FFFD until complete)
        stop = next(full[i:i + 2] for i in range(len(full) // 2, len(full) - 1)
                    if full[i:i + 2].isascii() and full[i:i + 2].isalnum())
        req = await fe.prepare(GenerateInput(prompt="the quick brown fox", sampling={"max_tokens": 40, "stop": [stop]}))
        text, deltas = await fe.generate_all(req)
        assert deltas[-1].finish_reason == "stop"
        assert text == full[:full.index(stop)]
        ids = [t for d in deltas for t in d.token_ids]
        assert deltas[-1].usage.completion_tokens == len(ids) < 40
        assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])
        await wait_idle(reps)
    run(main())


def test_abort_by_request_id_ends_the_stream(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer, step_delay_s=0.02)
        req = await fe.prepare(GenerateInput(prompt="hi", request_id="abc", sampling={"max_tokens": 500},
                                             cache_salt="tenant-a"))
        assert req.cache_salt == "tenant-a"  # the engine keys its cached blocks by it (tests/test_cache_salt.py)
        stream = fe.stream(req)
        first = await stream.__anext__()
        assert first.finish_reason is None and first.client_request_id == "abc" and first.request_id != "abc"
        # The client's own id is no key: only the server's id, streamed back, aborts.
        assert not await fe.abort("abc") and not await fe.abort("nope")
        assert await fe.abort(first.request_id)
        rest = [d async for d in stream]
        assert rest[-1].finish_reason == "abort"
        await wait_idle(reps)
    run(main())


def test_closing_the_stream_frees_the_slot(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer, step_delay_s=0.02)
        req = await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 500}))
        async with contextlib.aclosing(fe.stream(req)) as stream:
            await stream.__anext__()
            assert reps[0].record_routing_stats()["running"] == 1
        await wait_idle(reps)
        assert reps[0].engine.stats().num_aborted == 1
    run(main())


def test_deadline_aborts_the_request(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer, step_delay_s=0.05)
        req = await fe.prepare(GenerateInput(prompt="hi", timeout_s=0.2, sampling={"max_tokens": 500}))
        with pytest.raises(DeadlineExceeded, match="deadline of 0.2 s"):
            await fe.generate_all(req)
        await wait_idle(reps)
    run(main())


def test_overload_is_reported_and_others_keep_running(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer, max_num_seqs=1, max_waiting=1, step_delay_s=0.01)
        streams = []
        for _ in range(2):  # one running, one waiting
            req = await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 30}))
            streams.append(asyncio.ensure_future(fe.generate_all(req)))
        await wait_load(reps[0], running=1, waiting=1)
        req = await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 30}))
        with pytest.raises(Overloaded, match="retry"):
            await fe.generate_all(req)
        results = await asyncio.gather(*streams)
        assert [deltas[-1].finish_reason for _, deltas in results] == ["length", "length"]
    run(main())


def test_prepare_rejects_bad_requests(tokenizer):
    async def main():
        fe, _ = make_frontend(tokenizer)
        cases = [(dict(prompt=""), BadRequest, "empty"),
                 (dict(), BadRequest, "exactly one"),
                 (dict(prompt="x", messages=({"role": "user", "content": "y"},)), BadRequest, "exactly one"),
                 (dict(prompt="x", model="gpt-4"), ModelNotFound, "gpt-4"),
                 (dict(prompt="x " * 3000), BadRequest, "the limit is 2047"),
                 (dict(prompt_token_ids=(1, 10**6)), BadRequest, "prompt_token_ids"),
                 (dict(prompt="x", priority=2**40), BadRequest, "priority"),
                 (dict(prompt="x", sampling={"max_tokens": 10**6}), BadRequest, "max_tokens")]
        for fields, kind, needle in cases:  # some fail as the input is built, some when it is prepared
            with pytest.raises(kind, match=needle):
                await fe.prepare(GenerateInput(**fields))
        chat = await fe.prepare(GenerateInput(messages=({"role": "user", "content": "hi"},)))
        assert list(chat.prompt_token_ids) == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    run(main())


def test_api_keys_are_enforced_only_when_configured(tokenizer):
    open_fe, _ = make_frontend(tokenizer)
    open_fe.authorize(None)
    fe, _ = make_frontend(tokenizer, api_keys=["secret-key-1"])
    fe.authorize("Bearer secret-key-1")
    for bad in (None, "", "Bearer wrong-key", "secret-key-2"):
        with pytest.raises(Unauthenticated):
            fe.authorize(bad)


# -- replica -----------------------------------------------------------------------------

def test_replica_contracts(tokenizer):
    async def main():
        _, (rep,) = make_frontend(tokenizer, step_delay_s=0.01)
        stats = rep.record_routing_stats()
        types = {"free_slots": int, "running": int, "waiting": int, "max_num_seqs": int, "kv_blocks_used": int,
                 "kv_blocks_total": int, "block_size": int, "prefix_hashes": list, "healthy": bool,
                 "updated_at": float}
        assert all(isinstance(stats[k], t) for k, t in types.items())
        auto = rep.record_autoscaling_stats()
        assert set(auto) >= {"slot_occupancy", "waiting"} and all(type(v) is float for v in auto.values())
        # what the engine hands over at once goes out as one message (the fake engine's outputs hold
        # every token since its consumer last looked)
        request = EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3], params=_params(40), priority=0)
        stream = rep.generate(request)
        first = await stream.__anext__()
        # The consumer looks away until the engine has produced everything: one message holds it all.
        await async_wait_until(lambda: rep.engine.stats().num_finished == 1, "the request finished")
        rest = [m async for m in stream]
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 40 and len(rest) == 1
        rep.check_health()
        rep.engine.kill()
        with pytest.raises(EngineDeadError):
            rep.check_health()
        assert rep.record_routing_stats()["healthy"] is False
    run(main())


def test_replica_drains_before_shutdown(tokenizer):
    async def main():
        _, (rep,) = make_frontend(tokenizer, step_delay_s=0.01)
        request = EngineRequest(request_id="r", prompt_token_ids=[1, 2], params=_params(20), priority=0)
        consumer = asyncio.ensure_future(_collect(rep.generate(request)))
        await wait_load(rep, running=1)
        await rep.shutdown()  # waits for the running request
        messages = await consumer
        assert messages[-1].finish_reason == "length"
        with pytest.raises(EngineDeadError, match="shutting down"):
            await rep.generate(replace(request, request_id="late")).__anext__()
    run(main())


def _params(max_tokens):
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0)


async def _collect(gen):
    return [m async for m in gen]


# -- gRPC methods ------------------------------------------------------------------------

class FakeContext:
    """Ray Serve's RayServegRPCContext, as far as the service uses it."""

    def __init__(self, metadata=()):
        self.code = self.details = None
        self._metadata = list(metadata)

    def invocation_metadata(self):
        return self._metadata

    def traceparent(self):
        return dict(self._metadata).get("traceparent")

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


class Service(SlotServeGrpcMixin):
    def __init__(self, frontend):
        self.frontend = frontend


async def _grpc_stream(service, request, ctx):
    return [m async for m in service.Generate(request.SerializeToString(), grpc_context=ctx)]


def test_grpc_generate_and_errors(tokenizer):
    async def main():
        fe, _ = make_frontend(tokenizer)
        service = Service(fe)
        ok = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingOptions(max_tokens=12, temperature=0, logprobs=1))
        out = await _grpc_stream(service, ok, FakeContext())
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH and out[-1].usage.completion_tokens == 12
        assert "".join(m.text for m in out) == tokenizer.decode([t for m in out for t in m.token_ids])
        assert len(out[0].logprobs) == len(out[0].token_ids) and len(out[0].logprobs[0].top_logprobs) == 1
        bad = [(b"\x1a\x02\xff\xfe", grpc.StatusCode.INVALID_ARGUMENT, "valid"),
               (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=-3)),
                grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
               (pb.GenerateRequest(prompt="hi", model="other"), grpc.StatusCode.NOT_FOUND, "other"),
               (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[-4])), grpc.StatusCode.INVALID_ARGUMENT,
                "prompt_token_ids")]
        for request, code, needle in bad:
            ctx = FakeContext()
            raw = request if isinstance(request, bytes) else request.SerializeToString()
            with pytest.raises(Exception):
                [m async for m in service.Generate(raw, grpc_context=ctx)]
            assert ctx.code == code and needle in ctx.details
        # the service still serves after all that
        assert (await _grpc_stream(service, ok, FakeContext()))[-1].finish_reason == pb.FINISH_REASON_LENGTH
    run(main())


def test_grpc_auth_tokenize_info_load_health(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer, replicas=2, api_keys=["secret-key-1"])
        service = Service(fe)
        authed = FakeContext([("authorization", "Bearer secret-key-1")])
        ctx = FakeContext()
        with pytest.raises(Exception):
            await service.GetLoad(pb.GetLoadRequest().SerializeToString(), grpc_context=ctx)
        assert ctx.code == grpc.StatusCode.UNAUTHENTICATED
        tok = await service.Tokenize(pb.TokenizeRequest(text="hello world").SerializeToString(), grpc_context=authed)
        assert list(tok.token_ids) == tokenizer.encode("hello world") and tok.max_model_len == 2048
        info = await service.GetModelInfo(pb.GetModelInfoRequest().SerializeToString(), grpc_context=authed)
        assert info.served_model_name == "tiny" and info.has_chat_template and info.vocab_size == tokenizer.vocab_size
        load = await service.GetLoad(pb.GetLoadRequest().SerializeToString(), grpc_context=authed)
        assert len(load.replicas) == 2 and load.total_slots == 8 and load.free_slots == 8
        check = health_pb2.HealthCheckRequest
        assert (await service.Check(check(service="").SerializeToString())).status == 1
        assert (await service.Check(check(service="slotserve.v1.SlotServe").SerializeToString())).status == 1
        ctx = FakeContext()
        with pytest.raises(Exception):
            await service.Check(check(service="nope").SerializeToString(), grpc_context=ctx)
        assert ctx.code == grpc.StatusCode.NOT_FOUND
        watch = service.Watch(check(service="slotserve.v1.SlotServe").SerializeToString())
        assert (await watch.__anext__()).status == 1
        await watch.aclose()
        for rep in reps:
            rep.engine.kill()
        assert (await service.Check(check(service="slotserve.v1.SlotServe").SerializeToString())).status == 2
    run(main())


# -- OpenAI API, through the official client ------------------------------------------------

def _clients(app, api_key="none", **kwargs):
    import httpx2
    import openai

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=api_key, http_client=http, max_retries=0, **kwargs)
    return client, http


def test_openai_client_in_process(tokenizer):
    import openai

    async def main():
        fe, fe_reps = make_frontend(tokenizer, max_num_seqs=1, max_waiting=0)
        client, http = _clients(build_openai_app(fe, max_body_bytes=4096))
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        done = await client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=0)
        chunks = [c async for c in await client.completions.create(
            model="tiny", prompt="hello", max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
        assert chunks[-1].usage.completion_tokens == 10 == done.usage.completion_tokens
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8, extra_body={"top_k": 3, "min_p": 0.05})
        assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.role == "assistant"
        lp = (await client.completions.create(model="tiny", prompt="hello", max_tokens=4, logprobs=1)).choices[0]
        assert len(lp.logprobs.tokens) == 4 and [len(t) for t in lp.logprobs.top_logprobs] == [1] * 4
        chat_lp = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4, logprobs=True, top_logprobs=2)
        content = chat_lp.choices[0].logprobs.content
        assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob == -0.5 for c in content)
        with pytest.raises(openai.NotFoundError, match="not served"):
            await client.completions.create(model="gpt-4", prompt="x")
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.completions.create(model="tiny", prompt="x", temperature=-2)
        with pytest.raises(openai.BadRequestError, match="messages must not be empty") as info:
            await client.chat.completions.create(model="tiny", messages=[])
        assert info.value.param == "messages"
        # one slot, no queue: a second concurrent request is refused with 429
        slow = asyncio.ensure_future(client.completions.create(model="tiny", prompt="x", max_tokens=200))
        await wait_load(fe_reps[0], running=1)
        with pytest.raises(openai.RateLimitError, match="retry"):
            await client.completions.create(model="tiny", prompt="x", max_tokens=5)
        assert (await slow).choices[0].finish_reason == "length"
        for body, status in [(b"\xff\xfe{}", 400), (b"{not json", 400), (b"{}" + b" " * 5000, 413)]:
            r = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        await http.aclose()
    run(main())


def test_openai_auth_and_sse_wire_format(tokenizer):
    async def main():
        fe, _ = make_frontend(tokenizer, api_keys=["secret-key-1"])
        _, http = _clients(build_openai_app(fe))
        r = await http.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        r = await http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer secret-key-1"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        await http.aclose()
    run(main())
