"""A local Ray + Serve running the application, for end-to-end tests: started and stopped one way.

Ray 2.60 turns token authentication on by default; the tests run it off. HTTP binds
127.0.0.1; Ray's gRPC proxy has no host option and binds every interface, on a free port.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator
from unittest import mock

from deployments.ingress_env import free_port  # noqa: F401 - the tests' free ports

APP = "slotserve"


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int


@contextlib.contextmanager
def served_app(app_args: dict[str, Any], *, env: dict[str, str] | None = None,
               http_options: dict[str, Any] | None = None, **ray_init: Any) -> Iterator[Ports]:
    """``build_app(app_args)`` served as ``APP`` on a fresh local Ray (2 CPUs unless ``ray_init``
    says otherwise); ``env`` is set before Ray starts, so its processes inherit it. On exit
    Serve and Ray are shut down and the environment is restored."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import SERVE_ENV, build_app
    from deployments.grpc_registration import SERVICER_FUNCTIONS

    with mock.patch.dict(os.environ, {"RAY_AUTH_MODE": "disabled", **SERVE_ENV, **(env or {})}):
        try:
            ray.init(**{"num_cpus": 2, "include_dashboard": False, **ray_init})
            ports = Ports(free_port(), free_port())
            serve.start(http_options=HTTPOptions(host="127.0.0.1", port=ports.http, **(http_options or {})),
                        grpc_options=gRPCOptions(port=ports.grpc, grpc_servicer_functions=list(SERVICER_FUNCTIONS)))
            serve.run(build_app(app_args), name=APP, route_prefix="/")
            yield ports
        finally:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
