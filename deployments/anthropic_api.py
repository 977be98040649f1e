"""Anthropic's Messages API, served by the ingress beside the OpenAI one, over the same frontend:
``POST /v1/messages`` (JSON, or server-sent events with ``stream: true``) and
``POST /v1/messages/count_tokens``.

Anthropic's SDK sends its key as ``x-api-key``; ``authorization: Bearer`` works too. The
``anthropic-version`` and ``anthropic-beta`` headers are accepted and change nothing. Errors are
Anthropic's body ``{"type": "error", "error": {"type", "message"}}`` with the OpenAI API's status
codes (``deployments.anthropic_responses.error_body``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.anthropic_protocol import parse_count_tokens_body, parse_messages_body
from deployments.anthropic_responses import MessageBuilder, error_body
from deployments.frontend import Frontend
from deployments.http_common import error_response, first_delta, id_headers, ingress_span, named_events, read_json


def api_key(request: Request) -> str | None:
    return request.headers.get("x-api-key") or request.headers.get("authorization")


class AnthropicRoutes:
    def __init__(self, frontend: Frontend, max_body_bytes: int) -> None:
        self.frontend = frontend
        self.max_body_bytes = max_body_bytes

    async def messages(self, request: Request) -> Response:
        frontend = self.frontend
        span, client = ingress_span(frontend, request)
        try:
            tenant = frontend.authorize(api_key(request))
            span.on_tenant(tenant)
            body = await read_json(request, self.max_body_bytes)
            parsed = parse_messages_body(body, request.headers.get("x-request-id"), frontend.config.tool_call_parser)
            prepared = await frontend.prepare(parsed.input, span.engine_trace_context(client), tenant)
            span.on_request(prepared.operation, prepared.request_id, prepared.params)
            builder = MessageBuilder(prepared.request_id, frontend.config.served_model_name,
                                     len(prepared.prompt_token_ids), parsed.tools)
            headers = id_headers(request, prepared)
            if parsed.stream:
                deltas = frontend.stream(prepared)
                first = await first_delta(deltas)
                events = named_events(first, deltas, builder, span, frontend.metrics,
                                      lambda err: ("error", error_body(err)))
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={**headers, "cache-control": "no-cache"})
            _, deltas = await frontend.generate_all(prepared)
            span.end(deltas[-1])
            return JSONResponse(builder.whole(deltas), headers=headers)
        except Exception as exc:
            span.end(error=exc)
            frontend.metrics.rejected(exc)
            return error_response(exc, error_body)
        except BaseException:  # cancelled: the client went away
            span.end()
            raise

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens as the chat template renders it, tools included (Anthropic's
        ``input_tokens``); nothing is generated."""
        frontend = self.frontend
        try:
            frontend.authorize(api_key(request))
            model, messages, tools = parse_count_tokens_body(await read_json(request, self.max_body_bytes),
                                                             frontend.config.tool_call_parser)
            await frontend.check_model(model)
            size = sum(len(m.content) for m in messages)
            ids = await frontend.off_loop(size, frontend.tokenize_messages, messages, tools)
            return JSONResponse({"input_tokens": len(ids)})
        except Exception as exc:
            return error_response(exc, error_body)


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def add_anthropic_routes(app: FastAPI, frontend: Frontend, max_body_bytes: int) -> None:
    """Kept out of the OpenAPI document, which describes the OpenAI API; Anthropic's SDK and
    documentation describe these."""
    routes = AnthropicRoutes(frontend, max_body_bytes)
    app.add_api_route("/v1/messages", routes.messages, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"], include_in_schema=False)
