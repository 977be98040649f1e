"""AppConfig: the typed, validated ``args`` of the Serve application (``build_app``).

Built from the plain dict under ``applications[].args`` in a Serve config file. A
pydantic model: every key is known or rejected by name, every value checked, so a bad
config fails when the application starts, with the field named
(``autoscaling.max_replicas must be ...``).
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Annotated, Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from engine.config import EngineConfig, SchedulerConfig
from engine.validation import Float, Int, Str, field_errors

DEFAULT_MODEL = "smollm2-135m"  # engine.models_hub's built-in name, converted from the bundled GGUF
_CONFIG = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class AutoscalingKnobs(BaseModel):
    """Replica count follows slot occupancy (running / max_num_seqs, or KV usage if higher)."""

    model_config = _CONFIG

    min_replicas: Int = Field(1, ge=0)
    max_replicas: Int = Field(1, ge=1)
    initial_replicas: Int | None = None
    target_occupancy: Float = Field(0.75, gt=0, le=1)
    upscale_delay_s: Float = Field(30.0, ge=0)
    downscale_delay_s: Float = Field(600.0, ge=0)
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
    request_timeout_s: Float | None = Field(None, gt=0)
    max_body_bytes: Int = Field(8 * 1024 * 1024, ge=1)
    api_keys: tuple[Str, ...] = Field((), repr=False)
    """Strings of at least 8 characters; never shown in errors or logs."""
    api_keys_file: Str | None = Field(None, min_length=1)
    """One key per line, re-read when it changes (a mounted Kubernetes Secret rotates in place)."""

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

    @field_validator("api_keys")
    @classmethod
    def _long_keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        if any(len(k) < 8 for k in keys):
            raise ValueError("must be strings of at least 8 characters")
        return keys

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
