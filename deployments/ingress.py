"""The Router ingress deployment: gRPC methods + the OpenAI HTTP API over one Frontend.

One class serves both protocols: Serve's gRPC proxy calls the RPC-named methods
(``grpc_service.SlotServeGrpcMixin``), its HTTP proxy the FastAPI app built at replica
start (``__serve_build_asgi_app__``). Engine calls go through a DeploymentHandle of
the EngineReplica deployment, whose request router (slot-aware by default, see
``app.build_app``) picks the replica.
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

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineReplica"
LOAD_CALL_TIMEOUT_S = 5.0


class _HandleStream:
    """One request's stream from an engine replica, over Serve's streaming handle."""

    def __init__(self, handle: DeploymentHandle, request: dict) -> None:
        self._gen = handle.options(stream=True).generate.remote(request)

    def __aiter__(self) -> "_HandleStream":
        return self

    async def __anext__(self) -> dict:
        return await self._gen.__anext__()

    def abort(self) -> None:
        self._gen.cancel()

    async def aclose(self) -> None:
        # Cancelling the call cancels the replica's generator, which aborts the engine request.
        self._gen.cancel()


class HandleEngineClient:
    def __init__(self, handle: DeploymentHandle, app_name: str, deployment_name: str = ENGINE_DEPLOYMENT) -> None:
        self._handle = handle
        self._app_name = app_name
        self._deployment_name = deployment_name

    def generate(self, request: dict) -> _HandleStream:
        return _HandleStream(self._handle, request)

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

    # -- deployments.mux transport: one subscription per engine replica, pinned by the router

    async def submit(self, request: dict) -> str:
        return await self._handle.submit.remote(request)

    async def submit_linked(self, request: dict) -> tuple[str, str]:
        return await self._handle.submit_linked.remote(request)

    def subscribe(self, replica_id: str, ingress_id: str):
        return self._handle.options(stream=True).subscribe.remote({"ingress_id": ingress_id, "replica_id": replica_id})

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
                 multiplex: bool = True, link_token: str | None = None, link_tls: LinkTls | None = None) -> None:
        """``multiplex``: one stream per engine replica (deployments.mux); it needs the slot-aware
        router, which honours the replica a call names. Off: one Serve stream per request.
        ``link_token``: that stream is an engine link (deployments.link), outside Serve's calls."""
        from engine.models_hub import resolve_model
        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(frontend_config.model))
        app_name = serve.get_replica_context().app_name
        client = HandleEngineClient(engine, app_name)
        if multiplex:
            from router import inflight
            if link_token:
                choose = functools.partial(inflight.choose, f"{app_name}#{ENGINE_DEPLOYMENT}")
                client = LinkTransport(client, link_token, choose, tls=link_tls)
            client = MuxEngineClient(client, on_done=inflight.request_finished)
        self.frontend = Frontend(frontend_config, tokenizer, client)
        self._max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.frontend, self._max_body_bytes)
