"""Serving errors and how each maps to a gRPC status code and an HTTP status.

Every failure a client can see becomes one ``ServingError`` subclass, whatever raised
it: request validation, the engine (``engine.errors``), Ray Serve (back-pressure, no
replica, cancellation) or a timeout. Exceptions raised in a replica reach the ingress
wrapped by Ray (``RayTaskError``, possibly also an instance of the cause's class, with
the remote traceback in its text); ``to_serving_error`` unwraps them so the client
reads the original message, not a traceback.
"""

from __future__ import annotations

import asyncio

import ray.exceptions as ray_exceptions
import ray.serve.exceptions as ray_serve_exceptions

from engine.errors import (AdapterInUseError, AdapterLoadError, EngineDeadError, EngineOverloadedError,
                           InvalidRequestError, UnknownAdapterError)


class ServingError(Exception):
    grpc_code = "INTERNAL"
    http_status = 500
    openai_type = "internal_error"
    openai_code: str | None = None
    metric_reason: str | None = "internal"
    """The ``reason`` label of ``slotserve_requests_rejected`` (None: not a rejection)."""
    retry_after_s: float = 1
    """The ``retry-after`` a 429 or 503 names; a tenant's limit knows its own wait."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.openai_type, "param": self.param,
                          "code": self.openai_code}}


class BadRequest(ServingError):
    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"
    metric_reason = "invalid"


class PayloadTooLarge(BadRequest):
    http_status = 413


class ModelNotFound(ServingError):
    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "invalid_request_error"
    openai_code = "model_not_found"
    metric_reason = "invalid"


class Unauthenticated(ServingError):
    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    openai_type = "authentication_error"
    openai_code = "invalid_api_key"
    metric_reason = "unauthenticated"


class Overloaded(ServingError):
    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    openai_type = "overloaded_error"
    openai_code = "engine_overloaded"
    metric_reason = "overloaded"


class TenantLimitExceeded(Overloaded):
    """A tenant's own limit (``deployments.admission``), not the engines' capacity."""

    openai_code = "tenant_limit_exceeded"
    metric_reason = "tenant_limit"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(ServingError):
    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_type = "service_unavailable"
    metric_reason = "unavailable"


class DeadlineExceeded(ServingError):
    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    openai_type = "timeout"
    metric_reason = "deadline"


class Cancelled(ServingError):
    grpc_code = "CANCELLED"
    http_status = 499  # the de-facto code for "client closed request"
    openai_type = "cancelled"
    metric_reason = None  # the client went away: nothing was refused


# Ray's failures by type. RequestCancelledError is a TaskCancelledError; RayActorError
# covers ActorDiedError and ActorUnavailableError.
_RAY_UNAVAILABLE = (ray_serve_exceptions.DeploymentUnavailableError, ray_serve_exceptions.ReplicaUnavailableError,
                    ray_exceptions.RayActorError, ray_exceptions.ActorUnschedulableError,
                    ray_exceptions.WorkerCrashedError, ray_exceptions.NodeDiedError)
_RAY_CANCELLED = (ray_exceptions.TaskCancelledError,)


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (RayTaskError, gRPCStatusError)."""
    for _ in range(8):  # wrappers nest at most a few levels; never loop forever
        if isinstance(exc, ray_exceptions.RayTaskError) and exc.cause is not None:
            exc = exc.cause
        elif isinstance(exc, ray_serve_exceptions.gRPCStatusError) and exc.original_exception is not None:
            exc = exc.original_exception
        else:
            break
    return exc


def to_serving_error(exc: BaseException) -> ServingError:
    exc = unwrap(exc)
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, UnknownAdapterError):
        return ModelNotFound(str(exc), param="model")
    if isinstance(exc, AdapterInUseError):
        return BadRequest(str(exc), param="lora_name")
    if isinstance(exc, AdapterLoadError):
        return BadRequest(str(exc), param="lora_path")
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc))
    if isinstance(exc, EngineOverloadedError):
        message = _message(exc)
        return Overloaded(message if "retry" in message else f"{message}; retry later")
    if isinstance(exc, ray_serve_exceptions.BackPressureError):
        return Overloaded(f"too many requests queued for the engine replicas ({_message(exc)}); retry later")
    if isinstance(exc, EngineDeadError):
        return Unavailable(f"engine replica unavailable: {exc}. Retry; the replica is being replaced.")
    if isinstance(exc, _RAY_UNAVAILABLE):
        return Unavailable(f"no engine replica could take the request ({type(exc).__name__}). "
                           "Retry shortly; replicas may be starting or restarting.")
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return DeadlineExceeded("the request did not finish before its deadline")
    if isinstance(exc, (asyncio.CancelledError, *_RAY_CANCELLED)):
        return Cancelled("the request was cancelled")
    return ServingError(f"internal error: {type(exc).__name__}: {_message(exc)}")


def _message(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return text if len(text) <= 1000 else text[:1000] + "..."


def retry_kind(exc: BaseException, err: ServingError) -> str | None:
    """overloaded: a full replica refused it. lost: the replica serving it died (its engine loop, its
    process or its node), which this very request may have caused."""
    if isinstance(err, Overloaded):
        return "overloaded"
    return "lost" if isinstance(err, Unavailable) else None  # an EngineDeadError is Unavailable too
