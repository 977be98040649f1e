"""Who gets in at the ingress: no more streams than the engines can hold; once they are nearly full,
a share of them for each tenant by its weight (``FairShares``); and each tenant's own limits
(``TenantQuotas``).

Without the engines' capacity, an ingress takes every stream Serve hands it (up to
``ingress.max_ongoing_requests``) and the excess waits on its event loop, unbounded in practice,
while engine queues never fill: admitted latency then grows with the offered load, and refusals
come late. With it, a stream past the engines' capacity is refused at the door (RESOURCE_EXHAUSTED
/ 429), at once.

A tenant's ``max_concurrent_requests``, ``max_waiting`` and ``max_tokens_per_minute`` are for the
whole deployment; each ingress replica holds its share (divided by ``ingress_replicas``, rounded
up), as ``Admission`` shares the engines' capacity: requests spread over ingress replicas evenly
enough that a share per replica needs no coordination between them. Tokens (prompt and output) are
metered by a bucket that holds a minute's worth and refills continuously. A request is admitted
while the bucket holds anything, and is charged its prompt at admission and its output when its
stream ends: one request may take the bucket below zero, and the tenant's next requests then wait
until the debt is repaid, so over any stretch the tenant gets its rate and no answer is cut off.
A request waits from its admission to its first engine message (``Ticket.started``):
``max_waiting`` bounds what a tenant queues ahead of the other tenants' requests. Over a limit, the
request is refused at once: HTTP 429 with ``retry-after``, gRPC RESOURCE_EXHAUSTED, the message
naming the tenant and the limit. The ticket also records the tenant's latencies; the ``tenant``
label holds configured tenants only, so its series stay as few as the tenants.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

from deployments.contract import EngineMessage
from deployments.errors import TenantLimitExceeded
from deployments.metrics import NullRecorder, Recorder
from router.policy import RoutingStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """This ingress's share of the healthy engines' streams: slots (``max_num_seqs``) and queue
    places (``max_waiting``)."""

    running: int
    waiting: int

    @property
    def limit(self) -> int:
        return self.running + self.waiting

    @property
    def reserve(self) -> int:
        """The top streams of ``limit`` that only tenants under their fair share may take: half the
        queue places and never a slot, so a tenant alone still fills every slot and loses only queue."""
        return self.waiting // 2


def fair_share(limit: int, weight: float, others: Mapping[str | None, float]) -> float:
    """Streams of ``limit`` a tenant of ``weight`` is due beside ``others`` (their weights)."""
    return limit * weight / (weight + sum(others.values()))


class FairShares:
    """The streams this ingress holds per tenant (requests of none: one more tenant, ``None``, of
    weight 1), and whether a tenant may start one more.

    Up to ``limit - reserve`` streams anyone may; past ``limit`` nobody; in between only a tenant
    holding fewer than ``fair_share`` of ``limit`` among the contending tenants. So under contention
    each tenant's streams tend to its weight's share, a tenant alone gets everything (its share is
    all of it), and a tenant's requests are never reordered (admitted or refused at once, no queue).

    Contending: holding streams here, or refused for capacity within ``CONTENDING_S``. Without the
    second, a tenant that finds the ingress full (one other tenant fills it) counts for nothing: that
    tenant's share stays the whole, it takes back each stream that ends, and the newcomer only gets
    in by winning a race for the moment a stream ends. Counted, the ended stream is kept for the
    newcomer's retry (429s say retry after 1 s).
    """

    CONTENDING_S = 5.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._held: dict[str | None, int] = {}
        self._weights: dict[str | None, float] = {}
        self._refused: dict[str | None, float] = {}  # tenant -> when, refused for capacity
        self._clock = clock
        self.total = 0

    def held(self, tenant: str | None) -> int:
        return self._held.get(tenant, 0)

    def hold(self, tenant: str | None, weight: float) -> None:
        self._held[tenant] = self._held.get(tenant, 0) + 1
        self._weights[tenant] = weight
        self.total += 1

    def release(self, tenant: str | None) -> None:
        self.total -= 1
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]

    def refusal(self, tenant: str | None, weight: float, capacity: Capacity | None) -> str | None:
        """Why a new stream of ``tenant`` is refused now; None: it may start."""
        if capacity is None or self.total < capacity.limit - capacity.reserve:
            return None
        if self.total >= capacity.limit:
            reason = (f"this ingress holds {self.total} streams, its share of all the engines can run or queue; "
                      "retry later")
        else:
            share = fair_share(capacity.limit, weight, self._contenders(tenant))
            if self.held(tenant) < share:
                return None
            whose = f"tenant {tenant!r}" if tenant is not None else "requests of no tenant"
            reason = (f"{whose} is over its fair share of a contended ingress: it holds {self.held(tenant)} streams, "
                      f"its share by weight is {share:.1f} of {capacity.limit} ({self.total} held); retry later")
        self._refused[tenant] = self._clock()
        self._weights[tenant] = weight
        return reason

    def _contenders(self, tenant: str | None) -> dict[str | None, float]:
        """The other contending tenants' weights."""
        now = self._clock()
        for name, when in list(self._refused.items()):
            if now - when >= self.CONTENDING_S:
                del self._refused[name]
        names = (set(self._held) | set(self._refused)) - {tenant}
        return {name: self._weights[name] for name in names}


class Admission:
    """This ingress's share of the streams all healthy engine replicas can run or queue
    (``max_num_seqs + max_waiting`` each), refreshed from their load reports once a second, and
    who may take them (``shares``).

    A refresh asks every replica (a GCS lookup and one call each, several ms): once a limit is
    known it runs in the background and the request goes on with the last one, so a request
    after a quiet second does not wait for it."""

    REFRESH_S = 1.0

    def __init__(self, loads: Callable[[], Awaitable[list[RoutingStats]]] | None, ingress_replicas: int = 1) -> None:
        self._loads = loads
        self._share = max(1, ingress_replicas)
        self._capacity: Capacity | None = None
        self.shares = FairShares()
        self._refreshed = float("-inf")
        self._refresh_task: asyncio.Task | None = None

    async def capacity(self) -> Capacity | None:
        """None: no capacity known (no healthy replica reported yet): nothing to refuse on."""
        now = time.monotonic()
        if self._loads is not None and now - self._refreshed >= self.REFRESH_S:
            self._refreshed = now  # before the await: concurrent callers keep the last limit
            if self._capacity is None:
                await self._refresh()
            elif self._refresh_task is None or self._refresh_task.done():
                self._refresh_task = asyncio.ensure_future(self._refresh())
        return self._capacity

    async def limit(self) -> int | None:
        capacity = await self.capacity()
        return None if capacity is None else capacity.limit

    async def refusal(self, tenant: str | None, weight: float) -> str | None:
        """Why a new stream of ``tenant`` is refused (``FairShares``); None: it may start (then
        ``shares.hold`` it until it ends)."""
        return self.shares.refusal(tenant, weight, await self.capacity())

    async def _refresh(self) -> None:
        try:
            loads = await self._loads()
        except Exception:  # noqa: BLE001 - no report this time: keep the last limit
            return
        healthy = [r for r in loads if r.healthy]
        running = sum(r.max_num_seqs for r in healthy)
        total = running + sum(r.max_waiting for r in healthy)
        limit = -(-total // self._share)
        running = min(-(-running // self._share), limit)
        self._capacity = Capacity(running, limit - running) if total else None


PUBLIC_LOAD_FIELDS = ("replica_id", "healthy", "running", "waiting", "max_num_seqs", "free_slots", "kv_blocks_used",
                      "kv_blocks_total", "slot_occupancy", "kv_usage", "num_finished", "prefix_cache_hits",
                      "prefix_cache_queries", "updated_at", "lora_loaded", "lora_loads", "lora_evictions")
"""What a load report (``/load``, gRPC ``GetLoad``: its ``ReplicaLoad`` fields) tells any caller of a
replica. The rest is for routers only: engine-link addresses, adapters' paths on disk, prefix hashes."""


def summarize_load(replicas: list[RoutingStats]) -> dict:
    """The load report (JSON): each replica's public fields and the totals."""
    total = sum(r.max_num_seqs for r in replicas)
    running = sum(r.running for r in replicas)
    kv_total = sum(r.kv_blocks_total for r in replicas)
    kv_used = sum(r.kv_blocks_used for r in replicas)
    return {"replicas": [{**{k: getattr(r, k) for k in PUBLIC_LOAD_FIELDS}, "num_prefix_hashes": len(r.prefix_hashes)}
                         for r in replicas],
            "total_slots": total, "free_slots": sum(r.free_slots for r in replicas), "running": running,
            "waiting": sum(r.waiting for r in replicas),
            "occupancy": running / total if total else 0.0, "kv_usage": kv_used / kv_total if kv_total else 0.0}


OUTCOMES = ("admitted", "concurrency", "waiting", "tokens", "overloaded")
"""``tenant_requests``'s outcomes: one per request that reached admission."""


@dataclass
class _Usage:
    in_flight: int = 0
    waiting: int = 0
    """Admitted, no engine message yet."""
    level: float = 0.0
    """Tokens left in the bucket (negative: a debt)."""
    stamp: float = 0.0


class Ticket:
    """A request admitted for a tenant: ``started()`` and ``observe`` on each engine message,
    ``finish(output_tokens)`` once its stream ends, however it ends (a request that never started
    stops waiting then). A request of no tenant gets one that records nothing."""

    __slots__ = ("_quotas", "_tenant", "_recorder", "_arrival", "_queued", "_waiting")

    def __init__(self, quotas: "TenantQuotas | None", tenant: str | None, arrival: float | None = None) -> None:
        self._quotas, self._tenant = quotas, tenant
        self._recorder = quotas._recorder if quotas is not None else None
        self._arrival = arrival if quotas is not None else None  # None once its first text is recorded
        self._queued = quotas is None  # True once its queue time is recorded
        self._waiting = quotas is not None  # counted in its tenant's waiting until started

    def observe(self, message: EngineMessage, text: str, now: float | None = None) -> None:
        """An engine message and the text it gave the client: the
        engine's queue time from the first message carrying it, the time to the first text."""
        if not self._queued and message.queue_time_s is not None:
            self._queued = True  # a resumed request's next replica sends its own: the first one counts
            self._recorder.record("tenant_queue_time_seconds", message.queue_time_s, {"tenant": self._tenant})
        if self._arrival is not None and text:
            now = time.monotonic() if now is None else now
            self._recorder.record("tenant_time_to_first_token_seconds", max(now - self._arrival, 0.0),
                                  {"tenant": self._tenant})
            self._arrival = None

    def started(self) -> None:
        if self._waiting:  # called on every message: counts once
            self._waiting = False
            self._quotas._usage[self._tenant].waiting -= 1

    def finish(self, output_tokens: int) -> None:
        self.started()
        if self._quotas is not None:
            self._quotas._finish(self._tenant, output_tokens)
            self._quotas = None  # once


class TenantQuotas:
    def __init__(self, tenants, ingress_replicas: int = 1, recorder: Recorder | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``tenants``: ``deployments.tenants.Tenant`` entries (name, max_concurrent_requests,
        max_waiting, max_tokens_per_minute); ``recorder``: where the per-tenant metrics go."""
        self._recorder = recorder if recorder is not None else NullRecorder()
        for tenant in tenants:
            for outcome in OUTCOMES:
                self._recorder.start_at_zero("tenant_requests", {"tenant": tenant.name, "outcome": outcome})
            for kind in ("prompt", "output"):
                self._recorder.start_at_zero("tenant_tokens", {"tenant": tenant.name, "kind": kind})
            self._recorder.record("tenant_requests_in_flight", 0, {"tenant": tenant.name})
        share = max(1, ingress_replicas)
        self._share = share
        self._concurrent = {t.name: _ceil_share(t.max_concurrent_requests, share) for t in tenants}
        self._per_minute = {t.name: _ceil_share(t.max_tokens_per_minute, share) for t in tenants}
        self._max_waiting = {t.name: _ceil_share(t.max_waiting, share) for t in tenants}
        self._clock = clock
        self._usage = {t.name: _Usage(level=float(self._per_minute[t.name] or 0), stamp=clock()) for t in tenants}

    def admit(self, tenant: str | None, prompt_tokens: int, arrival: float | None = None) -> Ticket:
        """A ticket for the request, or ``TenantLimitExceeded``. Requests of no tenant pass.
        ``arrival``: when the ingress got it (``time.monotonic()``), the start of its time to first token."""
        if tenant is None or tenant not in self._usage:
            return Ticket(None, tenant)
        usage, limit, rate = self._usage[tenant], self._concurrent[tenant], self._per_minute[tenant]
        whose = f"tenant {tenant!r}" + (f" (this ingress's share of {self._share})" if self._share > 1 else "")
        if limit is not None and usage.in_flight >= limit:
            self._count(tenant, "concurrency")
            raise TenantLimitExceeded(f"{whose} has {usage.in_flight} requests in flight, its limit "
                                      f"(tenants.max_concurrent_requests: {limit}); retry when one ends", 1.0)
        waiting = self._max_waiting[tenant]
        if waiting is not None and usage.waiting >= waiting:
            self._count(tenant, "waiting")
            raise TenantLimitExceeded(f"{whose} has {usage.waiting} requests waiting for their first token, its "
                                      f"limit (tenants.max_waiting: {waiting}); retry when one starts", 1.0)
        if rate is not None:
            self._refill(usage, rate)
            if usage.level <= 0:
                self._count(tenant, "tokens")
                wait = max(1.0, math.ceil((1 - usage.level) * 60.0 / rate))
                raise TenantLimitExceeded(f"{whose} used its tokens for now (tenants.max_tokens_per_minute: "
                                          f"{rate}); retry in {wait:.0f} s", wait)
            usage.level -= prompt_tokens
        usage.in_flight += 1
        usage.waiting += 1
        self._count(tenant, "admitted")
        self._recorder.record("tenant_tokens", prompt_tokens, {"tenant": tenant, "kind": "prompt"})
        self._recorder.record("tenant_requests_in_flight", usage.in_flight, {"tenant": tenant})
        return Ticket(self, tenant, arrival)

    def overloaded(self, tenant: str | None) -> None:
        """Count a request of ``tenant`` refused for the engines' capacity before its own limits were
        checked: which tenants feel a full deployment. Requests of no tenant are not counted here."""
        if tenant in self._usage:
            self._count(tenant, "overloaded")

    def _count(self, tenant: str, outcome: str) -> None:
        self._recorder.record("tenant_requests", 1, {"tenant": tenant, "outcome": outcome})

    def in_flight(self, tenant: str) -> int:
        return self._usage[tenant].in_flight

    def waiting(self, tenant: str) -> int:
        return self._usage[tenant].waiting

    def concurrency(self, tenant: str | None) -> int | None:
        """The tenant's requests that may be in flight at this ingress at once, none started yet: the
        smaller of its in-flight and waiting shares (None: no limit)."""
        limits = [lim for lim in (self._concurrent.get(tenant), self._max_waiting.get(tenant)) if lim is not None]
        return min(limits, default=None)

    def _refill(self, usage: _Usage, rate: int) -> None:
        now = self._clock()
        usage.level = min(float(rate), usage.level + (now - usage.stamp) * rate / 60.0)
        usage.stamp = now

    def _finish(self, tenant: str, output_tokens: int) -> None:
        usage, rate = self._usage[tenant], self._per_minute[tenant]
        usage.in_flight -= 1
        self._recorder.record("tenant_tokens", output_tokens, {"tenant": tenant, "kind": "output"})
        self._recorder.record("tenant_requests_in_flight", usage.in_flight, {"tenant": tenant})
        if rate is not None:
            self._refill(usage, rate)
            usage.level -= output_tokens


def _ceil_share(limit: int | None, share: int) -> int | None:
    return None if limit is None else -(-limit // share)
