"""Each tenant's limits at the ingress: requests in flight and tokens per minute.

A tenant's ``max_concurrent_requests`` and ``max_tokens_per_minute`` are for the whole deployment;
each ingress replica holds its share (divided by ``ingress_replicas``, rounded up), as ``Admission``
shares the engines' capacity: requests spread over ingress replicas evenly enough that a share
per replica needs no coordination between them.

Tokens (prompt and output) are metered by a token bucket that holds a minute's worth and refills
continuously. A request is admitted while the bucket holds anything, and is charged its prompt at
admission and its output when its stream ends. So one request may take the bucket below zero (a
long prompt, a long answer), and the tenant's next requests then wait until the debt is repaid:
over any stretch of time the tenant gets its rate, and no request is cut off mid-answer.

Over a limit, the request is refused at once: HTTP 429 with ``retry-after`` (when the bucket is
back above zero), gRPC RESOURCE_EXHAUSTED, the message naming the tenant and the limit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from deployments.errors import TenantLimitExceeded
from deployments.metrics import NullRecorder, Recorder


@dataclass
class _Usage:
    in_flight: int = 0
    level: float = 0.0
    """Tokens left in the bucket (negative: a debt)."""
    stamp: float = 0.0


class Ticket:
    """A request admitted for a tenant: ``finish(output_tokens)`` once its stream ends."""

    def __init__(self, quotas: "TenantQuotas | None", tenant: str | None) -> None:
        self._quotas, self._tenant = quotas, tenant

    def finish(self, output_tokens: int) -> None:
        if self._quotas is not None:
            self._quotas._finish(self._tenant, output_tokens)
            self._quotas = None  # once


class TenantQuotas:
    def __init__(self, tenants, ingress_replicas: int = 1, recorder: Recorder | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``tenants``: ``deployments.tenants.Tenant`` entries (name, max_concurrent_requests,
        max_tokens_per_minute); ``recorder``: where the per-tenant metrics go."""
        self._recorder = recorder if recorder is not None else NullRecorder()
        for tenant in tenants:
            for outcome in ("admitted", "concurrency", "tokens"):
                self._recorder.start_at_zero("tenant_requests", {"tenant": tenant.name, "outcome": outcome})
            for kind in ("prompt", "output"):
                self._recorder.start_at_zero("tenant_tokens", {"tenant": tenant.name, "kind": kind})
            self._recorder.record("tenant_requests_in_flight", 0, {"tenant": tenant.name})
        share = max(1, ingress_replicas)
        self._share = share
        self._concurrent = {t.name: _ceil_share(t.max_concurrent_requests, share) for t in tenants}
        self._per_minute = {t.name: _ceil_share(t.max_tokens_per_minute, share) for t in tenants}
        self._clock = clock
        self._usage = {t.name: _Usage(level=float(self._per_minute[t.name] or 0), stamp=clock()) for t in tenants}

    def admit(self, tenant: str | None, prompt_tokens: int) -> Ticket:
        """A ticket for the request, or ``TenantLimitExceeded``. Requests of no tenant pass."""
        if tenant is None or tenant not in self._usage:
            return Ticket(None, tenant)
        usage, limit, rate = self._usage[tenant], self._concurrent[tenant], self._per_minute[tenant]
        whose = f"tenant {tenant!r}" + (f" (this ingress's share of {self._share})" if self._share > 1 else "")
        if limit is not None and usage.in_flight >= limit:
            self._count(tenant, "concurrency")
            raise TenantLimitExceeded(f"{whose} has {usage.in_flight} requests in flight, its limit "
                                      f"(tenants.max_concurrent_requests: {limit}); retry when one ends", 1.0)
        if rate is not None:
            self._refill(usage, rate)
            if usage.level <= 0:
                self._count(tenant, "tokens")
                wait = max(1.0, math.ceil((1 - usage.level) * 60.0 / rate))
                raise TenantLimitExceeded(f"{whose} used its tokens for now (tenants.max_tokens_per_minute: "
                                          f"{rate}); retry in {wait:.0f} s", wait)
            usage.level -= prompt_tokens
        usage.in_flight += 1
        self._count(tenant, "admitted")
        self._recorder.record("tenant_tokens", prompt_tokens, {"tenant": tenant, "kind": "prompt"})
        self._recorder.record("tenant_requests_in_flight", usage.in_flight, {"tenant": tenant})
        return Ticket(self, tenant)

    def _count(self, tenant: str, outcome: str) -> None:
        self._recorder.record("tenant_requests", 1, {"tenant": tenant, "outcome": outcome})

    def in_flight(self, tenant: str) -> int:
        return self._usage[tenant].in_flight

    def concurrency(self, tenant: str | None) -> int | None:
        """The tenant's requests in flight allowed at this ingress (None: no limit)."""
        return self._concurrent.get(tenant) if tenant is not None else None

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
