"""Ray Serve adapter for the slot-aware policy: a custom ``RequestRouter``.

Serve builds one router per process that holds a handle to the engine deployment
(the proxy, every ingress replica) and calls ``choose_replicas`` for each request.
The ranking itself is ``router.policy.rank_replicas``; this module only turns Serve's
objects into ``ReplicaLoad``s and back. Attach it with ``request_router_config()``.

Each router registers itself in its process (``router.registry``): an ingress replica finds the
one Serve built there for the engine deployment and routes engine-link requests with it (the
same loads and counts, without a Serve call per request).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgspec
from ray.serve import metrics
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.contract import EngineRequest
from engine.kv.hashing import ROOT_HASH, prefix_routing_keys, salted_root
from router import registry
from router.policy import (ROUTING_DECISIONS_METRIC, ROUTING_REASONS, Ranking, ReplicaLoad, RouterSettings,
                           RoutingStats, rank_replicas, read_stats)

logger = logging.getLogger("ray.serve")

ROUTER_CLASS_PATH = "router.request_router.SlotAwareRequestRouter"
_SATURATION_LOG_PERIOD_S = 10.0
_TRANSIT_GRACE_S = 0.25


def request_router_config(period_s: float = 0.5, **router_kwargs: Any) -> RequestRouterConfig:
    """The ``request_router_config`` for the engine deployment.

    ``period_s`` is how often Serve polls each replica's ``record_routing_stats``;
    ``router_kwargs`` are ``RouterSettings`` fields, validated here so a typo fails at
    build time rather than in every proxy. ``stale_after_s`` defaults to four periods
    (at least 5 s).
    """
    if not isinstance(period_s, (int, float)) or isinstance(period_s, bool) or period_s <= 0:
        raise ValueError(f"period_s must be a number > 0, got {period_s!r}")
    router_kwargs.setdefault("stale_after_s", max(RouterSettings.stale_after_s, 4.0 * period_s))
    settings = RouterSettings.from_kwargs(router_kwargs)
    if settings.stale_after_s <= 2 * period_s:
        raise ValueError(f"stale_after_s must exceed two stats periods (2 * {period_s} s), "
                         f"got {settings.stale_after_s}")
    return RequestRouterConfig(
        request_router_class=ROUTER_CLASS_PATH,
        request_router_kwargs=dict(router_kwargs),
        request_routing_stats_period_s=period_s,
    )


def deployment_key(deployment_id: Any) -> str:
    """``"<app>#<deployment>"``: how ``router.registry`` names a deployment's router."""
    return f"{deployment_id.app_name}#{deployment_id.name}"


def _first_arg(pending_request: PendingRequest | None) -> Any:
    return pending_request.args[0] if pending_request is not None and pending_request.args else None


def _engine_request(pending_request: PendingRequest | None) -> EngineRequest | None:
    """The request of a call that carries one (``link_address``); None for anything else (``model_info``...)."""
    request = _first_arg(pending_request)
    return request if isinstance(request, EngineRequest) else None


def pinned_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica a call names (``{"replica_id": ...}``): a LoRA load sent to every replica in turn."""
    call = _first_arg(pending_request)
    target = call.get("replica_id") if isinstance(call, Mapping) else None
    return target if isinstance(target, str) else None


def prompt_token_ids(pending_request: PendingRequest | None) -> list[int]:
    """The prompt of a call that carries an ``EngineRequest``; [] for anything else (``stats()``...)."""
    request = _engine_request(pending_request)
    return request.prompt_token_ids if request is not None else []


def note_decision(pending_request: PendingRequest | None, reason: str) -> None:
    """Tell the chosen replica why (its trace's routing span): Serve serializes the arguments only
    after the choice, so the note travels with the request. A re-routed request gets a new note."""
    request = _engine_request(pending_request)
    if request is not None:
        request.noted(reason, time.time_ns())


class SlotAwareRequestRouter(RequestRouter):
    """Routes each request to a replica with free slots, KV headroom and its cached prefix.

    Not combined with ``FIFOMixin`` on purpose: FIFO hands the replica found for one
    request to the oldest waiting request, whose prompt may share nothing with that
    replica's cache. Serve's default matching gives each request the replica ranked for
    it. Each routing task still takes requests in arrival order.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._settings = RouterSettings()
        self._rng = random.Random()
        # Parsed stats per replica, reused until Serve delivers a new stats dict.
        self._parsed: dict[ReplicaID, tuple[Any, tuple[RoutingStats | None, ReplicaLoad]]] = {}
        # Requests this router sent, per replica: internal id -> time sent. Those sent after
        # a replica's stats were taken are added to its load, so a burst arriving within one
        # stats period spreads out instead of piling onto the replica that looked emptiest.
        self._sent: dict[ReplicaID, dict[str, float]] = {}
        self._reported_problems: set[ReplicaID] = set()
        self._last_saturation_log = 0.0
        self._decisions: metrics.Counter | None = None  # made once the settings are known (initialize_state)
        self._live: list[RunningReplica] = []
        self._lock = threading.Lock()
        registry.register(deployment_key(self._deployment_id), self)

    def initialize_state(self, **kwargs: Any) -> None:
        """Receives ``request_router_kwargs``: the ``RouterSettings`` fields."""
        self._settings = RouterSettings.from_kwargs(kwargs)
        self._rng = random.Random(self._settings.seed)
        self._decisions = metrics.Counter(ROUTING_DECISIONS_METRIC, "Routing decisions by why the first "
                                          "choice won: prefix, load or fallback.", tag_keys=("model_name", "reason"))
        self._decisions.set_default_tags({"model_name": self._settings.model_name})
        for reason in ROUTING_REASONS:  # exported at 0 from the start; see deployments.metrics.start_at_zero
            self._decisions._record(0, {"reason": reason})

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        context = getattr(pending_request, "routing_context", None)
        if context is not None and hasattr(context, "should_backoff"):
            # Serve reads this only after every rank refused; unset, it asks again at once (a hot
            # loop while all replicas are at max_ongoing_requests). Set, it backs off.
            context.should_backoff = True
        if not candidate_replicas:
            return []
        target = pinned_replica(pending_request)
        if target is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if pinned:
                return [pinned]
        request = _engine_request(pending_request)
        with self._lock:  # the ingress's engine links rank from another thread (choose_for_link)
            ranking, _ = self._rank(candidate_replicas, request)
            if ranking.ranks and len(ranking.ranks[0]) == 1 and prompt_token_ids(pending_request):
                # Counted on the first choice now: Serve reports the routing only after the replica
                # accepted (a round trip), and its other routing tasks choose meanwhile.
                self._count_sent(self._sent_key(pending_request), ranking.ranks[0][0])
        if ranking.saturated and time.time() - self._last_saturation_log > _SATURATION_LOG_PERIOD_S:
            self._last_saturation_log = time.time()
            logger.info("All %d replicas of %s are full; requests queue in the engines.",
                        len(candidate_replicas), self._deployment_id)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid] for rid in rank] for rank in ranking.ranks]

    def _rank(self, candidates: list[RunningReplica], request: EngineRequest | None
              ) -> tuple[Ranking, dict[ReplicaID, ReplicaLoad]]:
        """The policy's ranking for ``request``; a generate request gets its decision noted."""
        loads = {r.replica_id: self._load_of(r) for r in candidates}
        prompt = request.prompt_token_ids if request is not None else []
        adapter = request.lora if request is not None else None
        hashes = request_prefix_keys(request, list(loads.values()), self._settings) if prompt else []
        ranking = rank_replicas(list(loads.values()), hashes, time.time(), self._rng, self._settings.stale_after_s,
                                prompt_len=len(prompt), load_slack=self._settings.load_slack,
                                adapter=adapter if self._settings.lora_affinity else None)
        if prompt:  # a generate call (not stats / model_info)
            self._record_decision(ranking.reason)
            request.noted(ranking.reason, time.time_ns())
        return ranking, loads

    def choose_for_link(self, request: EngineRequest, avoid: frozenset = frozenset()) -> tuple[str, str] | None:
        """The replica for ``request`` among those with an engine link (``deployments.link``) and an
        id not in ``avoid``, and its address; None when there is none. Counted as sent, like a
        request Serve routes."""
        with self._lock:
            links = {r.replica_id: self._parse(r)[0] for r in self._live if r.replica_id.unique_id not in avoid}
            links = {rid: stats.link for rid, stats in links.items() if stats is not None and stats.link is not None}
            linked = [r for r in self._live if r.replica_id in links]
            if not linked:
                return None
            ranking, loads = self._rank(linked, request)
            if not ranking.ranks:
                return None
            best = min(ranking.ranks[0], key=lambda rid: (loads[rid].load, self._rng.random()))
            self._count_sent(request.request_id, best)
        return best.unique_id, links[best]

    def request_finished(self, request_id: str) -> None:
        """A linked request's stream ended in the ingress: it takes no slot any more."""
        with self._lock:
            for sent in self._sent.values():
                sent.pop(request_id, None)

    def replica_stats(self) -> list[RoutingStats]:
        """Every running replica's routing stats as last polled: the ingress's loads (admission,
        GetLoad, readiness) without a call of its own. A quiet or stat-less replica is not healthy."""
        with self._lock:
            polled = [(r.replica_id.unique_id, self._parse(r)[0]) for r in self._live]
        stale = time.time() - self._settings.stale_after_s
        return [RoutingStats.unknown(rid) if stats is None else
                msgspec.structs.replace(stats, replica_id=rid, healthy=stats.healthy and stats.updated_at > stale)
                for rid, stats in polled]

    def _record_decision(self, reason: str) -> None:
        # One per routing attempt: a request Serve re-routes (all ranks refused) counts again.
        if self._decisions is not None:
            self._decisions.inc(1, {"reason": reason})

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        # Only generate calls take a slot: counting a burst of model_info or stats calls would make
        # a replica look full and send every request of the next burst elsewhere.
        if prompt_token_ids(pending_request):
            with self._lock:
                self._count_sent(self._sent_key(pending_request), replica_id)

    @staticmethod
    def _sent_key(pending_request: PendingRequest) -> str:
        # A call that carries an EngineRequest (link_address) returns at once and the request goes
        # over its engine link: counted under its id until its stream ends in the ingress
        # (request_finished) or the replica's stats include it.
        request = _engine_request(pending_request)
        return request.request_id if request is not None else pending_request.metadata.internal_request_id

    def _count_sent(self, key: str, replica_id: ReplicaID) -> None:
        """Count the request on ``replica_id`` (and on no other: the first choice may have refused it)."""
        for other, sent in self._sent.items():
            if other != replica_id:
                sent.pop(key, None)
        self._sent.setdefault(replica_id, {})[key] = time.time()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            sent = self._sent.get(replica_id)
            if sent is not None:
                sent.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        with self._lock:
            self._live = list(replicas)
            for table in (self._parsed, self._sent):
                for rid in [rid for rid in table if rid not in live]:
                    del table[rid]

    def _parse(self, replica: RunningReplica) -> tuple[RoutingStats | None, ReplicaLoad]:
        """Its stats as Serve last polled them, parsed once per poll (with ``_lock`` held)."""
        raw = replica.routing_stats
        cached = self._parsed.get(replica.replica_id)
        if cached is not None and cached[0] is raw:
            return cached[1]
        parsed = read_stats(replica.replica_id, raw)
        self._parsed[replica.replica_id] = (raw, parsed)
        self._report_problem(replica.replica_id, parsed[1])
        return parsed

    def _load_of(self, replica: RunningReplica) -> ReplicaLoad:
        load = self._parse(replica)[1]
        sent = self._sent.get(replica.replica_id)
        if not sent or not load.known:
            return load
        # Requests sent well before the stats were taken are in them already, and finished ones
        # in no load at all; forget those. The grace covers the trip to the replica, during which
        # a request is in no stats.
        for request_id in [k for k, t in sent.items()
                           if t <= load.updated_at - _TRANSIT_GRACE_S]:
            del sent[request_id]
        return load.with_extra_running(len(sent))

    def _report_problem(self, replica_id: ReplicaID, load: ReplicaLoad) -> None:
        # An empty dict is normal until the first stats poll; anything else is a contract bug.
        if load.known or load.problem == "no stats yet" or replica_id in self._reported_problems:
            return
        self._reported_problems.add(replica_id)
        logger.warning("Ignoring routing stats of %s: %s", replica_id, load.problem)


def _block_size(loads: list[ReplicaLoad], fallback: int) -> int:
    """The block size most replicas report (they agree unless a rollout is under way)."""
    counts: dict[int, int] = {}
    for load in loads:
        if load.known:
            counts[load.block_size] = counts.get(load.block_size, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else fallback


def request_prefix_keys(request: EngineRequest, loads: list[ReplicaLoad], settings: RouterSettings) -> list[int]:
    """The routing keys of ``request``'s full prompt blocks, in the chain its engine will cache them
    under (its adapter's root, salted by its ``cache_salt``); none when that chain cannot be named."""
    salt = request.cache_salt
    root = _adapter_root(loads, request.lora)
    if root is None or not settings.max_prefix_blocks:
        return []
    try:
        root = salted_root(root, salt) if salt is not None else root
        return prefix_routing_keys(request.prompt_token_ids, _block_size(loads, settings.block_size),
                                   max_blocks=settings.max_prefix_blocks, root=root)
    except ValueError:  # ids (or a salt) no engine accepts: route on load, the replica rejects the request
        return []


def _adapter_root(loads: list[ReplicaLoad], adapter: str | None) -> bytes | None:
    """The first parent of ``adapter``'s prefix-cache chain, as a replica serving it reports it (the
    same on every replica: a digest of the adapter's weights); the base model's without an adapter;
    None when no replica reports that adapter (its blocks cannot be named, so none match)."""
    if adapter is None:
        return ROOT_HASH
    for load in loads:
        root = load.lora_roots.get(adapter)
        if root is not None:
            try:
                return bytes.fromhex(root)
            except ValueError:
                continue
    return None
