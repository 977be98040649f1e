"""Who gets in at the ingress: API keys, no more streams than the engines can hold, and, once they
are nearly full, a share of them for each tenant by its weight (``FairShares``).

Without the second, an ingress takes every stream Serve hands it (up to
``ingress.max_ongoing_requests``) and the excess waits on its event loop, unbounded in
practice, while engine queues never fill: admitted latency then grows with the offered
load, and refusals come late. With it, a stream past the engines' capacity is refused
at the door (RESOURCE_EXHAUSTED / 429), at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Sequence

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


class ApiKeys:
    """The accepted keys: the configured ones plus those in a file, re-read once it changes."""

    CHECK_PERIOD_S = 1.0
    MIN_KEY_CHARS = 8

    def __init__(self, keys: Sequence[str], path: str | None) -> None:
        self._fixed = tuple(keys)
        self._path = path
        self._from_file: tuple[str, ...] = ()
        self._stamp: tuple[int, int] | None = None
        self._checked = float("-inf")
        if path is not None:
            self._reload()  # a missing or bad file fails the replica at start, not the first request

    def current(self) -> tuple[str, ...]:
        if self._path is not None and time.monotonic() - self._checked >= self.CHECK_PERIOD_S:
            try:
                self._reload()
            except (OSError, ValueError) as exc:  # keep serving with the last good keys
                logger.error("api_keys_file %s not reloaded: %s", self._path, exc)
        return self._fixed + self._from_file

    @property
    def required(self) -> bool:
        """A configured keys file asks for a key even while it holds none (fail closed)."""
        return bool(self._fixed) or self._path is not None

    def _reload(self) -> None:
        self._checked = time.monotonic()
        st = os.stat(self._path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        with open(self._path, encoding="utf-8") as f:
            keys = tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
        short = sum(len(k) < self.MIN_KEY_CHARS for k in keys)
        if short:
            raise ValueError(f"{short} key(s) shorter than {self.MIN_KEY_CHARS} characters")
        self._from_file, self._stamp = keys, stamp
        logger.info("api_keys_file %s: %d keys", self._path, len(keys))


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
