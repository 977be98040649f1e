"""The continuous-batching scheduler (engine.scheduler), step by step, without a model.

Each test builds the real Scheduler over a real BlockManager with a tiny pool (see
tests/scheduler_sim.py), adds a few requests and plays the engine step by step, asserting
what was scheduled. Every step is checked against the scheduler's contract and a fake KV
cache; every test ends with the pool free again.
"""

from __future__ import annotations

import random

import pytest

from engine.kv.hashing import prefix_block_hashes, prefix_routing_keys
from engine.outputs import FINISH_ABORT
from engine.request import RequestStatus
from tests.scheduler_sim import Sim


@pytest.fixture
def make_sim():
    sims: list[Sim] = []

    def make(**kw) -> Sim:
        sims.append(Sim(**kw))
        return sims[-1]

    yield make
    for sim in sims:  # whatever the test left behind, aborting it must give every block back
        sim.check()
        for req in sim.requests.values():
            if not req.finished:
                sim.sched.abort(req)
        sim.check()
        assert not sim.sched.has_unfinished()
        assert sim.bm.num_free == sim.bm.num_blocks and not any(sim.bm.ref_counts)


# ----------------------------------------------------------------------------- continuous batching
def test_requests_join_and_leave_at_every_step(make_sim):
    sim = make_sim()
    a = sim.add(4, max_tokens=3)
    assert sim.scheduled(sim.step()) == {"r0": (0, 4)}
    assert sim.scheduled(sim.step()) == {"r0": (4, 1)}
    sim.add(3, max_tokens=3)
    out = sim.step()  # r1 joins while r0 decodes; r0 leaves right after
    assert sim.scheduled(out) == {"r0": (5, 1), "r1": (0, 3)} and out.admitted == ["r1"]
    assert a.finished and a.num_output_tokens == 3 and [r.request_id for r in sim.sched.running] == ["r1"]
    sim.add(2, max_tokens=2)
    out = sim.step()
    assert sim.scheduled(out) == {"r1": (3, 1), "r2": (0, 2)} and out.admitted == ["r2"]
    sim.drain()
    assert [r.num_output_tokens for r in sim.requests.values()] == [3, 3, 2]


def test_decodes_come_first_in_the_step(make_sim):
    sim = make_sim(max_num_batched_tokens=16)
    sim.add(3, max_tokens=5, priority=1)
    sim.step()
    sim.add(20, max_tokens=2, priority=0)
    sim.step()  # r1's first chunk
    out = sim.step()  # r1 (priority 0) sorts first among running; its prefill chunk still goes last
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 1), ("r1", 5)]


def test_chunked_prefill_splits_a_long_prompt_while_decodes_flow(make_sim):
    sim = make_sim(max_num_batched_tokens=8)
    short = sim.add(2, max_tokens=12)
    sim.step()
    long = sim.add(30, max_tokens=2)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sim.step()
        got = sim.scheduled(out)
        assert got["r0"] == (short.num_tokens - 2, 1)  # the decode ran in this step too
        chunks.append(got["r1"])
        assert ("r1" in sim.sampled) == (long.num_computed_tokens == 30)
    assert chunks == [(0, 7), (7, 7), (14, 7), (21, 7), (28, 2)]
    assert long.num_output_tokens == 1
    sim.drain()


def test_without_chunked_prefill_a_prompt_is_scheduled_whole(make_sim):
    sim = make_sim(max_num_batched_tokens=8, chunked=False, max_num_seqs=2, max_total_tokens=32)
    sim.add(20, max_tokens=3)
    sim.add(20, max_tokens=3)
    out = sim.step()  # r1 does not fit in what r0 left: it waits instead of being split
    assert sim.scheduled(out) == {"r0": (0, 20)}
    out = sim.step()
    assert sim.scheduled(out) == {"r0": (20, 1), "r1": (0, 20)}
    sim.drain()


def test_token_budget_respected_with_many_prefills(make_sim):
    sim = make_sim(max_num_batched_tokens=10, max_num_seqs=8, num_blocks=64)
    for n in (9, 3, 17, 1, 25, 6, 4, 12):
        sim.add(n, max_tokens=3)
    outs = sim.drain()
    assert max(o.num_batched_tokens for o in outs) == 10  # the budget is used, never exceeded
    assert all(r.num_output_tokens == 3 for r in sim.requests.values())


def test_max_num_seqs_bounds_the_running_set(make_sim):
    sim = make_sim(max_num_seqs=2)
    for _ in range(5):
        sim.add(3, max_tokens=3)
    outs = sim.drain()
    admitted = [rid for o in outs for rid in o.admitted]
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]
    assert outs[0].admitted == ["r0", "r1"]
    assert max(len(o.chunks) for o in outs) == 2
    # A slot is refilled in the step right after its request finished.
    assert outs[3].admitted == ["r2", "r3"]


# ----------------------------------------------------------------------------- preemption
def test_preemption_picks_the_lowest_priority_and_recomputes_it(make_sim):
    sim = make_sim(num_blocks=4, block_size=2, prefix=False)
    a = sim.add(2, max_tokens=4, priority=0)
    b = sim.add(6, max_tokens=4, priority=1)
    assert sim.step().admitted == ["r0", "r1"] and sim.bm.num_free == 0
    tokens_before = list(b.token_ids)
    out = sim.step()  # r0 needs a second block: r1 gives way, lower priority though further ahead
    assert out.preempted == ["r1"] and sim.scheduled(out) == {"r0": (2, 1)}
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.token_ids == tokens_before and b.num_output_tokens == 1
    assert b.timing.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert sim.sched.num_waiting == 1
    outs = sim.drain()
    readmit = next(o for o in outs if "r1" in o.admitted)
    assert sim.scheduled(readmit)["r1"] == (0, 7)  # prompt and the output so far, computed again
    assert a.num_output_tokens == 4 and b.num_tokens == sim.max_total_tokens  # r1 ran into the pool's size
    assert b.token_ids[:7] == tokens_before and b.timing.num_preemptions == 1


def test_preemption_victim_is_the_least_advanced_within_a_priority(make_sim):
    sim = make_sim(num_blocks=7, block_size=2, prefix=False)
    a, b, c = sim.add(6), sim.add(3), sim.add(4)
    sim.step()
    assert sim.bm.num_free == 0 and (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (6, 3, 4)
    out = sim.step()  # r0 needs a block; r1 has done the least work
    assert out.preempted == ["r1"] and sim.scheduled(out) == {"r0": (6, 1), "r2": (4, 1)}
    assert b.timing.num_preemptions == 1 and a.timing.num_preemptions == c.timing.num_preemptions == 0
    sim.drain()


def test_a_step_that_preempts_admits_nothing(make_sim):
    sim = make_sim(num_blocks=4, block_size=2, prefix=False)
    sim.add(4, max_tokens=4, priority=0)
    sim.add(4, max_tokens=4, priority=1)
    sim.step()
    small = sim.add(1, max_tokens=1, priority=0)
    out = sim.step()
    assert out.preempted == ["r1"] and out.admitted == []
    assert sim.bm.num_free >= 1  # r2 would have fitted
    assert sim.step().admitted == ["r2"] and small.finished
    sim.drain()


def test_preempted_request_reuses_its_own_cached_prefix(make_sim):
    sim = make_sim(num_blocks=4, block_size=2, prefix=True)
    sim.add(4, max_tokens=3, priority=0)  # takes only one of r1's two freed blocks
    b = sim.add(4, max_tokens=4, priority=1)
    sim.step()
    assert sim.step().preempted == ["r1"]
    hits = sim.bm.prefix_hits
    outs = sim.drain()
    readmit = next(o for o in outs if "r1" in o.admitted)
    start, n = sim.scheduled(readmit)["r1"]
    assert (start, n) == (2, 3)  # r1's first block outlived the preemption in the cache
    assert b.num_cached_tokens == 0 and sim.bm.prefix_hits == hits  # counted at first admission only


# ----------------------------------------------------------------------------- priorities
def test_lower_priority_value_is_admitted_first_then_fcfs(make_sim):
    sim = make_sim(max_num_seqs=1)
    for prio in (5, 0, 1, 0, 5):
        sim.add(2, max_tokens=1, priority=prio)
    admitted = [rid for o in sim.drain() for rid in o.admitted]
    assert admitted == ["r1", "r3", "r2", "r0", "r4"]


def test_head_of_line_request_is_not_overtaken_when_it_does_not_fit(make_sim):
    sim = make_sim(num_blocks=4, block_size=2, max_num_seqs=4)
    sim.add(5, max_tokens=2)
    sim.step()
    sim.add(3, max_tokens=1)   # needs 2 blocks, 1 is free
    sim.add(1, max_tokens=1)   # would fit, but must not jump the queue
    out = sim.step()
    assert out.admitted == []
    assert [rid for o in sim.drain() for rid in o.admitted] == ["r1", "r2"]


# ----------------------------------------------------------------------------- aborts
def test_abort_of_a_waiting_request(make_sim):
    sim = make_sim(max_num_seqs=1)
    sim.add(3, max_tokens=3)
    b = sim.add(3, max_tokens=3)
    sim.step()
    sim.abort(b)
    assert b.finished and b.finish_reason == FINISH_ABORT and sim.sched.num_waiting == 0
    assert all("r1" not in sim.scheduled(o) for o in sim.drain())


def test_abort_of_a_running_request_frees_its_blocks_at_once(make_sim):
    sim = make_sim(prefix=False)
    a = sim.add(9, max_tokens=10)
    sim.step()
    assert sim.bm.num_used == 3
    sim.abort(a)
    assert a.finished and a.block_ids == [] and sim.bm.num_free == sim.bm.num_blocks
    assert not sim.sched.has_unfinished() and sim.step().empty


def test_abort_of_a_preempted_request(make_sim):
    sim = make_sim(num_blocks=4, block_size=2)
    sim.add(4, max_tokens=4, priority=0)
    b = sim.add(4, max_tokens=4, priority=1)
    sim.step()
    sim.step()
    assert b.status is RequestStatus.PREEMPTED
    sim.abort(b)
    assert b.finished and sim.sched.num_waiting == 0
    assert all("r1" not in o.admitted for o in sim.drain())


# ----------------------------------------------------------------------------- static batching
def test_static_mode_forms_a_new_batch_only_when_the_last_one_drained(make_sim):
    sim = make_sim(max_num_seqs=2, scheduling="static")
    sim.add(3, max_tokens=5)
    sim.add(3, max_tokens=1)
    sim.add(3, max_tokens=1)
    outs = [sim.step()]
    assert outs[0].admitted == ["r0", "r1"]
    sim.add(2, max_tokens=1)
    while not sim.requests["r0"].finished:
        outs.append(sim.step())
        assert outs[-1].admitted == [] and set(sim.scheduled(outs[-1])) == {"r0"}
    assert sim.step().admitted == ["r2", "r3"]
    sim.drain()


def test_static_mode_readmits_a_preempted_member_before_later_ones(make_sim):
    sim = make_sim(num_blocks=4, block_size=2, max_num_seqs=3, scheduling="static")
    sim.add(2, max_tokens=4, priority=0)
    sim.add(4, max_tokens=3, priority=1)
    sim.add(3, max_tokens=1, priority=1)  # in the batch, no room for it yet
    assert sim.step().admitted == ["r0", "r1"]
    assert sim.step().preempted == ["r1"]
    admitted = [rid for o in sim.drain() for rid in o.admitted]
    assert admitted == ["r1", "r2"]  # arrival order within the batch, though r2 would fit first


def test_continuous_mode_refills_the_slot_at_once(make_sim):
    sim = make_sim(max_num_seqs=2)
    sim.add(3, max_tokens=5)
    sim.add(3, max_tokens=1)
    sim.add(3, max_tokens=1)
    assert sim.step().admitted == ["r0", "r1"]
    assert sim.step().admitted == ["r2"]
    sim.drain()


def test_abort_inside_a_static_batch(make_sim):
    sim = make_sim(max_num_seqs=2, scheduling="static", max_num_batched_tokens=4)
    sim.add(4, max_tokens=2)
    b = sim.add(4, max_tokens=2)  # in the batch, but the budget holds it back a step
    assert sim.step().admitted == ["r0"] and sim.sched.num_waiting == 1
    sim.abort(b)
    assert sim.sched.num_waiting == 0
    sim.drain()


# ----------------------------------------------------------------------------- prefix cache
def test_prefix_hit_at_admission_skips_the_cached_tokens(make_sim):
    sim = make_sim(block_size=4)
    a = sim.add(list(range(10)), max_tokens=3)
    sim.step()
    b = sim.add(list(range(8)) + [50, 51, 52], max_tokens=2)
    out = sim.step()  # while r0 still runs: the blocks are shared
    assert sim.scheduled(out)["r1"] == (8, 3) and b.num_cached_tokens == 8
    assert [sim.bm.ref_counts[x] for x in b.block_ids[:2]] == [2, 2]
    assert (sim.bm.prefix_queries, sim.bm.prefix_hits) == (21, 8)
    sim.drain()
    # Blocks computed after a hit are published under the full chain (what the router computes).
    assert set(prefix_block_hashes(b.token_ids[:12], 4)) <= set(sim.bm.hash_to_block)
    assert set(prefix_routing_keys(b.token_ids[:12], 4)) <= set(sim.bm.recent_routing_keys(100))
    full = sim.add(a.token_ids[:12] + [99], max_tokens=1)  # a's output tokens were cached too
    assert sim.scheduled(sim.step())["r2"] == (12, 1) and full.num_cached_tokens == 12
    again = sim.add(list(range(8)), max_tokens=1)  # fully cached: the last block is recomputed
    assert sim.scheduled(sim.step())["r3"] == (4, 4) and again.num_cached_tokens == 4


def test_disabled_prefix_cache_computes_everything(make_sim):
    sim = make_sim(prefix=False)
    sim.add(list(range(10)), max_tokens=1)
    sim.drain()
    b = sim.add(list(range(10)), max_tokens=1)
    assert sim.scheduled(sim.step())["r1"] == (0, 10) and b.num_cached_tokens == 0
    assert sim.bm.prefix_hits == 0


# ----------------------------------------------------------------------------- decodes keep flowing


def test_a_recomputed_request_does_not_starve_running_decodes(make_sim):
    sim = make_sim(num_blocks=8, block_size=2, max_num_seqs=2, max_num_batched_tokens=3, prefix=False)
    sim.add(2, max_tokens=8)
    late = sim.add(8, max_tokens=4)
    for _ in range(5):
        sim.step()
    assert sim.step().preempted == ["r0"]  # r0 has done less work than r1
    assert sim.step().admitted == ["r0"]   # back, to recompute 7 tokens with a budget of 3
    out = sim.step()
    assert late.num_computed_tokens == late.num_tokens - 1 and late.request_id in sim.scheduled(out), \
        f"r1's decode was skipped: {sim.scheduled(out)}"
    sim.drain()


def test_a_higher_priority_prefill_does_not_starve_running_decodes(make_sim):
    sim = make_sim(max_num_batched_tokens=8, max_num_seqs=2)
    dec = sim.add(2, max_tokens=10, priority=1)
    sim.step()
    sim.add(40, max_tokens=1, priority=0)
    for _ in range(6):
        out = sim.step()
        assert dec.request_id in sim.scheduled(out), f"decode skipped: {sim.scheduled(out)}"
    sim.drain()


# ----------------------------------------------------------------------------- randomized workloads
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunked, prefix, scheduling", [
    (True, True, "continuous"), (True, False, "continuous"), (False, True, "continuous"),
    (True, True, "static"), (False, False, "static"),
])
def test_random_workload_keeps_every_invariant(make_sim, seed, chunked, prefix, scheduling):
    rng = random.Random(seed)
    sim = make_sim(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
                   chunked=chunked, prefix=prefix, scheduling=scheduling)
    shared = [rng.randrange(100) for _ in range(16)]  # a common system prompt for prefix hits
    aborted = set()
    for step in range(400):
        if step < 60 and rng.random() < 0.4:
            n = rng.randint(1, 30)
            prompt = shared[:rng.choice((0, 4, 8, 16))][:n] + [rng.randrange(100) for _ in range(n)]
            sim.add(prompt[:40], max_tokens=rng.randint(1, 10), priority=rng.randint(0, 2))
        live = [r for r in sim.requests.values() if not r.finished]
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            sim.abort(victim)
            aborted.add(victim.request_id)
        if step >= 60 and not sim.sched.has_unfinished():
            break
        out = sim.step()
        assert not out.empty or not sim.sched.has_unfinished()
    assert not sim.sched.has_unfinished()
    assert sim.sched.num_preemptions > 0 and (sim.bm.prefix_hits > 0) == prefix  # both paths exercised
    for req in sim.requests.values():
        if req.request_id not in aborted:
            want = min(req.params.max_tokens, sim.max_total_tokens - req.num_prompt_tokens)
            assert req.num_output_tokens == want, req
