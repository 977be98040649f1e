"""Routing and autoscaling for slotserve's engine replicas.

The policies (``router.policy``, ``router.autoscale``) are pure and import no ray;
``router.request_router`` is the Ray Serve adapter and loads on first use.
"""

from router.autoscale import (
    AutoscaleConfig,
    ReplicaMetrics,
    SlotOccupancyPolicy,
    autoscaling_config,
    decide,
    slot_occupancy_policy,
)
from router.policy import Ranking, ReplicaLoad, RouterSettings, make_prefix_digest, rank_replicas

_LAZY = {"SlotAwareRequestRouter": "router.request_router", "request_router_config": "router.request_router"}


def __getattr__(name: str):
    # ray.serve costs seconds to import; only processes that route pay for it.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'router' has no attribute {name!r}")


__all__ = [
    "AutoscaleConfig", "Ranking", "ReplicaLoad", "ReplicaMetrics", "RouterSettings", "SlotAwareRequestRouter",
    "SlotOccupancyPolicy", "autoscaling_config", "decide", "make_prefix_digest", "rank_replicas",
    "request_router_config", "slot_occupancy_policy",
]
