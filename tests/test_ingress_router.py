"""The ingress's side of the slot-aware router (deployments.link_client.HandleEngineClient), without a cluster."""

from __future__ import annotations

from deployments.contract import EngineRequest
from engine.sampling import SamplingParams
from tests.test_router_ray import PROMPT, _router, _stats


def test_the_ingress_reads_loads_from_its_router_and_never_waits_for_one():
    """deployments.link_client.HandleEngineClient: before Serve made this process's router (a handle's first
    call does, and that call waits for a replica) loads are empty at once; then they are the router's."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    from deployments.link_client import HandleEngineClient

    class Handle:  # a deployment handle whose calls wait: no replica is up yet
        def __init__(self) -> None:
            self.calls = 0
            self.model_info = SimpleNamespace(remote=self._call)

        async def _call(self):
            self.calls += 1
            await asyncio.Event().wait()

    async def main():
        handle = Handle()
        client = HandleEngineClient(handle, "ingress-test#engine")
        assert await asyncio.wait_for(client.replica_loads(), 1) == []
        assert await asyncio.wait_for(client.replica_loads(), 1) == []
        await asyncio.sleep(0)
        assert handle.calls == 1  # one call under way starts the router, not one per ask
        _router(app_name="ingress-test", name="other")  # another deployment's router: not this client's
        assert await client.replica_loads() == []
        router = _router(app_name="ingress-test")  # Serve built this process's router for the engine
        rid = ReplicaID(unique_id="r0", deployment_id=DeploymentID(name="engine", app_name="ingress-test"))
        router._live = [SimpleNamespace(replica_id=rid, routing_stats=_stats(3))]
        (load,) = await client.replica_loads()
        assert (load.replica_id, load.running, load.healthy) == ("r0", 3, True)
        request = EngineRequest(request_id="q", prompt_token_ids=PROMPT, params=SamplingParams())
        assert client.choose(request, frozenset()) is None  # no link

    asyncio.run(main())
