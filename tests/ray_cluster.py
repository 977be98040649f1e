"""A local Ray + Serve running the application, for end-to-end tests: started and stopped one way,
and the clients a test talks to it with (``Service``).

Ray 2.60 turns token authentication on by default; the tests run it off. HTTP binds
127.0.0.1; Ray's gRPC proxy has no host option and binds every interface, on a free port.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator
from unittest import mock

import grpc

from deployments.ingress_env import free_port  # noqa: F401 - the tests' free ports
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
from tests.waits import fresh_replicas

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


class Service:
    def __init__(self, http_port: int, grpc_port: int) -> None:
        self.http_port, self.grpc_port = http_port, grpc_port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = slotserve_pb2_grpc.SlotServeStub(self.channel)
        self.base_url = f"http://127.0.0.1:{http_port}/v1"

    def generate(self, timeout=60, **fields) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(pb.GenerateRequest(**fields), timeout=timeout))

    def replicas(self) -> list[pb.ReplicaLoad]:
        return fresh_replicas(lambda: self.stub.GetLoad(pb.GetLoadRequest(), timeout=10).replicas)

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(r.running == 0 and r.waiting == 0 for r in self.replicas()):
                return
            time.sleep(0.1)
        raise AssertionError(f"engines still busy: {self.replicas()}")

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)

    def anthropic(self):
        import anthropic

        return anthropic.Anthropic(base_url=self.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                                   timeout=60)
