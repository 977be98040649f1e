"""The waiting queue, shared fairly between tenants: a virtual token counter (VTC).

Each tenant (``Request.tenant``; requests of none are one more tenant) has a counter of the tokens
the engine computed for it, prompt and output alike, divided by its weight (``Request.weight``).
The next request admitted is, among the waiting requests of the lowest ``priority`` value, the
oldest of the tenant whose counter is lowest. So when tenants contend for slots each gets service
in proportion to its weight, one tenant's requests keep their order, and a tenant alone gets
everything (the order is then plain priority, then arrival: what it was without tenants).

A tenant that had nothing waiting has its counter lifted to the lowest counter among the tenants
that were waiting, when its next request arrives: idle time is not saved up as credit to burst with
later. The preemption victim is chosen the other way round (``victim_key``): among the lowest
priority, the request of the most-served tenant, the least advanced first.

The counter decides who is admitted when a slot frees, but with every slot held by one tenant's long
requests another tenant would still wait for one of them to end. So when all slots are taken, a
waiting tenant holds fewer than its weighted share of the slots, and a tenant served more tokens holds
more than its share, one request of the latter is preempted for it (``share_victim``). A slot changes
hands at most once a step, and only from a tenant over its share to one under it, so none moves back.
With the prefix cache on, the preempted request's full blocks stay cached and it resumes from them.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Iterator, Sequence

from engine.request import Request


class WaitQueue:
    def __init__(self) -> None:
        self._heaps: dict[str | None, list[tuple[int, int, Request]]] = {}
        self.service: dict[str | None, float] = {}
        """Virtual tokens served per tenant: tokens computed for it over its weight."""
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        return (req for heap in self._heaps.values() for _, _, req in heap)

    def push(self, req: Request) -> None:
        heap = self._heaps.setdefault(req.tenant, [])
        if not heap:  # (re)joining: no credit for the time it had nothing waiting
            floor = min((self.service.get(t, 0.0) for t, h in self._heaps.items() if h), default=None)
            own = self.service.get(req.tenant, 0.0)
            self.service[req.tenant] = own if floor is None else max(own, floor)
        heapq.heappush(heap, (req.priority, req.seq_no, req))
        self._size += 1

    def peek(self) -> Request | None:
        best = None
        for tenant, heap in self._heaps.items():
            if heap:
                priority, seq_no, req = heap[0]
                key = (priority, self.service.get(tenant, 0.0), seq_no)
                if best is None or key < best[0]:
                    best = (key, req)
        return None if best is None else best[1]

    def head_except(self, tenant: str | None) -> Request | None:
        """What ``peek`` would give if ``tenant`` had nothing waiting."""
        heads = [(prio, self.service.get(t, 0.0), seq, req) for t, heap in self._heaps.items() if heap and t != tenant
                 for prio, seq, req in heap[:1]]
        return min(heads, key=lambda row: row[:3])[3] if heads else None

    def pop(self) -> Request:
        req = self.peek()
        heapq.heappop(self._heaps[req.tenant])
        self._size -= 1
        return req

    def remove(self, req: Request) -> bool:
        heap = self._heaps.get(req.tenant, [])
        for i, (_, _, r) in enumerate(heap):
            if r is req:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                self._size -= 1
                return True
        return False

    def charge(self, req: Request, tokens: int) -> None:
        """``tokens`` computed for ``req`` this step, on its tenant's counter."""
        self.service[req.tenant] = self.service.get(req.tenant, 0.0) + tokens / req.weight

    def victim_key(self, req: Request) -> tuple:
        """Preempt the request of the largest key: lowest priority, then most-served tenant, then
        least advanced, then newest."""
        return (req.priority, self.service.get(req.tenant, 0.0), -req.num_computed_tokens, req.seq_no)

    def share_victim(self, running: Sequence[Request], slots: int) -> tuple[Request, Request] | None:
        """(victim, candidate): the running request to preempt and the waiting one to admit in its slot,
        or None (see the module's docstring).

        Shares are of ``slots`` by weight among the tenants with requests running or waiting. The
        candidate is the first request of the least-served tenant under its share. Only a request of its
        priority or a lower one (a larger value), of a tenant served as many tokens or more (by weight:
        a tenant that had nothing waiting joins at the lowest counter, so a tie is the usual case), is taken
        for it: slot shares alone would let a tenant of long requests take slots the counter gives to
        others."""
        held = Counter(r.tenant for r in running)
        weights = {r.tenant: r.weight for r in running}
        heads = {tenant: heap[0] for tenant, heap in self._heaps.items() if heap}
        weights.update((tenant, req.weight) for tenant, (_, _, req) in heads.items())
        total = sum(weights.values())
        under = [(priority, self.service.get(tenant, 0.0), seq_no, req) for tenant, (priority, seq_no, req)
                 in heads.items() if held[tenant] + 1 <= slots * weights[tenant] / total]
        if not under:
            return None
        candidate = min(under, key=lambda row: row[:3])[3]
        served = self.service.get(candidate.tenant, 0.0)
        over = [r for r in running if r.priority >= candidate.priority and held[r.tenant] > slots * r.weight / total
                and self.service.get(r.tenant, 0.0) >= served]
        victim = max(over, key=self.victim_key, default=None)
        return None if victim is None else (victim, candidate)
