"""Several Ray nodes on this machine (``ray.cluster_utils.Cluster``): a node lost under load.

The head runs Serve's controller, its proxy and the ingress (pinned there by a custom resource
of the head's); two worker nodes offer one engine slot each (another custom resource), and a
third stands by with a slot of its own. While 32 greedy streams run, the node of one busy engine
replica is removed, raylet and workers together: every stream completes with the tokens of an
undisturbed run (the ingress resumes the lost ones on the surviving replica over its engine
link), and Serve starts the lost replica again on the spare node.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import grpc
import pytest

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
from tests.ray_cluster import APP, free_port
from tests.test_fault_e2e import ENGINE, _prompt, assert_all_complete, offline_tokens, streams_under_way
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

@pytest.fixture(scope="module")
def nodes(tiny_model_dir):
    """(cluster, worker nodes, gRPC stub): the app on a head and three worker nodes."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.config import HTTPOptions, ProxyLocation, gRPCOptions

    from deployments.app import SERVE_ENV, build_app
    from deployments.grpc_registration import SERVICER_FUNCTIONS

    app = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine": ENGINE, "num_replicas": 2,
           "replica_resources": {"num_cpus": 0.5, "resources": {"engine_slot": 1}},
           "ingress": {"num_cpus": 0.25, "resources": {"head": 1}}, "drain_timeout_s": 2}
    with mock.patch.dict(os.environ, {"RAY_AUTH_MODE": "disabled", **SERVE_ENV}), contextlib.ExitStack() as stack:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 4},
                                                                "include_dashboard": False})
        stack.callback(cluster.shutdown)
        workers = [cluster.add_node(num_cpus=1, resources={"engine_slot": 1}) for _ in range(3)]
        ray.init(address=cluster.address)
        stack.callback(ray.shutdown)
        grpc_port = free_port()
        serve.start(proxy_location=ProxyLocation.HeadOnly, http_options=HTTPOptions(host="127.0.0.1", port=free_port()),
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=list(SERVICER_FUNCTIONS)))
        stack.callback(serve.shutdown)
        serve.run(build_app(app), name=APP, route_prefix="/")
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stack.callback(channel.close)
        yield cluster, workers, slotserve_pb2_grpc.SlotServeStub(channel)


def _engine_nodes() -> dict[str, str]:
    """Node id of each live engine replica, by its actor name."""
    import ray

    nodes = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(f"SERVE_REPLICA::{APP}#EngineReplica#"):
            try:
                actor = ray.get_actor(entry["name"], namespace="serve")
                # A lambda travels by value; a function of this module would be looked up by a
                # module name the replica's process cannot import.
                where = actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                nodes[entry["name"]] = ray.get(where, timeout=10)
            except Exception:  # noqa: BLE001 - gone or not started: not live
                continue
    return nodes


def test_a_lost_engine_node_loses_no_stream_and_its_replica_returns_on_another(nodes, tiny_model_dir):
    cluster, workers, stub = nodes
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
    out = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=_prompt(0)), sampling=pb.SamplingOptions(
        temperature=0, max_tokens=8, ignore_eos=True)), timeout=60))
    assert [t for m in out for t in m.token_ids] == want[0][:8]
