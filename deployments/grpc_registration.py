"""Servicer registration for Ray Serve's gRPC proxy (``grpc_options.grpc_servicer_functions``).

Serve replaces each registered handler with one that routes to the ingress method of
the same name. The generated ``add_*_to_server`` functions would make grpc parse the
request in the proxy, where a malformed message fails with INTERNAL "Exception
deserializing request!"; these register the same methods with no request
deserializer, so the raw bytes travel to the ingress, which answers INVALID_ARGUMENT
with a readable message (``grpc_service.parse``). Reflection still sees the real
schemas through the generated descriptors imported here.

grpc.health.v1.Health is registered by ``grpcio-health-checking``'s own function: its
requests are one optional string, parsed in the proxy like any standard health check.
"""

from __future__ import annotations

import grpc

from deployments.proto_gen.slotserve.v1 import slotserve_pb2

_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
}


def _register(servicer, server, service_descriptor, output_classes) -> None:
    handlers = {}
    for method in service_descriptor.methods:
        kind = _KINDS[(method.client_streaming, method.server_streaming)]
        output = output_classes[method.output_type.full_name]
        handlers[method.name] = kind(getattr(servicer, method.name), request_deserializer=None,
                                     response_serializer=output.SerializeToString)
    generic = grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))


def _classes(module) -> dict:
    return {d.full_name: getattr(module, d.name) for d in module.DESCRIPTOR.message_types_by_name.values()}


def add_slotserve_servicer(servicer, server) -> None:
    _register(servicer, server, slotserve_pb2.DESCRIPTOR.services_by_name["SlotServe"], _classes(slotserve_pb2))


SERVICER_FUNCTIONS = (
    "deployments.grpc_registration.add_slotserve_servicer",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)
