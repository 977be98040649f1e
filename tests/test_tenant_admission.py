"""Issue 49 at the ingress: a tenant's ``max_waiting`` (deployments.admission), fair shares of a contended
ingress by weight (deployments.admission.FairShares), and autoscaling with tenants (router.autoscale):
demand held back by fairness counts, demand refused by a tenant's own quota does not."""

from __future__ import annotations

import asyncio
import contextlib
import random
from types import SimpleNamespace

import pytest

from deployments.admission import Capacity, FairShares
from deployments.errors import Overloaded, TenantLimitExceeded, Unavailable
from deployments.admission import TenantQuotas
from deployments.requests import GenerateInput
from deployments.tenants import Tenant
from tests.serving_helpers import make_frontend, run, wait_idle
from tests.test_metrics import FakeRecorder
from tests.waits import async_wait_until

CAPACITY = Capacity(running=4, waiting=4)  # limit 8; reserve 2: contended from 6 streams held


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------------- max_waiting


def test_waiting_is_capped_per_tenant_until_the_first_token_and_shared_over_ingresses():
    rec = FakeRecorder()
    quotas = TenantQuotas([Tenant("a", ("k" * 8,), max_waiting=3)], ingress_replicas=2, recorder=rec)
    first, second = quotas.admit("a", 5), quotas.admit("a", 5)  # 3 over 2 ingresses: 2 here
    with pytest.raises(TenantLimitExceeded, match=r"tenant 'a' \(this ingress's share of 2\) has 2 requests waiting "
                                                   r"for their first token, its limit \(tenants.max_waiting: 2\)") as err:
        quotas.admit("a", 5)
    assert (err.value.http_status, err.value.grpc_code, err.value.retry_after_s) == (429, "RESOURCE_EXHAUSTED", 1.0)
    first.started()
    first.started()  # every message calls it: counted once
    assert (quotas.waiting("a"), quotas.in_flight("a")) == (1, 2)
    third = quotas.admit("a", 5)  # started ones still run: they are in flight, not waiting
    first.finish(4)
    second.finish(0)  # ended before its first token (aborted, failed): no longer waiting either
    third.finish(0)
    third.finish(0)
    assert (quotas.waiting("a"), quotas.in_flight("a")) == (0, 0)
    assert ("tenant_requests", {"tenant": "a", "outcome": "waiting"}) in rec.zeros
    assert rec.values("tenant_requests", tenant="a", outcome="waiting") == [1]
    quotas.admit(None, 5).started()  # requests of no tenant: no limit, nothing counted


def test_limits_come_from_the_app_config():
    from deployments.app import AppConfig

    cfg = AppConfig.from_args({"tenants": [{"name": "a", "api_keys": ["key-aaaa-1"], "max_waiting": 16}]})
    assert Tenant.of(cfg.tenants[0]).max_waiting == 16
    with pytest.raises(Exception, match=r"tenants\.0\.max_waiting"):
        AppConfig.from_args({"tenants": [{"name": "a", "api_keys": ["key-aaaa-1"], "max_waiting": 0}]})


def _input(max_tokens: int) -> GenerateInput:
    return GenerateInput(prompt="hello", sampling={"max_tokens": max_tokens, "ignore_eos": True})


async def _drain(stream) -> None:
    async with contextlib.aclosing(stream):
        async for _ in stream:
            pass


def test_the_ingress_refuses_a_tenant_over_max_waiting_and_no_ending_leaks_a_wait(tokenizer):
    """One engine slot: the first request runs (started), the next ones wait in the engine queue.
    Waits end by a first token, a client going away, an abort, or a failing engine: none leaks."""
    tenants = (Tenant("a", ("key-of-a-1",), max_waiting=2),)

    async def main():
        fe, reps = make_frontend(tokenizer, tenants=tenants, max_num_seqs=1, max_waiting=8, step_delay_s=0.005)
        a = fe.authorize("key-of-a-1")
        running = fe.stream(await fe.prepare(_input(2000), tenant=a))
        await running.__anext__()  # its first tokens: started
        queued = [await fe.prepare(_input(4), tenant=a) for _ in range(2)]
        tasks = [asyncio.create_task(_drain(fe.stream(req))) for req in queued]
        await async_wait_until(lambda: fe.quotas.waiting("a") == 2, "two waiting")
        refused = fe.stream(await fe.prepare(_input(4), tenant=a))
        with pytest.raises(TenantLimitExceeded, match=r"tenants.max_waiting: 2"):
            await refused.__anext__()
        tasks[0].cancel()  # the client goes away while it waits
        await async_wait_until(lambda: fe.quotas.waiting("a") == 1, "a cancelled wait released")
        assert await fe.abort(queued[1].request_id)
        await async_wait_until(lambda: fe.quotas.waiting("a") == 0, "an aborted wait released")
        late = asyncio.create_task(_drain(fe.stream(await fe.prepare(_input(4), tenant=a))))
        await async_wait_until(lambda: fe.quotas.waiting("a") == 1, "waiting again")
        reps[0].engine.kill("boom")  # the engine fails both the running and the waiting request
        for task in (late, asyncio.create_task(_drain(running))):
            with pytest.raises(Unavailable):
                await task
        await asyncio.gather(*tasks, return_exceptions=True)
        assert (fe.quotas.waiting("a"), fe.quotas.in_flight("a"), fe._admission.shares.total) == (0, 0, 0)
    run(main())


def test_a_tenant_whose_requests_start_is_not_held_by_max_waiting(tokenizer):
    """Requests that got their first token are not waiting: a tenant of max_waiting 1 runs several."""
    async def main():
        fe, reps = make_frontend(tokenizer, tenants=(Tenant("a", ("key-of-a-1",), max_waiting=1),), max_num_seqs=4)
        a = fe.authorize("key-of-a-1")
        streams = [fe.stream(await fe.prepare(_input(2000), tenant=a)) for _ in range(3)]
        for stream in streams:
            await stream.__anext__()
        assert (fe.quotas.waiting("a"), fe.quotas.in_flight("a")) == (0, 3)
        for stream in streams:
            await stream.aclose()
        await wait_idle(reps)
        assert fe.quotas.in_flight("a") == 0
    run(main())


# ----------------------------------------------------------------------------- fair shares


def _fill(shares: FairShares, tenant, weight: float, n: int) -> None:
    for _ in range(n):
        assert shares.refusal(tenant, weight, CAPACITY) is None
        shares.hold(tenant, weight)


def test_a_tenant_under_its_share_gets_in_where_the_one_that_filled_the_ingress_is_refused():
    shares = FairShares()
    _fill(shares, "a", 1.0, 6)  # up to limit - reserve anyone may
    _fill(shares, "b", 1.0, 1)  # contended: b held none of its 4 (of 8, weights 1:1)
    assert shares.refusal("a", 1.0, CAPACITY) == ("tenant 'a' is over its fair share of a contended ingress: it "
                                                  "holds 6 streams, its share by weight is 4.0 of 8 (7 held); "
                                                  "retry later")
    _fill(shares, None, 1.0, 1)  # requests of no tenant: one more tenant of weight 1
    assert "its share of all the engines" in shares.refusal("b", 1.0, CAPACITY)  # the hard cap, for everyone
    for _ in range(3):
        shares.release("a")
    assert shares.refusal("a", 1.0, CAPACITY) is None  # 5 held: below the contended tail again
    assert shares.total == 5 and shares.held("a") == 3


def test_a_tenant_alone_gets_the_whole_ingress():
    for tenant in ("a", None):  # requests of no tenant too
        shares = FairShares()
        _fill(shares, tenant, 3.0, CAPACITY.limit)  # its share is all of it, whatever its weight
        assert "its share of all the engines can run or queue" in shares.refusal(tenant, 3.0, CAPACITY)
    assert Capacity(running=4, waiting=0).reserve == 0  # the reserve is queue places, never a slot


def _contend(weights: dict, rounds: int, first: str) -> dict:
    """``first`` fills the ingress alone; then every tenant asks for streams all the time (in random
    order), and a held stream, chosen at random, ends each round. The streams held at the end."""
    rng, shares = random.Random(0), FairShares()
    _fill(shares, first, weights[first], CAPACITY.limit)
    for _ in range(rounds):
        shares.release(rng.choice([t for t in weights for _ in range(shares.held(t))]))
        for tenant in rng.sample(list(weights), len(weights)):
            while shares.refusal(tenant, weights[tenant], CAPACITY) is None:
                shares.hold(tenant, weights[tenant])
    return {t: shares.held(t) for t in weights}


@pytest.mark.parametrize("first", ["light", "heavy"])
def test_weights_share_a_contended_ingress_in_proportion(first):
    assert _contend({"light": 1.0, "heavy": 3.0}, 100, first) == {"light": 2, "heavy": 6}  # 1:3 of 8
    assert _contend({"a": 1.0, "b": 1.0, None: 2.0}, 100, "a") == {"a": 2, "b": 2, None: 4}


def test_a_tenant_refused_at_the_full_ingress_gets_the_next_free_stream():
    """Refused at the hard cap, a tenant counts as contending for a while: the stream that ends next is
    kept for it, not taken back by the tenant that filled the ingress alone."""
    clock = Clock()
    shares = FairShares(clock)
    _fill(shares, "a", 1.0, CAPACITY.limit)
    assert shares.refusal("b", 1.0, CAPACITY) is not None  # full
    shares.release("a")
    assert "over its fair share" in shares.refusal("a", 1.0, CAPACITY)
    assert shares.refusal("b", 1.0, CAPACITY) is None  # b's retry gets it
    c = FairShares(clock)
    _fill(c, "a", 1.0, CAPACITY.limit)
    c.refusal("b", 1.0, CAPACITY)
    clock.now += FairShares.CONTENDING_S  # b gave up: a is alone again
    c.release("a")
    assert c.refusal("a", 1.0, CAPACITY) is None


def _hold(fe, key: str, n: int) -> list[asyncio.Task]:
    async def one():
        await _drain(fe.stream(await fe.prepare(_input(2000), tenant=fe.authorize(key))))
    return [asyncio.create_task(one()) for _ in range(n)]


def test_the_ingress_keeps_a_contended_tail_for_tenants_under_their_share(tokenizer):
    """Fake engines of 4 slots and 4 queue places: this ingress holds at most 8 streams; from 6 on only
    a tenant under its share of 8 gets in."""
    tenants = (Tenant("a", ("key-of-a-1",)), Tenant("b", ("key-of-b-1",)))

    async def main():
        fe, reps = make_frontend(tokenizer, tenants=tenants, api_keys=("plain-key-1",), max_num_seqs=4, max_waiting=4)
        held = _hold(fe, "key-of-a-1", 6)
        await async_wait_until(lambda: fe._admission.shares.held("a") == 6, "a holds 6")
        held += _hold(fe, "key-of-b-1", 1)
        await async_wait_until(lambda: fe._admission.shares.total == 7, "b got in")
        with pytest.raises(Overloaded, match="tenant 'a' is over its fair share of a contended ingress"):
            await _drain(fe.stream(await fe.prepare(_input(4), tenant=fe.authorize("key-of-a-1"))))
        held += _hold(fe, "plain-key-1", 1)  # requests of no tenant: a tenant of weight 1, under its share
        await async_wait_until(lambda: fe._admission.shares.total == 8, "no tenant got in")
        with pytest.raises(Overloaded, match="its share of all the engines"):
            await _drain(fe.stream(await fe.prepare(_input(4), tenant=fe.authorize("key-of-b-1"))))
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await wait_idle(reps)
        assert fe._admission.shares.total == 0 and fe.quotas.in_flight("a") == 0
    run(main())


def test_a_tenant_alone_fills_the_ingress(tokenizer):
    async def main():
        fe, reps = make_frontend(tokenizer, tenants=(Tenant("a", ("key-of-a-1",)),), max_num_seqs=4, max_waiting=4)
        held = _hold(fe, "key-of-a-1", 8)
        await async_wait_until(lambda: fe._admission.shares.held("a") == 8, "a alone holds 8")
        with pytest.raises(Overloaded, match="its share of all the engines"):
            await _drain(fe.stream(await fe.prepare(_input(4), tenant=fe.authorize("key-of-a-1"))))
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await wait_idle(reps)
    run(main())


# ----------------------------------------------------------------------------- autoscaling


def _policy_demand(report: dict) -> tuple[int, dict]:
    """What the Serve adapter makes of one replica's autoscaling report: (desired replicas, reason)."""
    from router.autoscale import AutoscaleConfig, decide, metrics_from_context

    ctx = SimpleNamespace(aggregated_metrics={name: {"r1": value} for name, value in report.items()})
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=16, upscale_delay_s=0.0, downscale_delay_s=0.0)
    desired, _, reason = decide(metrics_from_context(ctx), 1, cfg, {}, 0.0)
    return desired, reason


def test_requests_held_back_by_fairness_are_waiting_demand(tiny_model_dir):
    """The real scheduler: tenant a's requests that came first wait while tenant b's run (fairness).
    They are in the replica's report as waiting, so the policy scales for them."""
    from deployments.replica import EngineReplica
    from engine import LLMEngine, SamplingParams

    eng = LLMEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=128,
                                 max_num_seqs=2, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        eng.add_request([3 + i] * 6, params, request_id=f"a{i}", tenant="a")
    for i in range(2):
        eng.add_request([20 + i] * 6, params, request_id=f"b{i}", tenant="b")
    for _ in range(200):
        eng.step()
        running = {r.request_id for r in eng.scheduler.running}
        held_back = {r.request_id for r in eng.scheduler.waiting if r.tenant == "a"}  # all came before b's
        if running & {"b0", "b1"} and held_back:
            break
    else:
        raise AssertionError("b never ran ahead of a's earlier requests")
    report = EngineReplica.record_autoscaling_stats(SimpleNamespace(_engine=eng))
    waiting = {r.request_id for r in eng.scheduler.waiting}
    assert report["waiting"] == len(waiting) and held_back <= waiting and len(held_back) >= 2
    assert report["slot_occupancy"] == 1.0
    desired, reason = _policy_demand(report)
    assert reason["waiting"] == len(waiting) and desired > _policy_demand({**report, "waiting": 0.0})[0]


def test_a_request_refused_by_its_tenants_quota_is_no_demand(tokenizer):
    """Refused at the ingress before any engine call: the replica's report, and so the policy, is the same."""
    async def main():
        fe, reps = make_frontend(tokenizer, tenants=(Tenant("a", ("key-of-a-1",), max_concurrent_requests=1),),
                                 max_num_seqs=1)
        a = fe.authorize("key-of-a-1")
        held = fe.stream(await fe.prepare(_input(2000), tenant=a))
        await held.__anext__()
        before = reps[0].record_autoscaling_stats()
        sent = []
        generate = fe._engine.generate
        fe._engine.generate = lambda request: sent.append(request) or generate(request)
        with pytest.raises(TenantLimitExceeded):
            await _drain(fe.stream(await fe.prepare(_input(4), tenant=a)))
        assert sent == [] and reps[0].record_autoscaling_stats() == before
        assert _policy_demand(before) == _policy_demand(reps[0].record_autoscaling_stats())
        await held.aclose()
        await wait_idle(reps)
    run(main())
