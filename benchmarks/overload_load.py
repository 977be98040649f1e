"""The overload soak's load and its per-phase figures (``benchmarks.overload`` and its test).

A run is a sequence of phases, each a group of closed-loop gRPC streaming clients
(``autoscale_load.Clients``: every request asks for exactly ``max_tokens`` tokens with
``ignore_eos``) that runs for a while and is then stopped, its requests in flight allowed
to finish:

- ``warm-up``: ``slots`` clients, not measured;
- ``full``: exactly ``slots`` clients: every slot busy, nothing queued. Its p99 E2E is the
  service time of one request at full occupancy, the unit of the latency bound;
- ``light``: a quarter of the slots: the latency recovery is compared with;
- ``overload``: ``factor x slots`` clients; the engines' bounded queues fill and the rest
  are shed with RESOURCE_EXHAUSTED;
- ``recovery``: the light load again.

``slots`` is the capacity the app reports itself (GetLoad: slots of every replica).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator
from unittest import mock

from benchmarks.autoscale_load import Clients, Outcome
from benchmarks.metrics import percentiles

PROMPT_LEN = 12  # autoscale_load.Clients' default prompt length
JOIN_TIMEOUT_S = 300.0
TICK_S = 0.5


@dataclass(frozen=True)
class SoakPlan:
    seconds: float = 60.0
    """Length of the overload phase."""
    factor: float = 5.0
    """Overload clients = factor x slots."""
    max_tokens: int = 32
    warmup_s: float = 3.0
    baseline_s: float = 10.0
    """Length of each baseline phase (full, light); 0 skips them."""
    recovery_s: float = 10.0
    light_share: float = 0.25
    retry_wait_s: float = 0.05
    """A shed client waits this long before its next request (it honours the retry hint)."""

    def phases(self, slots: int) -> list[tuple[str, int, float]]:
        """(name, clients, seconds) in order; phases of 0 seconds are left out."""
        light = max(1, round(slots * self.light_share))
        plan = [("warm-up", slots, self.warmup_s), ("full", slots, self.baseline_s),
                ("light", light, self.baseline_s), ("overload", math.ceil(self.factor * slots), self.seconds),
                ("recovery", light, self.recovery_s)]
        return [p for p in plan if p[2] > 0]


@dataclass
class Phase:
    name: str
    clients: int
    start: float
    """time.time() when its clients started."""
    stop: float = 0.0
    """When they were told to stop (requests in flight still finish)."""
    end: float = 0.0
    """When the last of them had returned."""
    outcomes: list[Outcome] = field(default_factory=list)
    group: Clients | None = field(default=None, repr=False)
    """Its clients while it runs (``in_flight``)."""


def app_args(model_dir: str, replicas: int, slots: int, max_waiting: int, max_tokens: int) -> dict:
    """The served app: fixed replicas on CPU, bounded engine queues, KV for every slot's request."""
    blocks_per_request = math.ceil((PROMPT_LEN + max_tokens) / 16) + 1
    return {"model": model_dir, "served_model_name": "tiny",
            "engine": {"device": "cpu", "dtype": "float32", "max_num_seqs": slots, "max_waiting": max_waiting,
                       "block_size": 16, "num_kv_blocks": max(64, 2 * slots * blocks_per_request),
                       "max_model_len": max(512, PROMPT_LEN + max_tokens + 1)},
            "num_replicas": replicas, "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25},
            "drain_timeout_s": 5}


@contextlib.contextmanager
def served(app: dict, num_cpus: int | None) -> Iterator[object]:
    """A local Ray + Serve running ``app`` (``autoscale.start``); yields the gRPC stub."""
    import ray
    from ray import serve

    from benchmarks.autoscale import start

    channel = None
    with mock.patch.dict(os.environ):  # put back what ``start`` sets: tests share the process
        try:
            _, stub, channel = start(app, num_cpus)
            yield stub
        finally:
            if channel is not None:
                channel.close()
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()


def load_report(stub):
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

    return stub.GetLoad(pb.GetLoadRequest(), timeout=10)


def capacity(stub, replicas: int, timeout_s: float = 120.0) -> tuple[int, list[str]]:
    """(total slots, replica ids) once all ``replicas`` report healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = load_report(stub)
        healthy = [r for r in report.replicas if r.healthy]
        if len(healthy) >= replicas:
            return sum(r.max_num_seqs for r in healthy), sorted(r.replica_id for r in healthy)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(healthy)} of {replicas} engine replicas healthy after {timeout_s:.0f} s")
        time.sleep(0.5)


def idle(stub) -> bool:
    """Every engine replica idle: nothing running or waiting, no KV block in use."""
    report = load_report(stub)
    return all(r.running == 0 and r.waiting == 0 and r.kv_blocks_used == 0 for r in report.replicas)


def where_requests_are(stub, phase: Phase) -> tuple[float, int, int, int]:
    """(time, streams the clients have open, running in engines, waiting in engines): what the
    clients have open beyond the engines' running + waiting is held in the serving path."""
    report = load_report(stub)
    return (time.time(), phase.group.in_flight if phase.group else 0,
            sum(r.running for r in report.replicas), sum(r.waiting for r in report.replicas))


def run_phase(stub, plan: SoakPlan, name: str, clients: int, seconds: float,
              tick: Callable[[Phase, float], None]) -> Phase:
    """``clients`` closed-loop streams for ``seconds``, then stopped and waited for."""
    group = Clients(stub, plan.max_tokens, prompt_len=PROMPT_LEN, retry_wait_s=plan.retry_wait_s)
    phase = Phase(name, clients, time.time(), group=group)
    group.add(clients)
    phase.outcomes = group.outcomes  # the same list: ticks see it grow
    last = phase.start
    while (left := phase.start + seconds - time.time()) > 0:
        time.sleep(min(TICK_S, left))
        now = time.time()
        tick(phase, now - last)  # may take a while (a GetLoad under overload): the phase ends on time anyway
        last = now
    phase.stop = time.time()
    group.stop()
    group.join(JOIN_TIMEOUT_S)
    phase.end = time.time()
    return phase


def soak(stub, plan: SoakPlan, slots: int, tick: Callable[[Phase, float], None] = lambda p, s: None) -> list[Phase]:
    return [run_phase(stub, plan, name, clients, seconds, tick) for name, clients, seconds in plan.phases(slots)]


def phase_figures(phase: Phase) -> dict:
    """Counts, rates and latencies of one phase; admitted = ended without an error."""
    outcomes = phase.outcomes
    admitted = [o for o in outcomes if o.error is None]
    shed = [o for o in outcomes if o.shed]
    other = [o for o in outcomes if o.error is not None and not o.shed]
    span = max(phase.stop - phase.start, 1e-9)
    return {
        "clients": phase.clients, "seconds": round(phase.stop - phase.start, 2),
        "drain_s": round(phase.end - phase.stop, 2),
        "requests": len(outcomes), "admitted": len(admitted), "shed": len(shed), "other_errors": len(other),
        "other_error_messages": sorted({o.error for o in other})[:5],
        # Admitted streams that ended early or with a token count other than asked.
        "incomplete": sum(not o.complete for o in admitted),
        "shed_with_retry_hint": sum("retry" in o.error.lower() for o in shed),
        "shed_after_tokens": sum(o.tokens > 0 for o in shed),
        "shed_message": shed[0].error if shed else None,
        "admitted_per_s": len(admitted) / span, "shed_per_s": len(shed) / span,
        "ttft_s": percentiles([o.first - o.start for o in admitted if o.first]),
        "e2e_s": percentiles([o.end - o.start for o in admitted]),
        "reject_s": percentiles([o.end - o.start for o in shed]),
    }
