"""CPU engine replicas sized to the host, so two engines never share a core.

Two OpenMP teams on the same cores throttle each other many-fold, and one engine with all
the cores decodes more tokens per second than two with half each (each would read the
weights once per step). So on a host of C cores, ``slotserve serve`` runs at most
``C // 2`` CPU engine replicas (one on 2-3 cores), each with ``C // replicas`` torch threads.
An app that sets ``engine.num_threads`` or runs on GPUs is left as written.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from deployments.app import AppConfig


def fit_cpu_engines(args: Mapping[str, Any], cores: int) -> tuple[dict[str, Any], str | None]:
    """(the app's args sized to ``cores``, a line saying what was chosen; None when left as is)."""
    cfg = AppConfig.from_args(args)
    engine = cfg.engine_options
    if (cfg.replica_resources.num_gpus or "num_threads" in engine or cfg.tensor_parallel_size > 1
            or str(engine.get("device", "cpu")).startswith("cuda")):
        return dict(args), None
    wanted = cfg.autoscaling.max_replicas if cfg.autoscaling is not None else cfg.num_replicas
    replicas = max(1, min(wanted, cores // 2))
    threads = max(1, cores // replicas)
    fitted = copy.deepcopy(dict(args))
    fitted["engine"] = {**engine, "num_threads": threads}
    if cfg.autoscaling is not None:
        knobs = fitted["autoscaling"]
        knobs["max_replicas"] = replicas
        knobs["min_replicas"] = min(cfg.autoscaling.min_replicas, replicas)
        if cfg.autoscaling.initial_replicas is not None:
            knobs["initial_replicas"] = min(cfg.autoscaling.initial_replicas, replicas)
    else:
        fitted["num_replicas"] = replicas
    knob = "max_replicas" if cfg.autoscaling else "num_replicas"
    why = f" ({knob} {wanted} -> {replicas})" if replicas < wanted else ""
    return fitted, (f"CPU engine replicas: up to {replicas} x {threads} torch threads on {cores} cores{why}; "
                    "set engine.num_threads to choose yourself")
