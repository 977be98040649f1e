"""AppConfig: the typed, validated ``args`` of the Serve application (``build_app``).

Built from the plain dict under ``applications[].args`` in a Serve config file. Every
key is known or rejected by name, every value checked, so a bad config fails when
the application starts, with the field named (``autoscaling.max_replicas must be ...``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Mapping

from engine.config import EngineConfig, SchedulerConfig

DEFAULT_MODEL = "smollm2-135m"  # engine.models_hub's built-in name, converted from the bundled GGUF
ROUTING_MODES = ("slot_aware", "default")
AUTOSCALING_POLICIES = ("slot_occupancy", "default")


def _check(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class AutoscalingKnobs:
    """Replica count follows slot occupancy (running / max_num_seqs, or KV usage if higher)."""

    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    target_occupancy: float = 0.75
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    metrics_interval_s: float = 1.0
    look_back_period_s: float = 5.0
    policy: str = "slot_occupancy"
    """``slot_occupancy`` (router.autoscale) or ``default`` (Serve's, on ongoing requests)."""

    def __post_init__(self) -> None:
        _check(_is_int(self.min_replicas) and self.min_replicas >= 0, "min_replicas", "an integer >= 0",
               self.min_replicas)
        _check(_is_int(self.max_replicas) and self.max_replicas >= max(1, self.min_replicas), "max_replicas",
               f"an integer >= max(1, min_replicas={self.min_replicas})", self.max_replicas)
        _check(self.initial_replicas is None or (_is_int(self.initial_replicas)
                                                 and self.min_replicas <= self.initial_replicas <= self.max_replicas),
               "initial_replicas", "an integer in [min_replicas, max_replicas] or null", self.initial_replicas)
        _check(_is_num(self.target_occupancy) and 0 < self.target_occupancy <= 1, "target_occupancy",
               "a number in (0, 1]", self.target_occupancy)
        for name in ("upscale_delay_s", "downscale_delay_s"):
            _check(_is_num(getattr(self, name)) and getattr(self, name) >= 0, name, "a number >= 0", getattr(self, name))
        _check(_is_num(self.metrics_interval_s) and self.metrics_interval_s > 0, "metrics_interval_s",
               "a number > 0", self.metrics_interval_s)
        _check(_is_num(self.look_back_period_s) and self.look_back_period_s > self.metrics_interval_s,
               "look_back_period_s", f"a number > metrics_interval_s ({self.metrics_interval_s})",
               self.look_back_period_s)
        _check(self.policy in AUTOSCALING_POLICIES, "policy", f"one of {AUTOSCALING_POLICIES}", self.policy)


@dataclass(frozen=True)
class ReplicaResources:
    """Ray resources of one engine replica: one GPU each on GPU nodes, CPUs on a laptop.
    With ``tensor_parallel_size`` N these are one rank's: a replica reserves N such bundles."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def __post_init__(self) -> None:
        _check(_is_num(self.num_cpus) and self.num_cpus >= 0, "num_cpus", "a number >= 0", self.num_cpus)
        _check(_is_num(self.num_gpus) and self.num_gpus >= 0, "num_gpus", "a number >= 0", self.num_gpus)


@dataclass(frozen=True)
class IngressOptions:
    num_replicas: int = 1
    num_cpus: float = 0.5
    max_ongoing_requests: int = 1024
    """Concurrent streams one ingress replica holds (Serve's default of 5 would throttle it)."""

    def __post_init__(self) -> None:
        _check(_is_int(self.num_replicas) and self.num_replicas >= 1, "num_replicas", "an integer >= 1",
               self.num_replicas)
        _check(_is_num(self.num_cpus) and self.num_cpus >= 0, "num_cpus", "a number >= 0", self.num_cpus)
        _check(_is_int(self.max_ongoing_requests) and self.max_ongoing_requests >= 1, "max_ongoing_requests",
               "an integer >= 1", self.max_ongoing_requests)


@dataclass(frozen=True)
class AppConfig:
    model: str = DEFAULT_MODEL
    """A local HF model directory or a built-in name (engine.models_hub)."""
    served_model_name: str | None = None
    """The id clients use (/v1/models); default: the built-in name or the directory's name."""
    engine: tuple[tuple[str, Any], ...] = ()
    """Flat engine options (EngineConfig.from_options); written as a mapping in YAML."""
    num_replicas: int = 1
    """Fixed replica count; leave out when ``autoscaling`` is given."""
    autoscaling: AutoscalingKnobs | None = None
    replica_resources: ReplicaResources = field(default_factory=ReplicaResources)
    ingress: IngressOptions = field(default_factory=IngressOptions)
    routing: str = "slot_aware"
    """``slot_aware`` (router.request_router) or ``default`` (Serve's power-of-two choices)."""
    routing_stats_period_s: float = 0.5
    max_ongoing_requests: int | None = None
    """Per engine replica; default max_num_seqs + max_waiting + 16, so the engine's own
    queue (and its overload error) is what bounds a replica, not Serve's."""
    drain_timeout_s: float = 30.0
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    max_prompt_tokens: int | None = None
    max_prompt_chars: int = 2_000_000
    default_max_tokens: int = 256
    request_timeout_s: float | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    """One key per line, re-read when it changes (a mounted Kubernetes Secret rotates in place)."""

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and bool(self.model), "model", "a non-empty path or model name", self.model)
        _check(self.served_model_name is None or (isinstance(self.served_model_name, str) and self.served_model_name),
               "served_model_name", "a non-empty string or null", self.served_model_name)
        _check(_is_int(self.num_replicas) and self.num_replicas >= 1, "num_replicas", "an integer >= 1",
               self.num_replicas)
        _check(self.routing in ROUTING_MODES, "routing", f"one of {ROUTING_MODES}", self.routing)
        for name in ("routing_stats_period_s", "health_check_period_s", "health_check_timeout_s"):
            _check(_is_num(getattr(self, name)) and getattr(self, name) > 0, name, "a number > 0", getattr(self, name))
        _check(_is_num(self.drain_timeout_s) and self.drain_timeout_s >= 0, "drain_timeout_s", "a number >= 0",
               self.drain_timeout_s)
        for name in ("max_ongoing_requests", "max_prompt_tokens"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 1), name, "an integer >= 1 or null", value)
        for name in ("max_prompt_chars", "default_max_tokens", "max_body_bytes"):
            _check(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "an integer >= 1",
                   getattr(self, name))
        _check(self.request_timeout_s is None or (_is_num(self.request_timeout_s) and self.request_timeout_s > 0),
               "request_timeout_s", "a number > 0 or null", self.request_timeout_s)
        _check(all(isinstance(k, str) and len(k) >= 8 for k in self.api_keys), "api_keys",
               "a list of strings of at least 8 characters", "[redacted]")
        _check(self.api_keys_file is None or (isinstance(self.api_keys_file, str) and self.api_keys_file),
               "api_keys_file", "a file path or null", self.api_keys_file)
        try:  # fail now, not later in every replica
            EngineConfig.from_options(self.model, **self.engine_options)
        except ValueError as exc:
            raise ValueError(f"engine: {exc}") from None
        if self.tensor_parallel_size > 1:  # one placement-group bundle per rank
            res = self.replica_resources
            _check(res.num_gpus in (0, 1), "replica_resources.num_gpus",
                   "0 or 1 with tensor_parallel_size > 1 (it is one rank's share)", res.num_gpus)
            _check(res.num_cpus > 0 or res.num_gpus > 0, "replica_resources",
                   "non-zero with tensor_parallel_size > 1 (each rank reserves a bundle)", dataclasses.asdict(res))

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
        names = {f.name for f in dataclasses.fields(SchedulerConfig)}
        return SchedulerConfig(**{k: v for k, v in self.engine if k in names})

    def engine_max_ongoing_requests(self) -> int:
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        scheduler = self.engine_scheduler()
        return scheduler.max_num_seqs + scheduler.max_waiting + 16

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> "AppConfig":
        """From ``applications[].args``; errors name the field (``autoscaling.max_replicas ...``)."""
        return _build(cls, dict(args or {}), "")


_NESTED = {"autoscaling": AutoscalingKnobs, "replica_resources": ReplicaResources, "ingress": IngressOptions}


def _build(cls, data: Any, path: str):
    if not isinstance(data, Mapping):
        raise ValueError(f"{path.rstrip('.') or 'args'} must be a mapping, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(path + k for k in unknown)}; allowed: {', '.join(names)}")
    if cls is AppConfig and data.get("autoscaling") is not None and "num_replicas" in data:
        raise ValueError("give num_replicas or autoscaling, not both")
    kwargs = {}
    for key, value in data.items():
        if cls is AppConfig and key in _NESTED and value is not None:
            value = _build(_NESTED[key], value, f"{path}{key}.")
        elif cls is AppConfig and key == "engine":
            if not isinstance(value, Mapping):
                raise ValueError(f"engine must be a mapping of engine options, got {type(value).__name__}")
            value = tuple(sorted(value.items()))
        elif cls is AppConfig and key == "api_keys":
            if not isinstance(value, (list, tuple)):
                raise ValueError("api_keys must be a list of strings")
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ValueError as exc:
        message = str(exc)
        if path and not message.startswith(path):
            message = path + message
        raise ValueError(message) from None
