"""Several Ray nodes on this machine (``ray.cluster_utils.Cluster``): a node lost under load.

Clients come in through HAProxy on the head (the default ingress mode), which spreads streams
over two ingress replicas: one on the head, one on a node of its own (custom resources place
them). Two worker nodes offer one engine slot each, and a third stands by with a slot of its own.
While 32 greedy streams run, a node is removed, raylet and workers together:

- an engine replica's: every stream completes with the tokens of an undisturbed run (its
  ingress resumes the lost ones on the surviving replica over its engine link), and Serve
  starts the lost replica again on the spare node;
- an ingress replica's: the streams it held end at once with an error a client retries (the
  client's connection was to that process; HAProxy resets them), the others complete, and new
  requests are served by the ingress left.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from unittest import mock

import grpc
import pytest

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
from tests.ray_cluster import APP, free_port
from tests.test_fault_e2e import ENGINE, MAX_TOKENS, _prompt, assert_all_complete, offline_tokens, streams_under_way
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

@pytest.fixture(scope="module")
def nodes(tiny_model_dir):
    """(cluster, engine worker nodes, the ingress's worker node, gRPC stub through HAProxy)."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.config import HTTPOptions, ProxyLocation, gRPCOptions

    from deployments.app import SERVE_ENV, build_app
    from deployments.grpc_registration import SERVICER_FUNCTIONS
    from deployments.ingress_env import INGRESS_REPLICA_PORTS, ingress_env

    app = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine": ENGINE, "num_replicas": 2,
           "replica_resources": {"num_cpus": 0.5, "resources": {"engine_slot": 1}},
           "ingress": {"num_replicas": 2, "num_cpus": 0.25, "resources": {"ingress_slot": 1}}, "drain_timeout_s": 2}
    env = {"RAY_AUTH_MODE": "disabled", **SERVE_ENV, **ingress_env("haproxy", local=True)}
    with mock.patch.dict(os.environ, env), contextlib.ExitStack() as stack:
        # tp_slot: one tensor-parallel rank's room, on nodes that offer only one (test_tensor_parallel_...)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"ingress_slot": 1, "tp_slot": 1}, "include_dashboard": False})
        stack.callback(cluster.shutdown)
        workers = [cluster.add_node(num_cpus=1, resources={"engine_slot": 1, "tp_slot": 1}) for _ in range(3)]
        ray.init(address=cluster.address)
        stack.callback(ray.shutdown)
        grpc_port = free_port()
        serve.start(proxy_location=ProxyLocation.HeadOnly, http_options=HTTPOptions(host="127.0.0.1", port=free_port()),
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=list(SERVICER_FUNCTIONS)))
        stack.callback(serve.shutdown)
        # Serve picks each ingress replica's gRPC port per node, from the same first port on every
        # node; on one machine the second replica would then share the first one's port (its server
        # binds with SO_REUSEPORT) and the kernel, not HAProxy, would pick the replica of each
        # connection. So the head's replica starts while that first port is taken, and the ingress
        # node joins (and its replica takes the port) once it is free again.
        first_port = INGRESS_REPLICA_PORTS["GRPC"][0]
        blocker = stack.enter_context(socket.create_server(("", first_port)))
        deploy = threading.Thread(target=serve.run, args=(build_app(app),), kwargs={"name": APP, "route_prefix": "/"})
        deploy.start()
        wait_until(lambda: _running("Router") == 1, "the head's ingress replica running", 120, poll_s=0.5)
        blocker.close()
        ingress_node = cluster.add_node(num_cpus=1, resources={"ingress_slot": 1})
        deploy.join(180)
        assert _running("Router") == 2
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stack.callback(channel.close)
        yield cluster, workers, ingress_node, slotserve_pb2_grpc.SlotServeStub(channel)


def _running(deployment: str) -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    status = app.deployments.get(deployment) if app is not None else None
    return status.replica_states.get("RUNNING", 0) if status is not None else 0


def _replica_nodes(deployment: str) -> dict[str, str]:
    """Node id of each live replica of ``deployment``, by its actor name."""
    import ray

    nodes = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#"):
            try:
                actor = ray.get_actor(entry["name"], namespace="serve")
                # A lambda travels by value; a function of this module would be looked up by a
                # module name the replica's process cannot import.
                where = actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                nodes[entry["name"]] = ray.get(where, timeout=10)
            except Exception:  # noqa: BLE001 - gone or not started: not live
                continue
    return nodes


def _engine_nodes() -> dict[str, str]:
    return _replica_nodes("EngineReplica")


def _ingress_ports() -> tuple[int, int]:
    """The ingress replicas' own gRPC ports (HAProxy mode): the ingress node's replica took the first
    port, the head's the next (it started while the first was taken: see ``nodes``)."""
    from deployments.ingress_env import INGRESS_REPLICA_PORTS

    first = INGRESS_REPLICA_PORTS["GRPC"][0]
    return first, first + 1


def _every_ingress_routes_to_both_engines() -> bool:
    """Both ingress replicas' routers hold both engine replicas, with fresh stats: a burst started now
    spreads over the two (a replica Serve still starts, or one a router has not heard of, takes none)."""
    for port in _ingress_ports():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            load = slotserve_pb2_grpc.SlotServeStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)
        if sum(r.healthy for r in load.replicas) != 2:
            return False
    return True


def test_an_abort_reaches_a_stream_the_other_ingress_holds(nodes):
    holder, other = (slotserve_pb2_grpc.SlotServeStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
                     for port in _ingress_ports())
    stream = holder.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=_prompt(0)), sampling=pb.SamplingOptions(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=120)
    first = next(stream)
    assert other.Abort(pb.AbortRequest(request_id=first.request_id), timeout=30).found  # over its engine links
    rest = list(stream)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in [first, *rest]) < MAX_TOKENS
    assert not other.Abort(pb.AbortRequest(request_id=first.request_id), timeout=30).found


def test_a_lost_engine_node_loses_no_stream_and_its_replica_returns_on_another(nodes, tiny_model_dir):
    cluster, workers, _, stub = nodes
    want = offline_tokens(tiny_model_dir)
    before = _engine_nodes()
    assert len(before) == 2 and len(set(before.values())) == 2  # one engine replica on each of two nodes
    streams = streams_under_way(stub)
    victim = next(w for w in workers if w.node_id == next(iter(before.values())))
    cluster.remove_node(victim, allow_graceful=False)
    assert_all_complete(streams, want)
    spare = next(w.node_id for w in workers if w.node_id not in before.values())
    wait_until(lambda: spare in _engine_nodes().values() and len(_engine_nodes()) == 2,
               "the lost replica started again on the spare node", 120, poll_s=0.5)
    wait_until(_every_ingress_routes_to_both_engines, "both ingresses routing to the new replica", 120, poll_s=0.5)
    out = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=_prompt(0)), sampling=pb.SamplingOptions(
        temperature=0, max_tokens=8, ignore_eos=True)), timeout=60))
    assert [t for m in out for t in m.token_ids] == want[0][:8]


RESET_CODES = {"UNAVAILABLE", "CANCELLED", "UNKNOWN"}
"""What a client of a lost ingress gets: HAProxy resets a stream under way (RST_STREAM: REFUSED_STREAM
is UNAVAILABLE, CANCEL is CANCELLED, depending on how far the stream got), and answers one it
had not yet forwarded with HTTP 500 (Serve's HAProxy turns 502-504 into 500; gRPC says UNKNOWN)."""


def test_a_lost_ingress_node_ends_its_streams_at_once_and_the_other_ingress_serves_on(nodes, tiny_model_dir):
    cluster, _, ingress_node, stub = nodes
    want = offline_tokens(tiny_model_dir)
    ingresses = _replica_nodes("Router")
    assert len(ingresses) == 2 and ingress_node.node_id in ingresses.values()
    wait_until(_every_ingress_routes_to_both_engines, "both ingresses routing to both engines", 120, poll_s=0.5)
    streams = streams_under_way(stub)
    cluster.remove_node(ingress_node, allow_graceful=False)
    lost_at = time.monotonic()
    for s in streams:
        s.join(300)
    cut = [s for s in streams if s.error]
    assert cut and len(cut) < len(streams), "HAProxy spread the streams over both ingress replicas"
    assert {s.error.split(":")[0] for s in cut} <= RESET_CODES, [s.error for s in cut]
    assert all(s.ended_at - lost_at < 15 for s in cut), "a stream of the lost ingress waited for its deadline"
    assert [s.tokens for s in streams if not s.error] == [want[s.i] for s in streams if not s.error]
    assert all(s.completion_tokens == MAX_TOKENS for s in streams if not s.error)
    print(f"lost ingress: {len(cut)} of {len(streams)} streams cut: {sorted(s.error.split(':')[0] for s in cut)}")
    for i in range(8):  # new requests: all on the ingress left (HAProxy retries a refused connection)
        out = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=_prompt(i)), sampling=pb.SamplingOptions(
            temperature=0, max_tokens=8, ignore_eos=True)), timeout=60))
        assert [t for m in out for t in m.token_ids] == want[i][:8]


def test_tensor_parallel_ranks_never_span_nodes(nodes, tiny_model_dir):
    """The placement group ``build_app`` reserves for a TP=2 replica (one bundle per rank,
    deployments.tp_launcher puts rank r in bundle r): with nodes of one rank slot each it stays
    pending rather than split; a node with room for both ranks takes them together."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from deployments.app import engine_deployment_options
    from deployments.app import AppConfig

    cluster = nodes[0]
    cfg = AppConfig.from_args({"model": str(tiny_model_dir), "engine": {"tensor_parallel_size": 2},
                               "replica_resources": {"num_cpus": 0.25, "resources": {"tp_slot": 1}}})
    options = engine_deployment_options(cfg)
    assert sum(node["Resources"].get("tp_slot", 0) for node in ray.nodes() if node["Alive"]) >= 2
    pg = placement_group(options["placement_group_bundles"], strategy=options["placement_group_strategy"])
    try:
        with pytest.raises(GetTimeoutError):
            ray.get(pg.ready(), timeout=5)  # room for both ranks, but on different nodes: not placed
        double = cluster.add_node(num_cpus=1, resources={"tp_slot": 2})
        ray.get(pg.ready(), timeout=60)
        assert set(placement_group_table(pg)["bundles_to_node_id"].values()) == {double.node_id}
    finally:
        remove_placement_group(pg)
