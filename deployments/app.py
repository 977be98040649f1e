"""build_app: the Serve application, from a Serve config's ``args``, typed and validated as ``AppConfig``.

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
from pathlib import PurePath
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from ray import serve
from ray.serve import Application

from engine.config import EngineConfig, SchedulerConfig
from engine.validation import Bool, Float, Int, Str, field_errors
from deployments.frontend import FrontendConfig
from deployments.ingress import ENGINE_DEPLOYMENT, RouterIngress
from deployments.link import LINK_TOKEN_ENV, LinkTls, new_token
from deployments.replica import ServeEngineReplica
from deployments.tenants import ApiKeys, PriorityRange, Tenant, TenantConfig, check_unique
from deployments.tp_launcher import NOSET_VISIBLE_DEVICES
from router.autoscale import DOWNSCALE_DELAY_S, UPSCALE_DELAY_S, autoscaling_config
from router.request_router import request_router_config

DEFAULT_MODEL = "smollm2-135m"  # engine.models_hub's built-in name, converted from the bundled GGUF
_CONFIG = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class AutoscalingKnobs(BaseModel):
    """Replica count follows slot occupancy (running / max_num_seqs, or KV usage if higher)."""

    model_config = _CONFIG

    min_replicas: Int = Field(1, ge=0)
    max_replicas: Int = Field(1, ge=1)
    initial_replicas: Int | None = None
    target_occupancy: Float = Field(0.75, gt=0, le=1)
    upscale_delay_s: Float = Field(UPSCALE_DELAY_S, ge=0)
    downscale_delay_s: Float = Field(DOWNSCALE_DELAY_S, ge=0)
    metrics_interval_s: Float = Field(1.0, gt=0)
    look_back_period_s: Float = 5.0

    @field_validator("max_replicas")
    @classmethod
    def _at_least_min(cls, value: int, info: ValidationInfo) -> int:
        if value < info.data.get("min_replicas", 0):
            raise ValueError(f"must be >= min_replicas ({info.data['min_replicas']})")
        return value

    @field_validator("initial_replicas")
    @classmethod
    def _within_range(cls, value: int | None, info: ValidationInfo) -> int | None:
        low, high = info.data.get("min_replicas"), info.data.get("max_replicas")
        if value is not None and low is not None and high is not None and not low <= value <= high:
            raise ValueError(f"must be in [min_replicas, max_replicas] = [{low}, {high}] or null")
        return value

    @field_validator("look_back_period_s")
    @classmethod
    def _longer_than_interval(cls, value: float, info: ValidationInfo) -> float:
        interval = info.data.get("metrics_interval_s")
        if interval is not None and value <= interval:
            raise ValueError(f"must be > metrics_interval_s ({interval})")
        return value


class ReplicaResources(BaseModel):
    """Ray resources of one engine replica: one GPU each on GPU nodes, CPUs on a laptop.
    With ``tensor_parallel_size`` N these are one rank's: a replica reserves N such bundles."""

    model_config = _CONFIG

    num_cpus: Float = Field(1.0, ge=0)
    num_gpus: Float = Field(0.0, ge=0)
    resources: dict[Str, Annotated[Float, Field(gt=0)]] = Field(default_factory=dict)
    """Custom Ray resources (``ray start --resources``), to keep engine replicas on the nodes
    that offer them: a GPU node pool, say."""


class IngressOptions(BaseModel):
    model_config = _CONFIG

    num_replicas: Int = Field(1, ge=1)
    num_cpus: Float = Field(0.5, ge=0)
    max_ongoing_requests: Int = Field(1024, ge=1)
    """Concurrent streams one ingress replica holds (Serve's default of 5 would throttle it)."""
    resources: dict[Str, Annotated[Float, Field(gt=0)]] = Field(default_factory=dict)
    """Custom Ray resources, to keep ingress replicas on the nodes that offer them (the head, or
    CPU nodes that outlive the GPU ones)."""


class LinkTlsFiles(BaseModel):
    """Mutual TLS on engine links: PEM paths present on every node (a mounted Secret on Kubernetes)."""

    model_config = _CONFIG

    certfile: Str = Field(min_length=1)
    keyfile: Str = Field(min_length=1)
    cafile: Str = Field(min_length=1)
    """The CA that signed every node's certificate: keep it for this application alone (a
    certificate it signed is the peer's identity; node IPs are not checked as names)."""


class AppConfig(BaseModel):
    model_config = _CONFIG

    model: Str = Field(DEFAULT_MODEL, min_length=1)
    """A local HF model directory or a built-in name (engine.models_hub)."""
    served_model_name: Str | None = Field(None, min_length=1)
    """The id clients use (/v1/models); default: the built-in name or the directory's name."""
    engine: dict[Str, Any] = Field(default_factory=dict)
    """Flat engine options (EngineConfig.from_options), checked here so a bad one fails now,
    not later in every replica."""
    num_replicas: Int = Field(1, ge=1)
    """Fixed replica count; leave out when ``autoscaling`` is given."""
    autoscaling: AutoscalingKnobs | None = None
    replica_resources: ReplicaResources = Field(default_factory=ReplicaResources)
    ingress: IngressOptions = Field(default_factory=IngressOptions)
    routing_stats_period_s: Float = Field(0.5, gt=0)
    """How often each engine replica reports its load to the routers (router.request_router)."""
    engine_link_tls: LinkTlsFiles | None = None
    """Encrypt engine links and authenticate both ends by certificate, besides the token."""
    max_ongoing_requests: Int | None = Field(None, ge=1)
    """Per engine replica; default max_num_seqs + max_waiting + 16, so the engine's own
    queue (and its overload error) is what bounds a replica, not Serve's."""
    drain_timeout_s: Float = Field(30.0, ge=0)
    health_check_period_s: Float = Field(5.0, gt=0)
    health_check_timeout_s: Float = Field(30.0, gt=0)
    max_prompt_tokens: Int | None = Field(None, ge=1)
    max_prompt_chars: Int = Field(2_000_000, ge=1)
    default_max_tokens: Int = Field(256, ge=1)
    tool_call_parser: Literal["hermes", "llama3_json"] = "hermes"
    """How the served model writes tool calls (vLLM's ``--tool-call-parser``): ``hermes`` for
    Hermes / Qwen / SmolLM and models given slotserve's tool prompt, ``llama3_json`` for Llama 3."""
    request_timeout_s: Float | None = Field(None, gt=0)
    allowed_priority: PriorityRange = (0, 0)
    """[lowest, highest] ``priority`` a client may send (lower is scheduled first and preempted last).
    The default [0, 0] refuses any other, as vLLM does without priority scheduling: otherwise any
    client could put itself ahead of everyone."""
    lora_load_dir: Str | None = Field(None, min_length=1)
    """LoRA adapters may be loaded at run time (``POST /v1/load_lora_adapter``) from inside this
    directory only; None: that API is off (as vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
    lora_affinity: Bool = True
    """Route an adapter request to a replica holding its adapter when its load allows (off: on load
    and cached prefix only, e.g. where adapters load fast enough not to matter)."""
    max_body_bytes: Int = Field(8 * 1024 * 1024, ge=1)
    api_keys: ApiKeys = Field((), repr=False)
    """Strings of at least 8 characters; never shown in errors or logs."""
    api_keys_file: Str | None = Field(None, min_length=1)
    """One key per line, re-read when it changes (a mounted Kubernetes Secret rotates in place)."""
    tenants: tuple[TenantConfig, ...] = Field((), repr=False)
    """Who sends a request, by its API key: each with its own keys, priority range and prefix cache
    (deployments.tenants). Keys of ``api_keys`` / ``api_keys_file`` are requests of no tenant."""

    @model_validator(mode="before")
    @classmethod
    def _replicas_or_autoscaling(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("autoscaling") is not None and "num_replicas" in data:
            raise ValueError("give num_replicas or autoscaling, not both")
        return data

    @field_validator("engine")
    @classmethod
    def _engine_options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "model" in info.data:
            EngineConfig.from_options(info.data["model"], **options)  # its ValueError names the option
        return options

    @field_validator("lora_load_dir")
    @classmethod
    def _absolute_dir(cls, path: str | None) -> str | None:
        if path is not None and (not path.startswith("/") or not path.strip("/")):
            raise ValueError("must be an absolute directory other than /")
        return path

    @field_validator("tenants")
    @classmethod
    def _unique(cls, tenants: tuple[TenantConfig, ...], info: ValidationInfo) -> tuple[TenantConfig, ...]:
        check_unique(tenants, info.data.get("api_keys", ()))
        return tenants

    @model_validator(mode="after")
    def _one_bundle_per_rank(self) -> "AppConfig":
        res = self.replica_resources
        if self.tensor_parallel_size > 1 and res.num_gpus not in (0, 1):
            raise ValueError("replica_resources.num_gpus must be 0 or 1 with tensor_parallel_size > 1 "
                             f"(it is one rank's share), got {res.num_gpus}")
        if self.tensor_parallel_size > 1 and res.num_cpus == 0 and res.num_gpus == 0:
            raise ValueError("replica_resources must be non-zero with tensor_parallel_size > 1 "
                             "(each rank reserves a bundle)")
        return self

    @property
    def engine_options(self) -> dict[str, Any]:
        return dict(self.engine)

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine_options.get("tensor_parallel_size", 1)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return PurePath(self.model.rstrip("/")).name or self.model

    def engine_scheduler(self) -> SchedulerConfig:
        return EngineConfig.from_options(self.model, **self.engine).scheduler

    def engine_max_ongoing_requests(self) -> int:
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        scheduler = self.engine_scheduler()
        return scheduler.max_num_seqs + scheduler.max_waiting + 16

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> "AppConfig":
        """From ``applications[].args``; errors name the field (``autoscaling.max_replicas ...``)."""
        if args is not None and not isinstance(args, Mapping):
            raise ValueError(f"args must be a mapping, got {type(args).__name__}")
        try:
            return cls.model_validate(dict(args or {}))
        except ValidationError as exc:
            raise ValueError("; ".join(e.message for e in field_errors(exc, cls))) from None


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
  settings): a streamed message then skips Ray's object-returning generator machinery, which
  costs the proxy and the ingress a large share of their CPU per token (docs/BENCHMARKS.md).
- ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE=8 MiB``: what the gRPC servers in front of the ingress (Serve's
  proxy, or the ingress replica's own in HAProxy mode) accept, as ``max_body_bytes`` bounds HTTP
  bodies; Ray's default is 2 GiB. A larger message fails with RESOURCE_EXHAUSTED before it is read.
- ``PYTHONNODEBUGRANGES=1``: Python 3.11 draws a traceback's ``^^^`` markers with ``ast.parse``,
  whose AST constructor keeps its recursion count per interpreter, not per thread: two threads
  formatting a traceback at once (Serve logs a request's error while its gRPC data plane
  serializes it) can fail with "SystemError: AST constructor recursion depth mismatch", which
  then replaces the request's own error (a deadline would come back as INTERNAL). Without
  column tables tracebacks have no markers and never parse.

Set for the whole cluster, not per deployment: a runtime_env would cost every replica start a
few seconds."""


def frontend_config(cfg: AppConfig) -> FrontendConfig:
    return FrontendConfig(served_model_name=cfg.model_name, model=cfg.model, max_prompt_tokens=cfg.max_prompt_tokens,
                          max_prompt_chars=cfg.max_prompt_chars, default_max_tokens=cfg.default_max_tokens,
                          request_timeout_s=cfg.request_timeout_s, api_keys=cfg.api_keys,
                          api_keys_file=cfg.api_keys_file, ingress_replicas=cfg.ingress.num_replicas,
                          tool_call_parser=cfg.tool_call_parser,
                          lora_adapters=tuple((cfg.engine.get("lora") or {}).get("adapters", {})),
                          lora_load_dir=cfg.lora_load_dir, allowed_priority=cfg.allowed_priority,
                          tenants=tuple(Tenant.of(t) for t in cfg.tenants))


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
    # The ingress routes with this router (it attaches itself to the ingress), and Serve with it too for
    # the calls it still makes (the first requests of an ingress, loads, aborts).
    options["request_router_config"] = request_router_config(
        period_s=cfg.routing_stats_period_s, model_name=cfg.model_name, lora_affinity=cfg.lora_affinity)
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
