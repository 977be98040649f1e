"""Each tenant's limits at the ingress: requests in flight, requests waiting, tokens per minute.

A tenant's ``max_concurrent_requests``, ``max_waiting`` and ``max_tokens_per_minute`` are for the
whole deployment; each ingress replica holds its share (divided by ``ingress_replicas``, rounded
up), as ``Admission`` shares the engines' capacity: requests spread over ingress replicas evenly
enough that a share per replica needs no coordination between them.

Tokens (prompt and output) are metered by a token bucket that holds a minute's worth and refills
continuously. A request is admitted while the bucket holds anything, and is charged its prompt at
admission and its output when its stream ends. So one request may take the bucket below zero (a
long prompt, a long answer), and the tenant's next requests then wait until the debt is repaid:
over any stretch of time the tenant gets its rate, and no request is cut off mid-answer.

A request waits from its admission to its first engine message (``Ticket.started``: its first
tokens, or its end): ``max_waiting`` bounds what a tenant queues in the engines (or on its way
there) ahead of the other tenants' requests.

Over a limit, the request is refused at once: HTTP 429 with ``retry-after`` (when the bucket is
back above zero), gRPC RESOURCE_EXHAUSTED, the message naming the tenant and the limit.

The ticket also records the tenant's latencies (time to first token, the engine's queue time); the
``tenant`` label holds configured tenants only, so its series stay as few as the tenants.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from deployments.contract import EngineMessage
from deployments.errors import TenantLimitExceeded
from deployments.metrics import NullRecorder, Recorder

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
