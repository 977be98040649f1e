"""The Router ingress deployment: gRPC methods + the OpenAI HTTP API over one Frontend.

One class serves both protocols: Serve's gRPC proxy calls the RPC-named methods
(``grpc_service.SlotServeGrpcMixin``), its HTTP proxy the FastAPI app built at replica
start (``__serve_build_asgi_app__``). Requests reach engine replicas over engine links
(deployments.link), to the replica the slot-aware router Serve runs in this process picks (found
in ``router.registry``), which also gives the replicas' loads; a
DeploymentHandle of the EngineReplica deployment carries the rest (model info, LoRA loads, and
which replica takes an ingress's first requests, before its router has heard from any).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.contract import EngineRequest
from deployments.frontend import Frontend, FrontendConfig
from deployments.grpc_service import SlotServeGrpcMixin
from deployments.link import LinkTls
from deployments.link_client import LinkEngineClient
from deployments.openai_api import build_openai_app
from deployments.replica import show_engine_log
from router import registry
from router.policy import RoutingStats

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineReplica"


class LinkRouter(Protocol):
    """What the ingress asks of ``router.request_router.SlotAwareRequestRouter``."""

    def choose_for_link(self, request: EngineRequest, avoid: frozenset = frozenset()) -> "tuple[str, str] | None":
        """``(replica_id, link address)`` for ``request``, not one in ``avoid``; counted as sent."""

    def request_finished(self, request_id: str) -> None:
        """A request sent with ``choose_for_link`` ended: it takes no slot any more."""

    def replica_stats(self) -> list[RoutingStats]:
        """The routing stats of every running replica, as last polled (``healthy: False`` when none yet)."""


class HandleEngineClient:
    """What goes through Serve (``link_client.LinkEngineClient``'s ``serve``), and what the router
    Serve runs in this process knows, once Serve has built it (``router.registry``)."""

    def __init__(self, handle: DeploymentHandle, deployment: str) -> None:
        self._handle = handle
        self._deployment = deployment  # "<app>#<name>"
        self._first_call: asyncio.Future | None = None

    @property
    def _router(self) -> LinkRouter | None:
        return registry.find(self._deployment)

    async def model_info(self) -> dict:
        return await self._handle.model_info.remote()

    async def replica_loads(self) -> list[RoutingStats]:
        """Every replica's routing stats, as this process's router last polled them; none before
        Serve has made that router, which a handle's first call does (started here, not awaited:
        it waits for a replica, and a health check asking for loads must not)."""
        router = self._router
        if router is None:
            if self._first_call is None or self._first_call.done():
                self._first_call = asyncio.ensure_future(self.model_info())
                self._first_call.add_done_callback(lambda f: f.cancelled() or f.exception())  # no replica yet: retried
            return []
        return router.replica_stats()

    async def manage_lora(self, name: str, path: str | None) -> int:
        """Every replica loads (or unloads) the adapter: one call each, pinned to it by the slot-aware router."""
        # One at a time: handle calls made while serving one request share its internal request id,
        # and Serve's router (2.60) indexes pending calls by it, so a second concurrent call is
        # never matched to the replica chosen for it and hangs.
        done = 0
        for stats in await self.replica_loads():
            await self._handle.manage_lora.remote({"replica_id": stats.replica_id, "lora_name": name,
                                                   "lora_path": path})
            done += 1
        return done

    async def link_address(self, request: EngineRequest) -> tuple[str, str]:
        """A replica for ``request`` and its link address, routed (and queued) by Serve."""
        return await self._handle.link_address.remote(request)

    def choose(self, request: EngineRequest, avoid: frozenset) -> tuple[str, str] | None:
        router = self._router
        return router.choose_for_link(request, avoid) if router is not None else None

    def request_finished(self, request_id: str) -> None:
        router = self._router
        if router is not None:
            router.request_finished(request_id)


@serve.ingress()
class RouterIngress(SlotServeGrpcMixin):
    def __init__(self, engine: DeploymentHandle, frontend_config: FrontendConfig, max_body_bytes: int,
                 link_token: str, link_tls: LinkTls | None = None) -> None:
        """``link_token`` (and ``link_tls``): what the engine replicas' links ask (deployments.link)."""
        from engine.models_hub import resolve_model
        from engine.tokenizer import load_tokenizer

        show_engine_log()  # a first start converts the default model here
        tokenizer = load_tokenizer(resolve_model(frontend_config.model))
        serve_side = HandleEngineClient(engine, f"{serve.get_replica_context().app_name}#{ENGINE_DEPLOYMENT}")
        client = LinkEngineClient(serve_side, link_token, serve_side.choose, tls=link_tls,
                                  on_done=serve_side.request_finished)
        self.frontend = Frontend(frontend_config, tokenizer, client)
        self._max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.frontend, self._max_body_bytes)
