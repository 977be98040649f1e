"""OpenTelemetry traces (deployments.tracing), in one process.

Configuration from the standard OTEL_* variables (exporter choice, sampler, service name, OTLP
to a local collector, the console exporter to a file); then the real serving path (replica with
the real engine + frontend + gRPC methods / OpenAI app) under an in-memory exporter: one trace
per request under the client's trace id, ingress -> routing -> engine spans, the engine's events
(a preemption forced by a small KV pool among them) at the engine's own times.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent import futures

import grpc
import httpx2
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from deployments.contract import EngineRequest
from engine.sampling import SamplingParams
from deployments.errors import BadRequest
from deployments.openai_api import build_openai_app
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.tracing import NO_SPAN, Tracing, exporter_names, provider_from_env, trace_headers
from tests.real_serving import LONG, GrpcContext, GrpcService, new_traceparent, real_frontend
from tests.ray_cluster import free_port

GENERATE_SPAN = "slotserve.v1.SlotServe/Generate"


@pytest.fixture
def clean_env(monkeypatch):
    """No OTEL_* variable from the machine running the tests."""
    for key in list(os.environ):
        if key.startswith("OTEL_") or key == "SLOTSERVE_TRACES_FILE":
            monkeypatch.delenv(key)
    return monkeypatch


def _in_memory() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # default sampler: parent-based, always on
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


# -- configuration ---------------------------------------------------------------------------

def test_nothing_is_traced_without_an_exporter(clean_env):
    tracing = Tracing.from_env()
    assert not tracing.enabled and tracing.provider is None
    span = tracing.start_ingress("x", "tiny", trace_headers("00-" + "1" * 32 + "-" + "2" * 16 + "-01", None))
    assert span is NO_SPAN  # no span object per request
    client = {"traceparent": "client-context", "tracestate": "vendor=1"}
    assert span.engine_trace_context(client) == client  # passed on as it came


@pytest.mark.parametrize("env, names", [
    ({}, []),
    ({"OTEL_TRACES_EXPORTER": "none"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp_proto_grpc"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp_proto_grpc"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "true"}, []),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["console", "otlp_proto_grpc"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ["otlp_proto_http"]),
])
def test_exporters_follow_the_otel_variables(clean_env, env, names):
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert exporter_names() == names


def test_an_exporter_that_is_not_installed_is_a_clear_error(clean_env):
    clean_env.setenv("OTEL_TRACES_EXPORTER", "zipkin_json")
    with pytest.raises(ValueError, match=r"OTEL_TRACES_EXPORTER='zipkin_json'.*installed span exporters: .*console"):
        provider_from_env()


def test_console_exporter_writes_json_lines_with_the_sdks_sampler_and_service_name(clean_env, tmp_path):
    path = tmp_path / "spans.jsonl"
    clean_env.setenv("OTEL_TRACES_EXPORTER", "console")
    clean_env.setenv("SLOTSERVE_TRACES_FILE", str(path))
    clean_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = provider_from_env()
    assert provider.resource.attributes["service.name"] == "slotserve"  # our default, not unknown_service
    assert "TraceIdRatioBased{0.25}" in provider.sampler.get_description()
    tracing = Tracing(provider)
    header, trace_id, _ = new_traceparent()  # sampled by the client: a parent-based sampler follows it
    tracing.start_ingress("one", "tiny", trace_headers(header, None)).end()
    provider.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(s["name"], s["context"]["trace_id"]) for s in spans] == [("one", f"0x{trace_id:032x}")]

    clean_env.setenv("OTEL_SERVICE_NAME", "llm-gateway")
    assert provider_from_env().resource.attributes["service.name"] == "llm-gateway"


class _Collector:
    """A minimal OTLP/gRPC trace collector on a local port."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self
        self.requests = []

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                collector.requests.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()


def test_otlp_endpoint_alone_exports_to_the_collector(clean_env):
    collector = _Collector()
    try:
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.port}")
        clean_env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        clean_env.setenv("OTEL_SERVICE_NAME", "slotserve-test")
        provider = provider_from_env()
        Tracing(provider).start_ingress("over-otlp", "tiny", None).end()
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        collector.server.stop(None)
    resource_spans = [rs for r in collector.requests for rs in r.resource_spans]
    names = [s.name for rs in resource_spans for ss in rs.scope_spans for s in ss.spans]
    services = {a.value.string_value for rs in resource_spans for a in rs.resource.attributes
                if a.key == "service.name"}
    assert names == ["over-otlp"] and services == {"slotserve-test"}


# -- the real serving path -------------------------------------------------------------------

def _by_trace(exporter: InMemorySpanExporter, trace_id: int) -> dict[str, object]:
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    by_name = {s.name: s for s in spans}
    assert len(by_name) == len(spans), [s.name for s in spans]  # one of each
    return by_name


def _check_engine_span(engine, route, usage) -> list[tuple[str, dict]]:
    """The engine span's place, attributes and events; returns the events as (name, attributes)."""
    assert engine.parent.span_id == route.context.span_id
    assert engine.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert engine.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert engine.attributes["slotserve.replica"] == route.attributes["slotserve.replica"]
    times = [e.timestamp for e in engine.events]
    assert engine.start_time <= times[0] and times == sorted(times) and times[-1] <= engine.end_time
    assert route.start_time <= route.end_time <= engine.start_time + 50_000_000  # clocks read 50 ms apart at most
    events = [(e.name, dict(e.attributes)) for e in engine.events]
    names = [n for n, _ in events]
    assert names[:3] == ["queued", "scheduled", "prefill_chunk"] and names[-1] == "finished"
    assert names.count("first_token") == 1 and names.count("preempted") == names.count("resumed")
    first_admission = [a for n, a in events[:names.index("first_token")] if n == "prefill_chunk"]
    assert sum(a["slotserve.tokens"] for a in first_admission) == usage.prompt_tokens  # no prefix cached
    assert events[-1][1] == {"slotserve.reason": "length", "slotserve.tokens": usage.completion_tokens}
    return events


def test_one_grpc_request_is_one_trace_under_the_clients_trace_id(tiny_model_dir, tokenizer):
    tracing, exporter = _in_memory()

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, tracing) as (frontend, replica):
            service = GrpcService(frontend)

            async def generate(first_token: int, header: str):
                msg = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(first_token, first_token + 20))),
                                         sampling=pb.SamplingOptions(max_tokens=LONG, temperature=0, ignore_eos=True))
                ctx = GrpcContext([("traceparent", header), ("tracestate", f"vendor=t{first_token}")])
                return [m async for m in service.Generate(msg.SerializeToString(), grpc_context=ctx)]

            clients = [new_traceparent() for _ in range(2)]
            # Two long requests at once in a 128-token KV pool: one of them is preempted.
            replies = await asyncio.gather(*(generate(3 + 40 * i, c[0]) for i, c in enumerate(clients)))
            return clients, replies, replica.replica_id

    clients, replies, replica_id = asyncio.run(asyncio.wait_for(main(), 120))
    messages_first = {trace_id: 3 + 40 * i for i, (_, trace_id, _) in enumerate(clients)}
    preemptions = 0
    for (_, trace_id, client_span_id), messages in zip(clients, replies):
        spans = _by_trace(exporter, trace_id)
        assert set(spans) == {GENERATE_SPAN, "slotserve.route", "text_completion tiny"}
        ingress, route, engine = spans[GENERATE_SPAN], spans["slotserve.route"], spans["text_completion tiny"]
        assert ingress.parent.span_id == client_span_id and ingress.parent.is_remote
        assert ingress.kind is SpanKind.SERVER and ingress.status.status_code is not StatusCode.ERROR
        assert route.parent.span_id == ingress.context.span_id
        # The client's vendor entries (W3C tracestate) go on with its trace, to the replica too.
        assert {s.context.trace_state.get("vendor") for s in spans.values()} == {f"t{messages_first[trace_id]}"}
        assert route.attributes["slotserve.replica"] == replica_id
        assert route.attributes["slotserve.route.reason"] == "round_robin"
        usage = messages[-1].usage
        for span in (ingress, engine):
            assert span.attributes["gen_ai.operation.name"] == "text_completion"
            assert span.attributes["gen_ai.request.model"] == "tiny"
            assert span.attributes["gen_ai.request.max_tokens"] == LONG
            assert span.attributes["gen_ai.request.temperature"] == 0.0
            assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("length",)
            assert span.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == LONG
            assert span.attributes["slotserve.cached_tokens"] == usage.cached_prompt_tokens
        assert ingress.attributes["slotserve.request_id"] == engine.attributes["slotserve.request_id"]
        events = _check_engine_span(engine, route, usage)
        preempted = [a for n, a in events if n == "preempted"]
        assert engine.attributes["slotserve.preemptions"] == len(preempted)
        assert all(a["slotserve.reason"] == "kv_cache_full" and a["slotserve.tokens"] > 0 for a in preempted)
        preemptions += len(preempted)
    assert preemptions >= 1


def test_chat_over_http_is_traced_as_chat(tiny_model_dir, tokenizer):
    tracing, exporter = _in_memory()
    header, trace_id, client_span_id = new_traceparent()

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, tracing) as (frontend, _):
            app = build_openai_app(frontend)
            async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test") as http:
                body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                        "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                r = await http.post("/v1/chat/completions", json=body, headers={"traceparent": header})
                assert r.status_code == 200
                return [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]

    chunks = asyncio.run(asyncio.wait_for(main(), 60))
    spans = _by_trace(exporter, trace_id)
    ingress, engine = spans["POST /v1/chat/completions"], spans["chat tiny"]
    assert ingress.parent.span_id == client_span_id and ingress.attributes["gen_ai.operation.name"] == "chat"
    assert spans["slotserve.route"].parent.span_id == ingress.context.span_id
    assert ingress.attributes["gen_ai.usage.output_tokens"] == chunks[-1]["usage"]["completion_tokens"] == 6
    assert [e.name for e in engine.events][-1] == "finished"


def test_a_client_trace_not_sampled_records_nothing(tiny_model_dir, tokenizer):
    tracing, exporter = _in_memory()
    header = new_traceparent()[0][:-2] + "00"  # the client decided not to sample

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, tracing) as (frontend, _):
            msg = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingOptions(max_tokens=3))
            ctx = GrpcContext([("traceparent", header)])
            return [m async for m in GrpcService(frontend).Generate(msg.SerializeToString(), grpc_context=ctx)]

    assert asyncio.run(asyncio.wait_for(main(), 60))[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert exporter.get_finished_spans() == ()


def test_a_refused_request_ends_its_span_with_the_error(tiny_model_dir, tokenizer):
    tracing, exporter = _in_memory()
    header, trace_id, _ = new_traceparent()

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, tracing) as (frontend, _):
            msg = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingOptions(max_tokens=-1))
            ctx = GrpcContext([("traceparent", header)])
            with pytest.raises(BadRequest):
                [m async for m in GrpcService(frontend).Generate(msg.SerializeToString(), grpc_context=ctx)]
            assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(asyncio.wait_for(main(), 60))
    spans = _by_trace(exporter, trace_id)
    assert list(spans) == [GENERATE_SPAN]  # never reached an engine
    assert spans[GENERATE_SPAN].status.status_code is StatusCode.ERROR
    assert spans[GENERATE_SPAN].attributes["error.type"] == "BadRequest"


def test_a_tenants_request_names_it_on_its_spans_even_when_refused(tokenizer):
    from deployments.engine_client import LocalEngineClient
    from deployments.frontend import Frontend, FrontendConfig
    from deployments.replica import EngineReplica
    from deployments.tenants import Tenant
    from tests.fake_engine import FakeAsyncEngine

    tracing, exporter = _in_memory()

    async def main():
        replica = EngineReplica("fake-model", {"vocab_size": tokenizer.vocab_size, "step_delay_s": 0.001},
                                FakeAsyncEngine, drain_timeout_s=1, model_name="tiny", tracing=tracing)
        frontend = Frontend(FrontendConfig(served_model_name="tiny", model="fake-model", api_keys=("plain-key-1",),
                                           tenants=(Tenant("team-a", ("key-of-a-1",)),)),
                            tokenizer, LocalEngineClient([replica]), tracing=tracing)
        traces = []
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_openai_app(frontend)),
                                      base_url="http://test") as http:
            for key, max_tokens in (("key-of-a-1", 3), ("plain-key-1", 3), ("key-of-a-1", -1)):
                header, trace_id, _ = new_traceparent()
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": max_tokens},
                                    headers={"traceparent": header, "authorization": f"Bearer {key}"})
                traces.append((trace_id, r.status_code))
        header, trace_id, _ = new_traceparent()
        msg = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=2))
        ctx = GrpcContext([("traceparent", header), ("authorization", "Bearer key-of-a-1")])
        assert [m async for m in GrpcService(frontend).Generate(msg.SerializeToString(), grpc_context=ctx)]
        await replica.shutdown()
        return traces, trace_id

    [(tenant, ok), (plain, ok_too), (refused, bad)], grpc_trace = asyncio.run(asyncio.wait_for(main(), 30))
    assert (ok, ok_too, bad) == (200, 200, 400)
    spans = _by_trace(exporter, tenant)
    assert spans["POST /v1/completions"].attributes["slotserve.tenant"] == "team-a"
    assert spans["text_completion tiny"].attributes["slotserve.tenant"] == "team-a"  # the engine's too
    assert _by_trace(exporter, grpc_trace)[GENERATE_SPAN].attributes["slotserve.tenant"] == "team-a"
    assert not [s for s in _by_trace(exporter, plain).values() if "slotserve.tenant" in s.attributes]
    span = _by_trace(exporter, refused)["POST /v1/completions"]
    assert span.status.status_code is StatusCode.ERROR and span.attributes["slotserve.tenant"] == "team-a"


def test_the_slot_aware_router_notes_its_decision_in_the_request():
    from types import SimpleNamespace

    from router.request_router import note_decision

    request = EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3], params=SamplingParams())
    note_decision(SimpleNamespace(args=[request]), "prefix")
    assert request.routing["reason"] == "prefix" and request.routing["time_ns"] > 0
    note_decision(SimpleNamespace(args=["not a request dict"]), "load")  # other calls: left alone
    note_decision(None, "load")
