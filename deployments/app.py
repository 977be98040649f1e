"""build_app: the Serve application, from a Serve config's ``args`` (see AppConfig).

    applications:
      - name: slotserve
        import_path: deployments.app:build_app
        args: {model: smollm2-135m, engine: {max_num_seqs: 8}, num_replicas: 2}

The ``Router`` ingress (gRPC + OpenAI HTTP) reaches the ``EngineReplica`` deployment over
engine links (deployments.link), choosing replicas with the slot-aware router from
``router/`` that Serve runs in its process; with ``autoscaling`` the replica count follows
slot occupancy (``router.autoscale``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ray import serve
from ray.serve import Application

from deployments.app_config import AppConfig
from deployments.frontend import FrontendConfig
from deployments.ingress import ENGINE_DEPLOYMENT, RouterIngress
from deployments.link import LINK_TOKEN_ENV, LinkTls, new_token
from deployments.replica import ServeEngineReplica
from deployments.tp_launcher import NOSET_VISIBLE_DEVICES
from router.autoscale import autoscaling_config
from router.request_router import request_router_config

INGRESS_DEPLOYMENT = "Router"
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
             "PYTHONNODEBUGRANGES": "1", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(8 << 20)}
"""Environment of every Ray process serving the app (``serve`` CLI, Helm chart, tests, benchmarks).

- ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``: Serve runs a replica's methods on a second
  event loop thread by default, so user code that blocks cannot stall Serve's own loop; ours
  never blocks (the engine steps on its own thread, long prompts are tokenized on a worker
  thread), and the hand-off between the two loops costs CPU on every streamed message.
- ``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``: the proxy and deployment handles reach replicas over
  Serve's gRPC data plane instead of Ray actor calls (one of Serve's throughput-optimized
  settings): a streamed message no longer goes through Ray's object-returning generator
  machinery, which cost the proxy and the ingress 30-50 % of their CPU per token.
- ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE=8 MiB``: what the gRPC servers in front of the ingress (Serve's
  proxy, or the ingress replica's own in HAProxy mode) accept, as ``max_body_bytes`` bounds HTTP
  bodies; Ray's default is 2 GiB. A larger message fails with RESOURCE_EXHAUSTED before it is read.
- ``PYTHONNODEBUGRANGES=1``: Python 3.11 draws a traceback's ``^^^`` markers with ``ast.parse``,
  whose AST constructor keeps its recursion count per interpreter, not per thread: two threads
  formatting a traceback at once (Serve logs a request's error while its gRPC data plane
  serializes it) can fail with "SystemError: AST constructor recursion depth mismatch", which
  then replaces the request's own error (a deadline came back as INTERNAL). Without column
  tables tracebacks have no markers and never parse.

Set for the whole cluster, not per deployment: a runtime_env would cost every replica start a
few seconds."""


def frontend_config(cfg: AppConfig) -> FrontendConfig:
    return FrontendConfig(served_model_name=cfg.model_name, model=cfg.model, max_prompt_tokens=cfg.max_prompt_tokens,
                          max_prompt_chars=cfg.max_prompt_chars, default_max_tokens=cfg.default_max_tokens,
                          request_timeout_s=cfg.request_timeout_s, api_keys=cfg.api_keys,
                          api_keys_file=cfg.api_keys_file, ingress_replicas=cfg.ingress.num_replicas)


def _autoscaling_config(cfg: AppConfig):
    """Slot occupancy, which the replicas report; Serve's own policy counts Serve calls, and
    requests on engine links make none."""
    knobs = cfg.autoscaling
    return autoscaling_config(target_occupancy=knobs.target_occupancy, scale_to_zero=knobs.min_replicas == 0,
                              slots_per_replica=cfg.engine_scheduler().max_num_seqs,
                              min_replicas=knobs.min_replicas, max_replicas=knobs.max_replicas,
                              initial_replicas=knobs.initial_replicas, upscale_delay_s=knobs.upscale_delay_s,
                              downscale_delay_s=knobs.downscale_delay_s, metrics_interval_s=knobs.metrics_interval_s,
                              look_back_period_s=knobs.look_back_period_s)


def _tensor_parallel_placement(cfg: AppConfig) -> dict[str, Any]:
    """One bundle per rank, all on one node (STRICT_PACK: the ranks share NVLink). The replica
    actor, rank 0, takes bundle 0; deployments.tp_launcher puts rank r in bundle r."""
    res = cfg.replica_resources
    bundle = {**res.resources, **{k: v for k, v in (("CPU", res.num_cpus), ("GPU", res.num_gpus)) if v > 0}}
    return {"placement_group_bundles": [dict(bundle) for _ in range(cfg.tensor_parallel_size)],
            "placement_group_strategy": "STRICT_PACK"}


def engine_deployment_options(cfg: AppConfig) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": cfg.replica_resources.num_cpus,
                              "num_gpus": cfg.replica_resources.num_gpus,
                              **({"resources": dict(cfg.replica_resources.resources)}
                                 if cfg.replica_resources.resources else {})},
        "max_ongoing_requests": cfg.engine_max_ongoing_requests(),
        # Serve drains ongoing requests within this budget, then calls __del__ (which
        # stops the engine); leave the engine a few seconds to stop before the kill.
        "graceful_shutdown_timeout_s": cfg.drain_timeout_s + 5.0,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
    }
    if cfg.tensor_parallel_size > 1:
        options.update(_tensor_parallel_placement(cfg))
        if cfg.replica_resources.num_gpus:  # every rank sees the node's GPUs (deployments.tp_launcher)
            options["ray_actor_options"]["runtime_env"] = {"env_vars": {NOSET_VISIBLE_DEVICES: "1"}}
    if cfg.autoscaling is not None:
        options["autoscaling_config"] = _autoscaling_config(cfg)
    else:
        options["num_replicas"] = cfg.num_replicas
    # The ingress routes with this router (found through router.inflight), and Serve with it too for
    # the calls it still makes (the first requests of an ingress, loads, aborts).
    options["request_router_config"] = request_router_config(period_s=cfg.routing_stats_period_s,
                                                             model_name=cfg.model_name)
    return options


def replica_engine_options(cfg: AppConfig) -> dict[str, Any]:
    """Engine options as given, plus torch threads sized to the replica's CPU share: replicas
    sharing cores must not each spin a full OpenMP team (that slows every op many-fold)."""
    options = dict(cfg.engine_options)
    if "num_threads" not in options and cfg.replica_resources.num_gpus == 0:
        options["num_threads"] = max(1, int(cfg.replica_resources.num_cpus))
    return options


def build_app(args: Mapping[str, Any] | None = None) -> Application:
    cfg = AppConfig.from_args(args)
    # A fixed token (a Secret on Kubernetes) keeps redeploys of an unchanged app from restarting
    # every replica: the token is a constructor argument, part of the deployments' version.
    link_token = os.environ.get(LINK_TOKEN_ENV) or new_token()
    link_tls = LinkTls(**cfg.engine_link_tls.model_dump()) if cfg.engine_link_tls else None
    engine = serve.deployment(ServeEngineReplica, **engine_deployment_options(cfg)).bind(
        cfg.model, replica_engine_options(cfg), drain_timeout_s=cfg.drain_timeout_s, model_name=cfg.model_name,
        link_token=link_token, link_tls=link_tls)
    # The ingress holds the client side of every stream: when the app stops it must outlast
    # the engines' drain, or Serve's default 20 s grace cuts streams the engines still serve.
    ingress = serve.deployment(RouterIngress, name=INGRESS_DEPLOYMENT, num_replicas=cfg.ingress.num_replicas,
                               ray_actor_options={"num_cpus": cfg.ingress.num_cpus,
                                                  **({"resources": dict(cfg.ingress.resources)}
                                                     if cfg.ingress.resources else {})},
                               max_ongoing_requests=cfg.ingress.max_ongoing_requests,
                               graceful_shutdown_timeout_s=cfg.drain_timeout_s + 10.0,
                               graceful_shutdown_wait_loop_s=0.5)
    return ingress.bind(engine, frontend_config(cfg), cfg.max_body_bytes, link_token, link_tls)
