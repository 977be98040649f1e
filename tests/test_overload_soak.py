"""A short overload soak on a local Ray: 5x capacity sheds with RESOURCE_EXHAUSTED, nothing else fails.

The benchmark's own code path (``benchmarks.overload_load``) at a small scale: 2 engine
replicas of 2 slots and a queue of 2 each (capacity 4 slots), 20 closed-loop gRPC clients
for 8 s, then a light load. Latency and memory are the benchmark's business
(``python -m benchmarks.overload``): CI machines differ too much to assert on them.
"""

from __future__ import annotations

import pytest

from benchmarks.overload_load import SoakPlan, app_args, capacity, idle, phase_figures, served, soak
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

REPLICAS, SLOTS, MAX_WAITING, MAX_TOKENS = 2, 2, 2, 16
PLAN = SoakPlan(seconds=8.0, factor=5.0, max_tokens=MAX_TOKENS, warmup_s=1.0, baseline_s=0.0, recovery_s=3.0,
                light_share=0.5, retry_wait_s=0.05)


def test_overload_sheds_with_retry_hint_and_recovers(tiny_model_dir):
    app = app_args(str(tiny_model_dir), REPLICAS, SLOTS, MAX_WAITING, MAX_TOKENS)
    with served(app, num_cpus=2) as stub:
        slots, before = capacity(stub, REPLICAS)
        assert slots == REPLICAS * SLOTS
        phases = {p.name: p for p in soak(stub, PLAN, slots)}
        # Every admitted stream has ended; the engines must let go of every slot and KV block.
        wait_until(lambda: idle(stub), "engines idle with no KV block in use", timeout_s=30, poll_s=0.2)
        assert capacity(stub, REPLICAS)[1] == before, "an engine replica was replaced during the soak"

    overload = phases["overload"]
    assert overload.clients == 5 * slots
    figures = phase_figures(overload)
    assert figures["shed"] > 0, f"5x capacity shed nothing: {figures}"
    shed = [o for o in overload.outcomes if o.shed]
    # Refused up front, before any token, with a hint to retry.
    assert all(o.tokens == 0 and "retry" in o.error.lower() for o in shed), {o.error for o in shed}

    outcomes = [o for p in phases.values() for o in p.outcomes]
    assert [o.error for o in outcomes if o.error is not None and not o.shed] == []
    admitted = [o for o in outcomes if o.error is None]
    assert admitted and all(o.complete for o in admitted), \
        [(o.tokens, o.completion_tokens, o.finish_reason) for o in admitted if not o.complete][:5]

    recovery = phases["recovery"].outcomes
    assert recovery and all(o.complete for o in recovery), [o.error for o in recovery if not o.complete][:5]
