"""The Router ingress deployment: gRPC methods + the OpenAI HTTP API over one Frontend.

One class serves both protocols: Serve's gRPC proxy calls the RPC-named methods
(``grpc_service.SlotServeGrpcMixin``), its HTTP proxy the FastAPI app built at replica
start (``__serve_build_asgi_app__``). Requests reach engine replicas over engine links
(deployments.link), to the replica the slot-aware router picks; a DeploymentHandle of the
EngineReplica deployment carries the rest (model info, loads, aborts, and an ingress's first
requests before its router has heard from any replica).
"""

from __future__ import annotations

import asyncio
import functools
import logging

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.frontend import Frontend, FrontendConfig
from deployments.grpc_service import SlotServeGrpcMixin
from deployments.link import LinkTls, LinkTransport
from deployments.mux import MuxEngineClient
from deployments.openai_api import build_openai_app
from router import inflight

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineReplica"
LOAD_CALL_TIMEOUT_S = 5.0


class HandleEngineClient:
    """What goes through Serve: ``deployments.link.LinkTransport``'s ``serve``."""

    def __init__(self, handle: DeploymentHandle, app_name: str, deployment_name: str = ENGINE_DEPLOYMENT) -> None:
        self._handle = handle
        self._app_name = app_name
        self._deployment_name = deployment_name

    async def model_info(self) -> dict:
        return await self._handle.model_info.remote()

    async def replica_loads(self) -> list[dict]:
        """Routing stats of every replica, asked of each replica actor directly.

        A handle call reaches one replica chosen by the router, so it cannot collect
        them all; Serve names replica actors ``SERVE_REPLICA::<app>#<deployment>#<id>``
        in the "serve" namespace, and their ``record_routing_stats`` calls ours.
        """
        actors = await asyncio.to_thread(self._replica_actors)  # GCS lookups block: keep them off the loop
        return list(await asyncio.gather(*(self._replica_stats(rid, actor) for rid, actor in actors)))

    async def abort(self, request_id: str) -> bool:
        """Asks every replica: one call each, pinned to it by the slot-aware router (with Serve's
        default router the calls land where they may, so only some replicas are asked)."""
        actors = await asyncio.to_thread(self._replica_actors)
        # One at a time: handle calls made while serving one request share its internal request id,
        # and Serve's router (2.60) indexes pending calls by it, so a second concurrent call is
        # never matched to the replica chosen for it and hangs.
        for rid, _ in actors:
            try:
                if await self._handle.abort.remote({"request_id": request_id, "replica_id": rid}) is True:
                    return True
            except Exception as exc:  # noqa: BLE001 - a replica going away: ask the others
                logger.info("abort on replica %s failed: %s", rid, exc)
        return False

    async def submit_linked(self, request: dict) -> tuple[str, str]:
        return await self._handle.submit_linked.remote(request)

    async def abort_on(self, request_id: str, replica_id: str) -> bool:
        return await self._handle.abort.remote({"request_id": request_id, "replica_id": replica_id})

    def _replica_actors(self) -> list[tuple[str, object]]:
        import ray

        prefix = f"SERVE_REPLICA::{self._app_name}#{self._deployment_name}#"
        actors = []
        for entry in sorted(ray.util.list_named_actors(all_namespaces=True), key=lambda a: a["name"]):
            if entry.get("namespace") != "serve" or not entry["name"].startswith(prefix):
                continue
            try:
                actors.append((entry["name"][len(prefix):], ray.get_actor(entry["name"], namespace="serve")))
            except ValueError:  # gone between listing and lookup
                continue
        return actors

    async def _replica_stats(self, replica_id: str, actor) -> dict:
        try:
            async with asyncio.timeout(LOAD_CALL_TIMEOUT_S):
                stats = await actor.record_routing_stats.remote()
        except Exception as exc:  # starting, stopping or dead: report it, unhealthy
            logger.info("load of replica %s unavailable: %s", replica_id, exc)
            return {"replica_id": replica_id, "healthy": False}
        return stats or {"replica_id": replica_id, "healthy": False}


@serve.ingress()
class RouterIngress(SlotServeGrpcMixin):
    def __init__(self, engine: DeploymentHandle, frontend_config: FrontendConfig, max_body_bytes: int,
                 link_token: str, link_tls: LinkTls | None = None) -> None:
        """``link_token`` (and ``link_tls``): what the engine replicas' links ask (deployments.link)."""
        from engine.models_hub import resolve_model
        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(frontend_config.model))
        app_name = serve.get_replica_context().app_name
        choose = functools.partial(inflight.choose, f"{app_name}#{ENGINE_DEPLOYMENT}")
        transport = LinkTransport(HandleEngineClient(engine, app_name), link_token, choose, tls=link_tls)
        self.frontend = Frontend(frontend_config, tokenizer,
                                 MuxEngineClient(transport, on_done=inflight.request_finished))
        self._max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.frontend, self._max_body_bytes)
