"""OpenTelemetry traces of requests, configured from the standard ``OTEL_*`` variables.

One trace per request::

    ingress span        gRPC "slotserve.v1.SlotServe/Generate" or HTTP "POST /v1/..." (SERVER);
      │                 a child of the client's W3C traceparent when it sent one
      └ slotserve.route       the routing decision: chosen replica and why
          └ "<op> <model>"    the engine replica: one event per audit-trail entry (queued,
                              scheduled, prefill_chunk, preempted, resumed, first_token, finished)

The ingress hands its span's ``traceparent`` to the replica inside the ``EngineRequest``; the router
notes its decision there (``EngineRequest.routing``). The replica builds its two spans from
the engine's recorded events once the request has ended, with the engine's timestamps: the step
loop does no tracing work. Attributes follow OpenTelemetry's GenAI conventions.

Nothing is traced unless an exporter is configured (``OTEL_TRACES_EXPORTER``, or an OTLP
endpoint): then ``Tracing`` holds no provider and every hook returns at once.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping

from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import (OTEL_EXPORTER_OTLP_ENDPOINT,
                                                     OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SDK_DISABLED)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from deployments.contract import EngineRequest
from engine.outputs import AUDIT_DETAILS, FINISH_ABORT, StreamOutput

logger = logging.getLogger(__name__)

TRACER_NAME = "slotserve"
DEFAULT_SERVICE_NAME = "slotserve"
TRACES_FILE_ENV = "SLOTSERVE_TRACES_FILE"
"""With ``OTEL_TRACES_EXPORTER=console``: append spans to this file, one JSON object per line."""
_PROPAGATOR = TraceContextTextMapPropagator()

# OpenTelemetry GenAI semantic conventions, and slotserve's own.
OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
REPLICA = "slotserve.replica"
CACHED_TOKENS = "slotserve.cached_tokens"
PREEMPTIONS = "slotserve.preemptions"
REQUEST_ID = "slotserve.request_id"
ROUTE_REASON = "slotserve.route.reason"
TENANT = "slotserve.tenant"


# -------------------------------------------------------------------- configuration

def exporter_names() -> list[str]:
    """Span exporters (entry-point names) the environment asks for; [] means no tracing.

    ``OTEL_TRACES_EXPORTER`` as the SDK reads it (``otlp`` follows ``OTEL_EXPORTER_OTLP_PROTOCOL``).
    Unset, an OTLP endpoint alone selects OTLP; with neither, nothing is traced (OpenTelemetry's
    own default would be OTLP to localhost: here tracing must cost nothing unless asked for).
    """
    from opentelemetry.sdk._configuration import _get_exporter_entry_point, _get_exporter_names

    if os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        return []
    if OTEL_TRACES_EXPORTER not in os.environ and (os.environ.get(OTEL_EXPORTER_OTLP_ENDPOINT)
                                                   or os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)):
        return [_get_exporter_entry_point("otlp", "traces")]
    return _get_exporter_names("traces")


def provider_from_env() -> TracerProvider | None:
    """A TracerProvider as the ``OTEL_*`` variables describe it, or None when nothing is traced.

    The SDK reads the sampler (``OTEL_TRACES_SAMPLER`` / ``_ARG``), the resource
    (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), the batch processor's ``OTEL_BSP_*``
    and the OTLP exporter's ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, TLS, timeout) itself.
    """
    from opentelemetry.sdk._configuration import _import_exporters

    names = exporter_names()
    if not names:
        return None
    try:
        exporters, _, _ = _import_exporters(names, [], [])
    except RuntimeError as exc:
        from importlib.metadata import entry_points

        known = sorted(e.name for e in entry_points(group="opentelemetry_traces_exporter"))
        raise ValueError(f"{OTEL_TRACES_EXPORTER}={os.environ.get(OTEL_TRACES_EXPORTER, 'otlp')!r}: {exc}; "
                         f"installed span exporters: {', '.join(known)} (or none)") from None
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    for name, exporter_class in exporters.items():
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, exporter_class)))
    logger.info("tracing: exporting spans with %s", ", ".join(exporters))
    return provider


def _exporter(name: str, exporter_class: type[SpanExporter]) -> SpanExporter:
    path = os.environ.get(TRACES_FILE_ENV)
    if name == "console" and path:
        # Line-buffered and opened for appending: processes sharing the file write whole lines.
        return exporter_class(out=open(path, "a", buffering=1, encoding="utf-8"),
                              formatter=lambda span: span.to_json(indent=None) + "\n")
    return exporter_class()


# -------------------------------------------------------------------- the hooks

class Tracing:
    """This process's tracer, or none: then every hook is a no-op that builds nothing."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None

    @classmethod
    def from_env(cls) -> "Tracing":
        return cls(provider_from_env())

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start_ingress(self, name: str, model: str, client: Mapping[str, str] | None,
                      attributes: Mapping[str, Any] | None = None) -> "IngressSpan":
        """The SERVER span of one generation request, a child of the client's trace context
        (``trace_headers``: its W3C traceparent and tracestate)."""
        if self._tracer is None:
            return NO_SPAN
        span = self._tracer.start_span(name, context=_extract(client), kind=SpanKind.SERVER,
                                       attributes={REQUEST_MODEL: model, **(attributes or {})})
        return IngressSpan(span)

    def record_engine_request(self, request: EngineRequest, last: StreamOutput | None, replica_id: str, model: str,
                              received_ns: int) -> None:
        """The replica's spans of one request, from the engine's audit trail, once it has ended.

        ``last``: its last engine message (None if it never produced one); ``received_ns``: when
        this replica got the request (``time.time_ns()``), the end of the routing span."""
        if self._tracer is None:
            return
        parent = _extract(request.trace_context)
        note = request.routing
        if isinstance(note, Mapping):
            parent = self._route_span(parent, note, replica_id, received_ns)
            if parent is None:  # not sampled
                return
        timing = last.timing if last is not None else None
        to_wall = _wall_clock()
        now_ns = time.time_ns()
        start_ns = to_wall(timing.arrival_time) if timing is not None else received_ns
        params = request.params
        operation = request.operation or "text_completion"
        span = self._tracer.start_span(f"{operation} {model}", context=parent, start_time=start_ns,
                                       attributes=_request_attributes(operation, model, params))
        if not span.is_recording():
            return
        span.set_attributes({REPLICA: replica_id, REQUEST_ID: request.request_id})
        if request.tenant is not None:
            span.set_attribute(TENANT, request.tenant)
        if last is not None:
            span.set_attributes(_usage_attributes(last))
        if timing is not None:
            span.set_attribute(PREEMPTIONS, timing.num_preemptions)
            for t, event, *details in list(timing.events):
                span.add_event(event, {f"slotserve.{k}": v for k, v in zip(AUDIT_DETAILS[event], details)},
                               timestamp=to_wall(t))
        finished = timing.finished_time if timing is not None else None
        span.end(end_time=to_wall(finished) if finished is not None else now_ns)

    def _route_span(self, parent, note: Mapping, replica_id: str, received_ns: int):
        """The routing decision (``EngineRequest.routing``) as a span ending when this replica
        got the request; returns the context its children descend from, None when not sampled."""
        start_ns = min(int(note.get("time_ns", received_ns)), received_ns)  # clocks of two hosts may disagree
        route = self._tracer.start_span("slotserve.route", context=parent, start_time=start_ns,
                                        attributes={REPLICA: replica_id, ROUTE_REASON: str(note.get("reason"))})
        if not route.is_recording():
            return None
        route.end(end_time=received_ns)
        return set_span_in_context(route)

    def shutdown(self) -> None:
        """Export what is still buffered (the SDK also does at interpreter exit)."""
        if self.provider is not None:
            self.provider.shutdown()


class IngressSpan:
    """One request's span at the ingress; ended once, with its outcome."""

    __slots__ = ("_span", "_ended")

    def __init__(self, span) -> None:
        self._span = span
        self._ended = False

    def engine_trace_context(self, client: Mapping[str, str] | None) -> dict[str, str] | None:
        """The trace context for the engine replica: this span's, as W3C ``traceparent`` and
        ``tracestate`` (the client's vendor entries, which the span carries on)."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(self._span))
        return carrier or (dict(client) if client else None)

    def on_request(self, operation: str, request_id: str, params) -> None:
        """The request as validated (``PreparedRequest`` fields)."""
        self._span.set_attributes({**_request_attributes(operation, None, params), REQUEST_ID: request_id})

    def on_tenant(self, tenant) -> None:
        """Whose request it is (a ``Tenant`` from ``Frontend.authorize``; None: no tenant), set as soon as
        the key is checked, so a request refused later (invalid, over a limit) still names it."""
        if tenant is not None:
            self._span.set_attribute(TENANT, tenant.name)

    def end(self, last=None, error: BaseException | None = None) -> None:
        """``last``: the final ``TextDelta`` (its usage and finish reason); ``error``: why it failed."""
        if self._ended:
            return
        self._ended = True
        if last is not None and last.usage is not None:
            u = last.usage
            self._span.set_attributes({FINISH_REASONS: [last.finish_reason or FINISH_ABORT],
                                       INPUT_TOKENS: u.prompt_tokens, OUTPUT_TOKENS: u.completion_tokens,
                                       CACHED_TOKENS: u.cached_prompt_tokens})
        if error is not None:
            self._span.set_attribute("error.type", type(error).__name__)
            self._span.set_status(Status(StatusCode.ERROR, str(error)[:512]))
        self._span.end()


class _NoSpan:
    """Tracing off: passes the client's trace context on untouched, records nothing."""

    __slots__ = ()

    def engine_trace_context(self, client: Mapping[str, str] | None) -> dict[str, str] | None:
        return dict(client) if client else None

    def on_request(self, operation: str, request_id: str, params) -> None:
        pass

    def on_tenant(self, tenant) -> None:
        pass

    def end(self, last=None, error: BaseException | None = None) -> None:
        pass


NO_SPAN = _NoSpan()


def trace_headers(traceparent: str | None, tracestate: str | None) -> dict[str, str] | None:
    """A client's W3C trace context headers as a carrier (None without a traceparent)."""
    if not traceparent or not isinstance(traceparent, str):
        return None
    return {"traceparent": traceparent, **({"tracestate": tracestate} if isinstance(tracestate, str) and tracestate
                                           else {})}


def _extract(carrier: Mapping[str, str] | None):
    if not isinstance(carrier, Mapping) or not isinstance(carrier.get("traceparent"), str):
        return None
    return _PROPAGATOR.extract(dict(carrier))  # a malformed traceparent yields a fresh root


def _wall_clock():
    """time.monotonic() seconds -> time.time_ns(), by this moment's offset between the two clocks."""
    offset_ns = time.time_ns() - time.monotonic_ns()
    return lambda t: int(t * 1e9) + offset_ns


def _request_attributes(operation: str, model: str | None, params) -> dict[str, Any]:
    attrs: dict[str, Any] = {OPERATION: operation}
    if model is not None:
        attrs[REQUEST_MODEL] = model
    if params is not None:
        if params.max_tokens is not None:
            attrs[REQUEST_MAX_TOKENS] = params.max_tokens
        attrs[REQUEST_TEMPERATURE] = float(params.temperature)
    return attrs


def _usage_attributes(last: StreamOutput) -> dict[str, Any]:
    return {FINISH_REASONS: [last.finish_reason if last.finished and last.finish_reason else FINISH_ABORT],
            INPUT_TOKENS: last.num_prompt_tokens, OUTPUT_TOKENS: last.num_output_tokens,
            CACHED_TOKENS: last.num_cached_tokens}
