"""Autoscaling end to end on a local Ray: a load step brings the engine deployment from 1
to 2 replicas, a drop in load brings it back to 1, and no request is lost on the way.

The real application (``deployments.app.build_app``: gRPC ingress, slot-aware router,
``router.autoscale.SlotOccupancyPolicy``) runs the real engine on a tiny random Llama.
Clients stream over gRPC from threads; every request asks for exactly ``MAX_TOKENS``
tokens (``ignore_eos``), so a truncated stream is caught by its token count.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from benchmarks.autoscale_load import (Clients, Monitor, calls_across, engine_calls, policy_decisions,
                                       replica_stop_times, serve_log_dir)
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
from tests.ray_cluster import APP, served_app
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

REPO = str(Path(__file__).resolve().parents[1])
SLOTS = 8
# A model whose context fits the long streams below; the shape is the tiny test model's.
MAX_POS = 12_800
ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": SLOTS, "max_waiting": 32, "block_size": 16,
          "num_kv_blocks": 8192, "max_model_len": MAX_POS}
KNOBS = {"min_replicas": 1, "max_replicas": 2, "target_occupancy": 0.75, "upscale_delay_s": 1.0,
         "downscale_delay_s": 6.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0}
MAX_TOKENS = 200
TRICKLE_CLIENTS = 4
STEP_CLIENTS = 14   # on one replica of 8 slots: full, 6 waiting -> scale up
# After the step, streams long enough to outlive the scale-down (8k decode steps: 14 s or more
# here, 35 s on a busy host, against 5-7 s from the load drop to the stop). One runs on each replica
# before the count drops, so whichever replica Serve stops is streaming when it does; a
# few on 2 x 8 slots is one replica's worth, so the count goes back to 1.
LONG_TOKENS = 8_000
MAX_LONG_CLIENTS = 6
# Bounds for a loaded 2-core machine, where most of a scale-up is the new replica's
# process start and imports competing with the streams for CPU (5-10 s idle, 30 s seen
# with other work on the host). The measured times are printed (pytest -s).
SCALE_UP_BOUND_S = 60.0
SCALE_DOWN_BOUND_S = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray import serve

    from tests.factories import make_model_dir

    model_dir = make_model_dir(tmp_path_factory.mktemp("long-llama"), "llama", seed=0, max_pos=MAX_POS)
    app = {"model": str(model_dir), "served_model_name": "tiny", "engine": ENGINE, "autoscaling": KNOBS,
           "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25}, "drain_timeout_s": 240}
    # The controller imports the policy (router.autoscale) by name: workers inherit the path.
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    with served_app(app, env={"PYTHONPATH": path}) as ports:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
        yield serve, slotserve_pb2_grpc.SlotServeStub(channel)
        channel.close()


def _new_replica(sample, first: str) -> str | None:
    """The id of a replica other than ``first`` once it has taken requests."""
    busy = [rid for rid, load in (sample.loads or {}).items()
            if rid != first and (load["running"] or load["num_finished"])]
    return busy[0] if busy else None


def _long_stream_on_every_replica(monitor, long_clients) -> None:
    """Start long streams one at a time until every replica runs one.

    The slot-aware router sends each new request to the less loaded replica, so this
    takes two or three requests; the bound only guards against a router that ignores load.
    """
    for started in range(1, MAX_LONG_CLIENTS + 1):
        long_clients.add(1)
        since = time.time()  # loads taken before this are the step's, not these streams'
        sample = monitor.wait_for(lambda s: s.loads and all(r["updated_at"] > since for r in s.loads.values())
                                  and sum(r["running"] for r in s.loads.values()) >= started,
                                  30, f"{started} long streams running")
        if len(sample.loads) == 2 and all(r["running"] >= 1 for r in sample.loads.values()):
            return
    raise AssertionError(f"{MAX_LONG_CLIENTS} long streams did not reach both replicas: {sample.loads}")


def test_load_step_scales_up_and_scale_down_loses_no_request(cluster):
    serve, stub = cluster
    clients = Clients(stub, MAX_TOKENS)
    long_clients = Clients(stub, LONG_TOKENS)
    with Monitor(serve, stub, APP, clients, period_s=0.25) as monitor:
        idle = monitor.wait_for(lambda s: s.states == {"RUNNING": 1} and s.loads, 30, "one replica")
        (first,) = idle.loads
        try:
            # Load step: one replica full with requests waiting -> a second one, taking requests.
            t0 = time.time()
            clients.add(STEP_CLIENTS)
            up = monitor.wait_for(lambda s: s.states == {"RUNNING": 2}, SCALE_UP_BOUND_S, "second replica RUNNING")
            serving = monitor.wait_for(lambda s: _new_replica(s, first), 30, "the new replica taking requests")

            # The step ends; its streams finish. Then one long stream per replica, and the
            # demand (a few slots of 16) brings the count back to one.
            clients.stop()
            monitor.wait_for(lambda s: clients.in_flight == 0, 120, "the step's streams finished")
            _long_stream_on_every_replica(monitor, long_clients)
            t1 = time.time()
            down = monitor.wait_for(lambda s: s.states.get("RUNNING") == 1, SCALE_DOWN_BOUND_S,
                                    "back to one replica")
        finally:
            clients.stop()
            long_clients.stop()
            clients.join(120)
            long_clients.join(400)  # the stopping replica drains its long stream meanwhile

    logs = serve_log_dir()
    second = _new_replica(serving, first)
    stopped_id = next((rid for rid in (second, first) if replica_stop_times(logs, rid)[0] is not None), None)
    assert stopped_id is not None, f"neither {first} nor {second} was stopped, by the controller log"
    # Its last stream has ended; the replica is gone a moment later.
    stopping, stopped = wait_until(lambda: (replica_stop_times(logs, stopped_id)[1] is not None
                                            and replica_stop_times(logs, stopped_id)), f"{stopped_id} stopped", 60)
    # Streams the stopping replica was serving when told to stop: counted from its access log.
    draining = calls_across(engine_calls(logs, APP, stopped_id), stopping)
    outcomes = clients.outcomes + long_clients.outcomes
    print(f"\nscale-up: 2 RUNNING {up.t - t0:.1f} s, new replica serving {serving.t - t0:.1f} s after the step; "
          f"back to 1 {down.t - t1:.1f} s after the long streams started; {len(draining)} streams in flight on "
          f"the stopping replica, drained in {stopped - stopping:.1f} s; {len(outcomes)} requests")
    failed = [o.error for o in outcomes if o.error]
    truncated = [o for o in outcomes if o.error is None and not o.complete]
    assert failed == [] and truncated == [], (failed[:3], truncated[:3])
    # The long stream started on it before the drop was still running when it was told to stop.
    assert len(draining) >= 1 and {status for *_, status in draining} == {"OK"}, draining
    # The remaining replica serves on.
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                 sampling=pb.SamplingOptions(temperature=0, max_tokens=8, ignore_eos=True))
    assert sum(len(m.token_ids) for m in stub.Generate(request, timeout=60)) == 8
    # Every change of the count is logged by the policy, with its inputs: up to 2, then back to 1.
    counts = [d.desired for d in policy_decisions(logs) if "demand=" in d.inputs]
    assert 2 in counts and counts[-1] == 1 and counts.index(2) < len(counts) - 1, counts


def test_deleting_the_app_drains_streams_in_flight(cluster):
    """What a graceful stop of the whole service does (``serve.delete`` before ``serve.shutdown``):
    the proxy stays up while the ingress and engine replicas drain, so running streams end normally."""
    serve, stub = cluster
    clients = Clients(stub, MAX_TOKENS)
    with Monitor(serve, stub, APP, clients, period_s=0.1) as monitor:
        try:
            clients.add(TRICKLE_CLIENTS)
            monitor.wait_for(lambda s: s.loads and sum(r["running"] for r in s.loads.values()) >= TRICKLE_CLIENTS,
                             30, "streams running")
        finally:
            clients.stop()  # no new requests; the running ones must complete through the deletion
    serve.delete(APP)
    clients.join(60)
    assert len(clients.outcomes) >= TRICKLE_CLIENTS
    assert all(o.complete and o.asked == MAX_TOKENS for o in clients.outcomes), clients.outcomes
