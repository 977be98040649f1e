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

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.frontend import Frontend, FrontendConfig
from deployments.grpc_service import SlotServeGrpcMixin
from deployments.link import LinkTls
from deployments.link_client import HandleEngineClient, LinkEngineClient
from deployments.openai_api import build_openai_app
from deployments.replica import show_engine_log

ENGINE_DEPLOYMENT = "EngineReplica"


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
