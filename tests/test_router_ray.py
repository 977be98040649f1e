"""The router adapters on a real local Ray Serve: custom request router and autoscaling policy.

Fake engine replicas (no model) publish fixed routing stats chosen by their replica rank.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import pytest

from deployments.contract import EngineRequest
from engine.sampling import SamplingParams
from engine.kv.hashing import prefix_routing_keys
from router.autoscale import autoscaling_config

REPO = str(Path(__file__).resolve().parents[1])
BS = 4
PROMPT = list(range(1000, 1032))
OTHER_PROMPT = list(range(5000, 5032))

# 64 slots: one request in flight moves a replica's load by 1/64, far from every margin below.
FULL = {"running": 64, "free_slots": 0}
FREE = {"running": 1, "free_slots": 63}


def test_request_router_config_points_at_the_class():
    from ray.serve.request_router import RequestRouter

    from router.request_router import request_router_config

    cfg = request_router_config(period_s=0.2, stale_after_s=3.0, block_size=BS)
    assert cfg.request_router_class == "router.request_router.SlotAwareRequestRouter"
    cls = cfg.get_request_router_class()  # what Serve ships to every router process
    assert cls.__name__ == "SlotAwareRequestRouter" and issubclass(cls, RequestRouter)
    assert cfg.request_routing_stats_period_s == 0.2
    assert cfg.request_router_kwargs == {"stale_after_s": 3.0, "block_size": BS}
    assert request_router_config().request_router_kwargs == {"stale_after_s": 5.0}
    with pytest.raises(ValueError, match="unknown request_router_kwargs"):
        request_router_config(stale=1.0)
    with pytest.raises(ValueError, match="stale_after_s"):
        request_router_config(period_s=2.0, stale_after_s=3.0)
    # Slow polling stretches the default staleness limit with it.
    assert request_router_config(period_s=10.0).request_router_kwargs == {"stale_after_s": 40.0}


# ----------------------------------------------------------------------------- adapter, no cluster
def _router(app_name="app", name="engine", **kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.request_router import SlotAwareRequestRouter

    router = SlotAwareRequestRouter(deployment_id=DeploymentID(name=name, app_name=app_name),
                                    handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**{"seed": 0, "block_size": BS, **kwargs})
    return router


def _stats(running, prefix=(), updated_at=None):
    return {"free_slots": 64 - running, "running": running, "waiting": 0, "max_num_seqs": 64,
            "kv_blocks_used": 0, "kv_blocks_total": 256, "block_size": BS, "prefix_hashes": list(prefix),
            "healthy": True, "updated_at": time.time() if updated_at is None else updated_at}


def _req(prompt, request_id="q", **fields) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, params=SamplingParams(), **fields)


def _choose(router, replicas, args, request_id="q", call_method="generate"):
    """(ranked replica ids, the PendingRequest) for one call of choose_replicas."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve.request_router import PendingRequest

    # A request made without an id of its own (_req's "q") is named after the call, as each request is.
    args = [msgspec.structs.replace(a, request_id=request_id) if isinstance(a, EngineRequest) and a.request_id == "q"
            else a for a in args]

    async def choose():
        pending = PendingRequest(args=args, kwargs={}, metadata=SimpleNamespace(internal_request_id=request_id,
                                                                                call_method=call_method))
        ranks = await router.choose_replicas(replicas, pending)
        return [[r.replica_id for r in rank] for rank in ranks], pending

    return asyncio.run(choose())


def test_adapter_ranks_from_routing_stats_and_asks_for_backoff():
    from types import SimpleNamespace

    replicas = [SimpleNamespace(replica_id="busy", routing_stats=_stats(8)),
                SimpleNamespace(replica_id="cached", routing_stats=_stats(8, prefix_routing_keys(PROMPT, BS))),
                SimpleNamespace(replica_id="new", routing_stats={})]
    ranks, pending = _choose(_router(), replicas, [_req(PROMPT)])
    assert ranks == [["cached"], ["busy"], ["new"]]
    assert pending.routing_context.should_backoff
    # Ids no engine accepts cannot be hashed: routed on load alone (the replica rejects them).
    ranks, _ = _choose(_router(), replicas, [_req([-1] * 8 + PROMPT)])
    assert sorted(sum(ranks, [])) == ["busy", "cached", "new"] and ranks[-1] == ["new"]


@pytest.mark.parametrize("affinity", [True, False])
def test_adapter_prefers_the_replica_holding_the_lora_unless_affinity_is_off(affinity):
    from types import SimpleNamespace

    def lora_stats(running, loaded):
        return {**_stats(running), "lora_loaded": loaded, "lora_roots": {"sql": "ab" * 32}}

    replicas = [SimpleNamespace(replica_id="idle", routing_stats=lora_stats(0, [])),
                SimpleNamespace(replica_id="holds-sql", routing_stats=lora_stats(2, ["sql"]))]
    ranks, _ = _choose(_router(lora_affinity=affinity), replicas, [_req(PROMPT, lora="sql")])
    assert ranks[0] == (["holds-sql"] if affinity else ["idle"])
    from router.request_router import request_router_config

    with pytest.raises(ValueError, match="lora_affinity must be true or false"):
        request_router_config(lora_affinity="yes")


def test_adapter_spreads_a_burst_within_one_stats_period():
    from types import SimpleNamespace

    router = _router()
    replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats=_stats(0, updated_at=time.time() - 0.1))
                for i in range(3)]
    sent = {"r0": [], "r1": [], "r2": []}
    for i in range(30):
        ranks, pending = _choose(router, replicas, [_req(OTHER_PROMPT)], request_id=f"q{i}")
        first = ranks[0][0]
        router.on_request_routed(pending, first, None)
        sent[first].append(f"q{i}")
    # Without counting its own sends the router would see three idle replicas every time.
    assert sorted(len(v) for v in sent.values()) == [10, 10, 10]
    # Completed requests stop counting; so do requests that newer stats already include.
    for request_id in sent["r0"]:
        router.on_request_completed("r0", request_id)
    from router.request_router import _TRANSIT_GRACE_S

    # Stats taken right after the sends may miss requests still on their way: they keep counting.
    # (Timed from the first send, not from now: 30 choices take a while on a loaded machine.)
    first_send = min(router._sent["r1"].values())
    replicas[1].routing_stats = _stats(10, updated_at=first_send + _TRANSIT_GRACE_S / 2)
    assert router._load_of(replicas[1]).running == 20
    replicas[1].routing_stats = _stats(10, updated_at=time.time() + _TRANSIT_GRACE_S)
    running = {r.replica_id: router._load_of(r).running for r in replicas}
    assert running == {"r0": 0, "r1": 10, "r2": 10}


def test_a_choice_counts_before_serve_reports_the_routing():
    """Serve calls on_request_routed only after the replica accepted; its other routing tasks choose
    meanwhile and must see the requests already chosen, or a burst piles onto one replica."""
    from types import SimpleNamespace

    router = _router()
    replicas = [SimpleNamespace(replica_id="r0", routing_stats=_stats(0, updated_at=time.time() - 0.1)),
                SimpleNamespace(replica_id="r1", routing_stats=_stats(1, updated_at=time.time() - 0.1))]
    chosen = [_choose(router, replicas, [_req(OTHER_PROMPT)], request_id=f"q{i}")
              for i in range(6)]
    running = [router._load_of(r).running for r in replicas]
    assert sum(running) == 7 and abs(running[0] - running[1]) <= 1, running
    # A request its first choice refused counts where it went instead, once.
    ranks, pending = next((ranks, pending) for ranks, pending in chosen if ranks[0][0] == "r0")
    router.on_request_routed(pending, "r1", None)
    assert [router._load_of(r).running for r in replicas] == [running[0] - 1, running[1] + 1]


def test_submitted_requests_count_until_their_streams_end():
    """deployments.link: Serve's ``link_address`` call ends at once; its request is load until the ingress's
    stream ends."""
    from types import SimpleNamespace

    router = _router()
    replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats=_stats(0, updated_at=time.time() - 0.1))
                for i in range(2)]
    for i in range(4):
        request = _req(OTHER_PROMPT, f"linked-{i}")
        ranks, pending = _choose(router, replicas, [request], request_id=f"call{i}", call_method="link_address")
        router.on_request_routed(pending, ranks[0][0], None)
        router.on_request_completed(ranks[0][0], f"call{i}")  # the call returned
    assert [router._load_of(r).running for r in replicas] == [2, 2]
    for i in range(4):
        router.request_finished(f"linked-{i}")
    assert [router._load_of(r).running for r in replicas] == [0, 0]


def test_calls_without_a_prompt_take_no_slot():
    """A burst of model_info / stats calls must not make a replica look full to the next burst."""
    from types import SimpleNamespace

    router = _router()
    replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats=_stats(0, updated_at=time.time() - 0.1))
                for i in range(2)]
    for i in range(32):
        ranks, pending = _choose(router, replicas, [], request_id=f"info{i}")
        router.on_request_routed(pending, ranks[0][0], None)
    assert [router._load_of(r).running for r in replicas] == [0, 0]
    counts = {"r0": 0, "r1": 0}
    for i in range(16):
        ranks, pending = _choose(router, replicas, [_req(OTHER_PROMPT)], request_id=f"gen{i}")
        router.on_request_routed(pending, ranks[0][0], None)
        counts[ranks[0][0]] += 1
    assert counts == {"r0": 8, "r1": 8}


def test_engine_links_route_in_the_ingress_with_the_same_loads_and_counts():
    """deployments.link: the ingress finds the router Serve built in its process and asks it directly."""
    import asyncio
    from types import SimpleNamespace

    from router import registry

    assert registry.find("links-test#engine") is None  # none built yet
    router = _router(app_name="links-test")
    stale = time.time() - 0.1

    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    def replica(name, stats, link):
        rid = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="engine", app_name="links-test"))
        return SimpleNamespace(replica_id=rid, routing_stats={**stats, **link})

    replicas = [replica("cached", _stats(8, prefix_routing_keys(PROMPT, BS), stale), {"link": "10.0.0.1:4000"}),
                replica("idle", _stats(0, updated_at=stale), {"link": "10.0.0.2:4000"}),
                replica("no-link", _stats(0, updated_at=stale), {}),  # not serving links (yet)
                replica("malformed", {"running": -1}, {"link": "10.0.0.3:4000"})]  # never routed to
    async def updates():  # as Serve does, on its router loop (which also starts probing them)
        router.update_replicas(replicas)

    asyncio.run(updates())
    found = registry.find("links-test#engine")
    assert found is router and registry.find("links-test#other") is None
    request = _req(PROMPT, "l0")
    assert found.choose_for_link(request) == ("cached", "10.0.0.1:4000")
    assert request.routing["reason"] == "prefix"  # noted for the replica's trace, as Serve's calls are
    # A burst without a shared prefix spreads over the linked replicas, counting its own sends.
    chosen = [found.choose_for_link(_req(OTHER_PROMPT, f"l{i}"))[0] for i in range(1, 17)]
    assert chosen.count("idle") == 12 and chosen.count("cached") == 4  # 8 + 4 = 0 + 12
    # A replica the ingress could not reach is passed over; none left: Serve's way.
    assert found.choose_for_link(_req(PROMPT, "y"), avoid=frozenset({"cached"}))[0] == "idle"
    assert found.choose_for_link(_req(PROMPT, "z"), avoid=frozenset({"cached", "idle"})) is None
    # The ingress's loads are the stats the router polled: a quiet or stat-less replica is not healthy.
    replicas[1].routing_stats = {**replicas[1].routing_stats, "updated_at": time.time() - 60}  # a new poll
    stats = {s.replica_id: s for s in found.replica_stats()}
    assert [stats[r].healthy for r in ("cached", "idle", "no-link", "malformed")] == [True, False, True, False]
    assert stats["cached"].link == "10.0.0.1:4000" and stats["cached"].running == 8 and stats["no-link"].link is None
    assert stats["malformed"].max_num_seqs == 0  # known to the ingress, counted for nothing


@pytest.mark.parametrize("args", [[], [None], ["text"], [{"prompt": "x"}], [{"prompt_token_ids": [1, 2, 3]}]])
def test_calls_without_an_engine_request_get_no_prefix(args):
    from types import SimpleNamespace

    from router.request_router import prompt_token_ids

    assert prompt_token_ids(SimpleNamespace(args=args)) == []
    assert prompt_token_ids(None) == []


@pytest.fixture(scope="module")
def serve_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns token auth on by default
    import ray
    from ray import serve

    # Workers import router/ and engine/ by name (the router class references them). They inherit
    # the raylet's environment; a runtime_env would do the same but costs ~4 s at start-up.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, saved) if p)
    try:
        ray.init(num_cpus=2, include_dashboard=False)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    serve.start(proxy_location="Disabled")
    try:
        yield serve
    finally:
        serve.shutdown()
        ray.shutdown()


def _fake_engine(serve, ray):
    @ray.remote(num_cpus=0)
    class Tally:
        def __init__(self):
            self.polls = {}

        def bump(self, rank):
            self.polls[rank] = self.polls.get(rank, 0) + 1

        def get(self):
            return dict(self.polls)

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    class FakeEngine:
        def __init__(self, profiles, tally, autoscaling_stats=None):
            rank = serve.get_replica_context().rank
            self.rank = getattr(rank, "rank", rank)
            self.profile = profiles[self.rank % len(profiles)]
            self.tally = tally
            self.autoscaling_stats = autoscaling_stats

        def record_routing_stats(self):
            self.tally.bump.remote(self.rank)
            stats = {"free_slots": 64, "running": 0, "waiting": 0, "max_num_seqs": 64, "kv_blocks_used": 0,
                     "kv_blocks_total": 256, "block_size": BS, "prefix_hashes": [], "healthy": True}
            stats.update(self.profile)
            stats["updated_at"] = time.time()
            return stats

        def record_autoscaling_stats(self):
            return self.autoscaling_stats or {"slot_occupancy": 0.0, "waiting": 0.0}

        def link_address(self, request):  # the one Serve call that carries a request
            return self.rank

        def stats(self):
            return self.rank

    return Tally, FakeEngine


def _deploy(serve, name, profiles, **options):
    import ray
    from router.request_router import request_router_config

    Tally, FakeEngine = _fake_engine(serve, ray)
    tally = Tally.remote()
    app = FakeEngine.options(request_router_config=request_router_config(period_s=0.2, block_size=BS),
                             **options).bind(profiles, tally)
    handle = serve.run(app, name=name, route_prefix=None)
    return handle, tally


def _wait_for_stats(tally, replicas, timeout_s=20.0):
    """Until every replica has been polled a few times, plus time for Serve to broadcast the stats."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        polls = ray.get(tally.get.remote())
        if len(polls) == replicas and min(polls.values()) >= 3:
            time.sleep(0.6)
            return
        time.sleep(0.1)
    raise AssertionError(f"routing stats were not polled in {timeout_s} s: {polls}")


def _send(handle, prompt, n):
    return [handle.link_address.remote(_req(prompt, request_id=f"{prompt[0]}-{i}")).result(timeout_s=30)
            for i in range(n)]


@pytest.mark.ray
def test_requests_go_to_the_replica_with_free_slots(serve_cluster):
    handle, tally = _deploy(serve_cluster, "slots", [FULL, FREE], num_replicas=2)
    _wait_for_stats(tally, 2)
    assert _send(handle, PROMPT, 20) == [1] * 20
    # Calls without a request dict are routed too (no prefix, same load rule).
    assert {handle.stats.remote().result(timeout_s=30) for _ in range(10)} == {1}


@pytest.mark.ray
def test_requests_go_to_the_replica_holding_their_prefix(serve_cluster):
    # Load 0.125 against 0: comparable (default slack 0.25), so the prefix hit decides.
    cached = {"running": 8, "free_slots": 56, "prefix_hashes": prefix_routing_keys(PROMPT, BS)}
    handle, tally = _deploy(serve_cluster, "prefix", [cached, {"running": 0, "free_slots": 64}], num_replicas=2)
    _wait_for_stats(tally, 2)
    # Each request counts on its replica until the stats include it (it streams over a link), so
    # a burst of 8 more would tip the loads apart: 6 stay within the slack.
    assert _send(handle, PROMPT, 6) == [0] * 6
    # Without a cached prefix the less loaded replica wins.
    assert _send(handle, OTHER_PROMPT, 6) == [1] * 6


@pytest.mark.ray
def test_slot_occupancy_policy_runs_in_serve(serve_cluster):
    # Full replicas with requests waiting: the policy wants more. The default (request-count)
    # policy would not scale: no request is ever sent.
    config = autoscaling_config(1, 2, upscale_delay_s=0.0, downscale_delay_s=60.0,
                                metrics_interval_s=0.2, look_back_period_s=0.5)
    import ray

    Tally, FakeEngine = _fake_engine(serve_cluster, ray)
    app = FakeEngine.options(autoscaling_config=config).bind(
        [{}], Tally.remote(), {"slot_occupancy": 1.0, "waiting": 4.0})
    serve_cluster.run(app, name="scaling", route_prefix=None)
    deadline = time.monotonic() + 30
    running = 0
    while time.monotonic() < deadline:
        status = serve_cluster.status().applications["scaling"].deployments["FakeEngine"]
        running = status.replica_states.get("RUNNING", 0)
        if running == 2:
            break
        time.sleep(0.2)
    assert running == 2, status

