"""Traces end to end on a local Ray: the app (ingress + one replica of the real engine, slot-aware
router) configured only by OTEL_* variables, exporting with the SDK's console exporter into a
file every process appends to. Two gRPC requests with client traceparents, in a KV pool too
small for both: each trace holds the ingress span (ingress process), its routing span and the
engine span (replica process) across the Ray hop, and a preemption shows as an event. The
final gRPC message's audit trail and the engine span's events are the same record."""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import pytest

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
from router.policy import ROUTING_REASONS
from tests.ray_cluster import served_app
from tests.real_serving import ENGINE, LONG, new_traceparent
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]
GENERATE_SPAN = "slotserve.v1.SlotServe/Generate"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spans = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    app = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine": {**ENGINE, "num_threads": 1},
           "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25}}
    env = {"OTEL_TRACES_EXPORTER": "console", "SLOTSERVE_TRACES_FILE": str(spans),
           "OTEL_SERVICE_NAME": "slotserve-e2e", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with served_app(app, env=env) as ports:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
        yield slotserve_pb2_grpc.SlotServeStub(channel), spans
        channel.close()


def _read(path, trace_ids: set[str]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {t: [] for t in trace_ids}
    for line in path.read_text().splitlines() if path.exists() else ():
        span = json.loads(line)
        if span["context"]["trace_id"] in found:
            found[span["context"]["trace_id"]].append(span)
    return found


def test_each_request_is_one_trace_across_the_ray_hop(cluster):
    stub, path = cluster
    clients = [new_traceparent() for _ in range(2)]

    def generate(i: int) -> list[pb.GenerateResponse]:
        msg = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(3 + 40 * i, 23 + 40 * i))),
                                 sampling=pb.SamplingOptions(max_tokens=LONG, temperature=0, ignore_eos=True),
                                 return_audit=True)
        return list(stub.Generate(msg, metadata=(("traceparent", clients[i][0]),), timeout=120))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # 2 x 120 tokens in a 128-token pool: preemption
        replies = list(pool.map(generate, range(2)))
    replica_ids = {r.replica_id for r in stub.GetLoad(pb.GetLoadRequest(), timeout=10).replicas}
    trace_ids = {f"0x{trace_id:032x}" for _, trace_id, _ in clients}

    def exported():
        found = _read(path, trace_ids)
        return found if all(len(spans) == 3 for spans in found.values()) else None
    traces = wait_until(exported, "three spans per trace in the exported file", timeout_s=30, poll_s=0.1)
    preempted = 0
    for (_, trace_id, client_span_id), messages in zip(clients, replies):
        spans = {s["name"]: s for s in traces[f"0x{trace_id:032x}"]}
        ingress, route, engine = spans[GENERATE_SPAN], spans["slotserve.route"], spans["text_completion tiny"]
        assert ingress["parent_id"] == f"0x{client_span_id:016x}" and ingress["kind"] == "SpanKind.SERVER"
        assert route["parent_id"] == ingress["context"]["span_id"]
        assert engine["parent_id"] == route["context"]["span_id"]
        assert route["attributes"]["slotserve.route.reason"] in ROUTING_REASONS  # the slot-aware router's
        assert route["attributes"]["slotserve.replica"] == engine["attributes"]["slotserve.replica"] in replica_ids
        assert {s["resource"]["attributes"]["service.name"] for s in spans.values()} == {"slotserve-e2e"}
        last = messages[-1]
        assert engine["attributes"]["gen_ai.usage.output_tokens"] == last.usage.completion_tokens == LONG
        assert ingress["attributes"]["gen_ai.usage.output_tokens"] == LONG
        # The audit trail came back over the Ray hop; the engine span's events are the same record.
        assert [e.event for e in last.audit] == [e["name"] for e in engine["events"]]
        assert [e.event for e in last.audit][-1] == "finished"
        preempted += sum(e.event == "preempted" for e in last.audit)
        assert engine["attributes"]["slotserve.preemptions"] == sum(e.event == "preempted" for e in last.audit)
    assert preempted >= 1
