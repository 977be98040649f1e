"""In-process serving for tests: a Frontend over fake engine replicas, no Ray."""

from __future__ import annotations

import asyncio

from deployments.engine_client import LocalEngineClient
from deployments.frontend import Frontend, FrontendConfig
from deployments.link import new_token
from deployments.link_client import LinkEngineClient
from deployments.replica import EngineReplica
from tests.fake_engine import FakeAsyncEngine
from tests.waits import async_wait_until


def make_frontend(tokenizer, replicas=1, api_keys=(), linked=True, tenants=(), **engine_options):
    """``linked``: streams over engine links on loopback, as the ingress runs them (else in-process);
    ``tenants``: ``deployments.tenants.Tenant`` entries."""
    options = {"vocab_size": tokenizer.vocab_size, "eos_token_id": 10**6, "max_num_seqs": 4,
               "max_waiting": 4, "step_delay_s": 0.002, **engine_options}
    token = new_token() if linked else None
    reps = [EngineReplica("fake-model", options, FakeAsyncEngine, drain_timeout_s=5, link_token=token)
            for _ in range(replicas)]
    config = FrontendConfig(served_model_name="tiny", model="fake-model", api_keys=tuple(api_keys),
                            tenants=tuple(tenants))
    client = LocalEngineClient(reps)
    return Frontend(config, tokenizer, LinkEngineClient(client, token) if linked else client), reps


def real_replica(model_dir):
    """An engine replica over a real (tiny) model, in this process."""
    return EngineReplica(str(model_dir), {"dtype": "float32", "block_size": 8, "num_kv_blocks": 256,
                                          "max_num_seqs": 4}, drain_timeout_s=5)


def frontend_over(replica, model_dir, tokenizer, **config):
    """A frontend over ``replica``, serving it as "tiny"; ``config``: other FrontendConfig fields."""
    return Frontend(FrontendConfig(served_model_name="tiny", model=str(model_dir), **config), tokenizer,
                    LocalEngineClient([replica]))


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def wait_idle(reps):
    await async_wait_until(lambda: all(r.record_routing_stats()["running"] == 0 for r in reps), "slots freed")


async def wait_load(rep, running: int, waiting: int = 0):
    await async_wait_until(lambda: (rep.engine.stats().running, rep.engine.stats().waiting) == (running, waiting),
                           f"{running} running, {waiting} waiting")
