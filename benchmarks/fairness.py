"""How the engine's scheduler shares service between tenants: the virtual token counter
(``engine.fairness``) against round-robin by request and against first come, first served.

``python -m benchmarks.fairness [--steps N]``: the real Scheduler and BlockManager, a stand-in for
the model (each sampled token is appended), and closed-loop tenants that each keep a number of
requests outstanding, all contending for the same slots and token budget:

- ``long``: long prompts and answers (a RAG or summarising client);
- ``short``: short chats;
- ``short-x2``: short chats again, with weight 2 (under the counter).

Reported per discipline: each tenant's share of the tokens computed, and how many steps its
requests waited for admission (median and 95th percentile). No model runs: this measures the
scheduling discipline, on any host, in seconds.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.fairness import WaitQueue
from engine.kv.block_manager import BlockManager
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler


@dataclass(frozen=True)
class Tenant:
    name: str
    prompt: int
    output: int
    outstanding: int
    weight: float = 1.0


TENANTS = (Tenant("long", 384, 96, 8), Tenant("short", 32, 32, 24), Tenant("short-x2", 32, 32, 24, weight=2.0))


class RoundRobin(WaitQueue):
    """Round-robin by request: a tenant's counter is the number of its requests admitted; no slot is
    taken back for a tenant under its share."""

    def share_victim(self, running, slots):
        return None

    def charge(self, req: Request, tokens: int) -> None:
        pass

    def pop(self) -> Request:
        req = super().pop()
        self.service[req.tenant] = self.service.get(req.tenant, 0.0) + 1.0
        return req


def simulate(discipline: str, steps: int) -> dict[str, dict]:
    blocks = BlockManager(4096, 16, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, enable_chunked_prefill=True)
    sched = Scheduler(config, blocks, 4096)
    if discipline == "round-robin":
        sched.waiting = RoundRobin()
    seq, step = itertools.count(), 0
    arrived: dict[int, int] = {}
    served = {t.name: 0 for t in TENANTS}
    waits: dict[str, list[int]] = {t.name: [] for t in TENANTS}
    by_seq: dict[int, Tenant] = {}

    def submit(tenant: Tenant) -> None:
        n = next(seq)
        prompt = list(range(100_000 * (n + 1), 100_000 * (n + 1) + tenant.prompt))
        req = Request(f"{tenant.name}-{n}", prompt, SamplingParams(max_tokens=tenant.output, ignore_eos=True), 0, n,
                      4096, 0, frozenset())
        if discipline != "fcfs":  # first come, first served: tenants unknown to the scheduler
            req.tenant, req.weight = tenant.name, tenant.weight
        arrived[n] = step
        sched.add(req)
        by_seq[n] = tenant

    for tenant in TENANTS:
        for _ in range(tenant.outstanding):
            submit(tenant)
    for step in range(steps):
        out = sched.schedule()
        for chunk in out.chunks:
            served[by_seq[chunk.request.seq_no].name] += chunk.num_tokens
            if chunk.request.request_id in out.admitted and chunk.start == chunk.cached_tokens:
                waits[by_seq[chunk.request.seq_no].name].append(step - arrived[chunk.request.seq_no])
        sched.after_step(out)
        for chunk in out.chunks:
            req = chunk.request
            if not chunk.samples:
                continue
            req.token_ids.append(1)
            if req.num_output_tokens >= req.params.max_tokens:
                sched.remove(req)
                submit(by_seq[req.seq_no])  # closed loop: the client sends its next request
    total = sum(served.values())
    return {name: {"share": served[name] / total, "wait_p50": statistics.median(waits[name] or [0]),
                   "wait_p95": _p95(waits[name])} for name in served}


def _p95(values: list[int]) -> float:
    values = sorted(values) or [0]
    return values[min(len(values) - 1, int(0.95 * len(values)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fairness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args(argv)
    print(f"{len(TENANTS)} tenants, each keeping its requests outstanding: "
          + "; ".join(f"{t.name} ({t.outstanding} x {t.prompt}+{t.output} tokens, weight {t.weight:g})"
                      for t in TENANTS))
    print("| discipline | tenant | share of tokens | admission wait p50 / p95 (steps) |")
    print("| --- | --- | ---: | ---: |")
    for discipline in ("fcfs", "round-robin", "vtc"):
        for name, row in simulate(discipline, args.steps).items():
            print(f"| {discipline} | {name} | {row['share']:.1%} | {row['wait_p50']:.0f} / {row['wait_p95']:.0f} |")


if __name__ == "__main__":
    main()
