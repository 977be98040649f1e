"""Each tenant's limits at the ingress (deployments.admission): requests in flight and tokens per
minute, shared over ingress replicas, refused with 429 and retry-after naming the limit, counted
per tenant in the metrics; other tenants and requests of no tenant are not held back."""

from __future__ import annotations

import contextlib

import openai
import pytest

from deployments.admission import Capacity
from deployments.app import AppConfig
from deployments.contract import EngineMessage
from deployments.engine_client import LocalEngineClient
from deployments.errors import Overloaded, TenantLimitExceeded
from deployments.frontend import Frontend, FrontendConfig
from deployments.admission import TenantQuotas
from deployments.replica import EngineReplica
from deployments.requests import GenerateInput
from deployments.tenants import Tenant
from tests.fake_engine import FakeAsyncEngine
from tests.serving_helpers import frontend_over, real_replica, run
from tests.test_metrics import FakeRecorder
from tests.test_serving_frontend import _clients


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_in_flight_are_capped_per_tenant_and_shared_over_ingresses():
    quotas = TenantQuotas([Tenant("a", ("k" * 8,), max_concurrent_requests=3), Tenant("b", ("j" * 8,))],
                          ingress_replicas=2)
    held = [quotas.admit("a", 10), quotas.admit("a", 10)]  # 3 over 2 ingresses: 2 here
    with pytest.raises(TenantLimitExceeded, match=r"tenant 'a' \(this ingress's share of 2\) has 2 requests in "
                                                   r"flight, its limit \(tenants.max_concurrent_requests: 2\)"):
        quotas.admit("a", 10)
    for _ in range(5):  # no limit for b, none for requests of no tenant
        quotas.admit("b", 10), quotas.admit(None, 10)
    held[0].finish(3)
    held[0].finish(3)  # a ticket ends once
    assert quotas.in_flight("a") == 1
    quotas.admit("a", 10)


def test_tokens_per_minute_are_a_bucket_that_a_request_may_overdraw():
    clock, rec = Clock(), FakeRecorder()
    quotas = TenantQuotas([Tenant("a", ("k" * 8,), max_tokens_per_minute=600)], recorder=rec, clock=clock)
    quotas.admit("a", 500).finish(200)  # 700 of 600: 100 owed
    with pytest.raises(TenantLimitExceeded, match=r"max_tokens_per_minute: 600\); retry in 11 s") as err:
        quotas.admit("a", 1)
    assert err.value.retry_after_s == 11 and err.value.http_status == 429
    clock.now += 10  # 100 refilled: the debt is paid, nothing left
    with pytest.raises(TenantLimitExceeded):
        quotas.admit("a", 1)
    clock.now += 1
    quotas.admit("a", 5).finish(0)
    clock.now += 3600  # the bucket holds a minute's worth, no more
    quotas.admit("a", 600).finish(0)
    with pytest.raises(TenantLimitExceeded):
        quotas.admit("a", 1)
    assert {t["outcome"] for n, t in rec.zeros if n == "tenant_requests"} == {"admitted", "concurrency", "tokens",
                                                                              "overloaded", "waiting"}
    assert sum(rec.values("tenant_requests", tenant="a", outcome="tokens")) == 3
    assert sum(rec.values("tenant_tokens", tenant="a", kind="prompt")) == 1105
    assert sum(rec.values("tenant_tokens", tenant="a", kind="output")) == 200
    assert rec.values("tenant_requests_in_flight", tenant="a")[-1] == 0


def _message(token_ids: list[int], queue_time_s: float | None = None) -> EngineMessage:
    return EngineMessage(token_ids, None, None, 10, len(token_ids), 0, choices_running=1, queue_time_s=queue_time_s)


def test_a_tickets_latencies_are_recorded_once_per_request_and_only_for_a_tenant():
    rec = FakeRecorder()
    quotas = TenantQuotas([Tenant("a", ("k" * 8,))], recorder=rec)
    for tenant in ("a", None):
        ticket = quotas.admit(tenant, 10, arrival=100.0)
        ticket.observe(_message([1], queue_time_s=0.25), "", now=100.5)  # its text still held back
        ticket.observe(_message([2]), "hi", now=101.0)
        ticket.observe(_message([3], queue_time_s=0.75), "!", now=102.0)  # resumed elsewhere: not again
        ticket.finish(3)
    quotas.overloaded("a"), quotas.overloaded(None)
    assert rec.values("tenant_queue_time_seconds", tenant="a") == [0.25]
    assert rec.values("tenant_time_to_first_token_seconds", tenant="a") == [1.0]
    assert rec.values("tenant_requests", tenant="a", outcome="overloaded") == [1]
    assert all(t.get("tenant") == "a" for _, _, t in rec.calls)  # nothing for the request of no tenant


def test_the_ingress_records_a_tenants_latencies_and_capacity_refusals(tokenizer, monkeypatch):
    rec = FakeRecorder()
    monkeypatch.setattr("deployments.frontend.recorder_for", lambda name: rec)

    async def main():
        replica = EngineReplica("fake-model", {"vocab_size": tokenizer.vocab_size, "step_delay_s": 0.001},
                                FakeAsyncEngine, drain_timeout_s=1)
        fe = Frontend(FrontendConfig(served_model_name="tiny", model="fake-model", api_keys=("plain-key-1",),
                                     tenants=(Tenant("a", ("key-of-a-1",)),)), tokenizer, LocalEngineClient([replica]))
        inp = GenerateInput(prompt="hello", sampling={"max_tokens": 8, "ignore_eos": True})
        for key in ("key-of-a-1", "plain-key-1"):
            text, _ = await fe.generate_all(await fe.prepare(inp, tenant=fe.authorize(key)))
            assert text  # a first text to time
        fe._admission.capacity = _no_room
        for key in ("key-of-a-1", "plain-key-1"):
            with pytest.raises(Overloaded):
                await fe.generate_all(await fe.prepare(inp, tenant=fe.authorize(key)))
        await replica.shutdown()
    run(main(), timeout_s=30)
    [ttft] = rec.values("tenant_time_to_first_token_seconds", tenant="a")
    [queued] = rec.values("tenant_queue_time_seconds", tenant="a")
    assert 0 <= queued < ttft < 30
    assert rec.values("tenant_requests", tenant="a", outcome="overloaded") == [1]
    assert rec.values("tenant_requests", tenant="a", outcome="admitted") == [1]
    assert {t.get("tenant") for n, _, t in rec.calls if n.startswith("tenant_")} == {"a"}  # none of no tenant


async def _no_room() -> Capacity:
    return Capacity(running=0, waiting=0)


def test_limits_are_app_config_fields_checked_by_name():
    cfg = AppConfig.from_args({"tenants": [{"name": "a", "api_keys": ["key-aaaa-1"], "max_concurrent_requests": 4,
                                            "max_tokens_per_minute": 10_000}]})
    assert (cfg.tenants[0].max_concurrent_requests, cfg.tenants[0].max_tokens_per_minute) == (4, 10_000)
    with pytest.raises(Exception, match=r"tenants\.0\.max_tokens_per_minute"):
        AppConfig.from_args({"tenants": [{"name": "a", "api_keys": ["key-aaaa-1"], "max_tokens_per_minute": 0}]})


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    return real_replica(tiny_model_dir)


def test_the_ingress_refuses_a_tenant_over_its_limits_and_serves_the_others(replica, tiny_model_dir, tokenizer):
    tenants = (Tenant("capped", ("key-capped",), max_concurrent_requests=1, max_tokens_per_minute=60),
               Tenant("free", ("key-free-1",)))
    fe = frontend_over(replica, tiny_model_dir, tokenizer, tenants=tenants)

    async def main():
        from deployments.openai_api import build_openai_app

        capped = fe.authorize("Bearer key-capped")
        held = fe.stream(await fe.prepare(GenerateInput(prompt="hello", sampling={"max_tokens": 8}), tenant=capped))
        async with contextlib.aclosing(held):
            await held.__anext__()  # in flight: its ticket is held
            second = fe.stream(await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 2}), tenant=capped))
            with pytest.raises(TenantLimitExceeded, match="max_concurrent_requests: 1"):
                await second.__anext__()
            _, deltas = await fe.generate_all(await fe.prepare(GenerateInput(prompt="hi", sampling={"max_tokens": 2}),
                                                               tenant=fe.authorize("Bearer key-free-1")))
            assert deltas[-1].usage.completion_tokens == 2
        app = build_openai_app(fe)
        client, http = _clients(app, api_key="key-capped")
        done = await client.completions.create(model="tiny", prompt="hello there", max_tokens=60, temperature=0)
        assert done.usage.completion_tokens == 60  # 60 tokens a minute, and more owed: the next waits
        with pytest.raises(openai.RateLimitError) as err:
            await client.completions.create(model="tiny", prompt="again", max_tokens=2)
        assert err.value.code == "tenant_limit_exceeded" and "max_tokens_per_minute: 60" in err.value.message
        assert int(err.value.response.headers["retry-after"]) > 1
        free, free_http = _clients(app, api_key="key-free-1")
        assert (await free.completions.create(model="tiny", prompt="again", max_tokens=2)).usage.completion_tokens == 2
        # The engine charged each tenant's service to its name, by its weight (engine.fairness).
        assert {"capped", "free"} <= set(replica.engine.engine.scheduler.waiting.service)
        await http.aclose()
        await free_http.aclose()
    run(main(), timeout_s=120)
