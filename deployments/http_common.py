"""What every HTTP API of the ingress shares: the body read within its limit, JSON parsed and
validated with clear errors (``validate_body``), and errors rendered as a status code and a JSON body."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from deployments.errors import BadRequest, PayloadTooLarge, ServingError, to_serving_error
from deployments.requests import GenerateInput, bad_request
from deployments.tools import ToolUse
from deployments.tracing import trace_headers
from engine.validation import field_errors


class AsciiJSONResponse(JSONResponse):
    """Errors quote client text, which may hold lone surrogates (legal in JSON escapes):
    ASCII-escaped JSON renders them instead of failing with a bare 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(exc: BaseException, body: Callable[[ServingError], dict] = ServingError.openai_body) -> JSONResponse:
    """``exc`` as its status code and ``body`` (OpenAI's error shape by default)."""
    err = exc if isinstance(exc, ServingError) else to_serving_error(exc)
    headers = {"retry-after": str(math.ceil(err.retry_after_s))} if err.http_status in (429, 503) else None
    return AsciiJSONResponse(body(err), status_code=err.http_status, headers=headers)


def model_id(model: Any) -> Any:
    """Any string goes on: one not served is NOT_FOUND (the frontend's check), not a bad request."""
    if not isinstance(model, str) or not model:
        raise ValueError("must be a model id from /v1/models")
    return model


@dataclass(frozen=True)
class ParsedBody:
    input: GenerateInput
    stream: bool
    include_usage: bool
    tools: ToolUse = ToolUse()
    """How the reply is read for tool calls (``deployments.tools``; nothing read by default)."""
    echo: bool = False
    """Completions: the prompt comes back before each choice's text (and logprobs)."""


def validate_body(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    unknown = [k for k in body if k not in model.model_fields]
    if unknown:  # here, not by pydantic: a key with a lone surrogate would lose its name there
        raise BadRequest(f"unknown field {unknown[0]}; allowed: {', '.join(model.model_fields)}", param=unknown[0])
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise bad_request(field_errors(exc, model)) from None


DISCARD_BYTES = 64 << 20
DISCARD_S = 10.0
"""An oversized body is still read, and dropped, up to this much and this long before the 413 goes
out: a client still sending when the server answers and closes gets a connection reset instead of
the answer. Past either bound (a body of gigabytes, a client trickling) the answer goes out anyway."""


async def _discard(chunks, size: int) -> None:
    try:
        async with asyncio.timeout(DISCARD_S):
            async for chunk in chunks:
                size += len(chunk)
                if size > DISCARD_BYTES:
                    return
    except (TimeoutError, ClientDisconnect):
        pass


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    """The body, refused as soon as it is known to pass the limit: never held whole in memory."""
    declared = request.headers.get("content-length")
    chunks, size, kept = request.stream(), 0, []
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        if int(declared) <= DISCARD_BYTES:
            await _discard(chunks, 0)
        raise PayloadTooLarge(f"the request body has {declared} bytes; the limit is {max_body_bytes}")
    async for chunk in chunks:
        size += len(chunk)
        if size > max_body_bytes:
            await _discard(chunks, size)
            raise PayloadTooLarge(f"the request body passes the limit of {max_body_bytes} bytes")
        kept.append(chunk)
    return b"".join(kept)


async def read_json(request: Request, max_body_bytes: int):
    raw = await _read_body(request, max_body_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise BadRequest("the request body is not valid JSON: it nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise BadRequest(f"the request body is not valid JSON: {str(exc).split(';')[0]}") from None


def id_headers(request: Request, prepared) -> dict[str, str]:
    """``x-request-id``: the client's back, or the server's id when it sent none. Behind Serve's
    proxy or HAProxy every request arrives with one (the client's, or one they made) and Serve
    echoes it on the response: a second copy from here would be a duplicate header."""
    if request.headers.get("x-request-id") is not None:
        return {}
    return {"x-request-id": prepared.client_request_id or prepared.request_id}


def ingress_span(frontend, request: Request):
    """The request's ingress span (a child of the client's trace context, if it sent one), and
    that context."""
    path, client = request.url.path, trace_headers(request.headers.get("traceparent"),
                                                    request.headers.get("tracestate"))
    span = frontend.tracing.start_ingress(f"POST {path}", frontend.config.served_model_name, client,
                                          {"http.request.method": "POST", "url.path": path})
    return span, client


async def first_delta(deltas: AsyncIterator):
    """A stream's first delta, awaited before the response starts: a rejection (overload, a bad
    request found by the engine) is then still an HTTP status, not an error event in a 200 stream."""
    try:
        return await deltas.__anext__()
    except BaseException:
        await deltas.aclose()
        raise


def sse_event(event: str, body: dict) -> str:
    """A server-sent event with its type named, as the Responses and Messages APIs send them."""
    return f"event: {event}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def named_events(first, deltas: AsyncIterator, built, span, metrics, error_event, on_done=None):
    """A stream of named events (``sse_event``): ``built.start()``, then ``built.events(delta)`` for
    each delta until the request's last; a failure after the status line went out is
    ``error_event(err)``, in-band. ``on_done``: called once the whole reply went out."""
    try:
        for event, body in built.start():
            yield sse_event(event, body)
        delta = first
        while True:
            for event, body in built.events(delta):
                yield sse_event(event, body)
            if delta.ends_request:
                break
            delta = await deltas.__anext__()
        span.end(delta)
        if on_done is not None:
            on_done()
    except Exception as exc:
        span.end(error=exc)
        metrics.rejected(exc)
        yield sse_event(*error_event(exc if isinstance(exc, ServingError) else to_serving_error(exc)))
    finally:
        span.end()  # the client went away mid-stream (no-op when already ended)
        await deltas.aclose()
