"""The OpenAI-compatible HTTP API (FastAPI), served by the ingress.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE with
``stream: true``), the Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id};
``deployments.responses_api``), POST /v1/embeddings (``deployments.embeddings``), GET /v1/models, GET /v1/models/{id}, vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, Anthropic's POST /v1/messages and /v1/messages/count_tokens
(``deployments.anthropic_api``), plus GET /health (an engine is ready) and GET /load (per-replica load).
A request with the header ``x-slotserve-audit: true``
gets its scheduling audit trail in ``usage.audit`` (docs/OBSERVABILITY.md). Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` and status codes: 400 bad request,
401 bad API key, 404 unknown model, 413 body too large, 429 engine queue full,
503 no healthy engine, 504 server-side deadline.
"""

from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.adapters import LoRAAdapterRequest
from deployments.anthropic_api import add_anthropic_routes, is_anthropic_path
from deployments.embeddings import add_embeddings_routes
from deployments.errors import BadRequest, ModelNotFound, ServingError, to_serving_error
from deployments.frontend import Frontend
from deployments.http_common import ParsedBody, error_response, first_delta, id_headers, ingress_span, read_json
from deployments.openai_protocol import ResponseBuilder, parse_chat_body, parse_completion_body
from deployments.openai_schema import install_openapi
from deployments.responses_api import add_responses_routes

logger = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
AUDIT_HEADER = "x-slotserve-audit"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIRoutes:
    """The route handlers, over one Frontend."""

    def __init__(self, frontend: Frontend, max_body_bytes: int) -> None:
        self.frontend = frontend
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    async def _model_cards(self) -> list[dict]:
        """The base model, then each LoRA adapter with the base as its ``parent`` (as vLLM lists them)."""
        info = self.frontend.known_engine_info or {}
        config = self.frontend.config
        base = {"id": config.served_model_name, "object": "model", "created": self.created, "owned_by": "slotserve",
                "root": config.model, "parent": None}
        for key in ("max_model_len", "quantization"):
            if key in info:
                base[key] = info[key]
        adapters = await self.frontend.adapters.served()
        return [base, *({**base, "id": name, "root": path or name, "parent": config.served_model_name}
                         for name, path in adapters.items())]

    async def list_models(self, request: Request) -> Response:
        try:
            self.frontend.authorize(request.headers.get("authorization"))
            return JSONResponse({"object": "list", "data": await self._model_cards()})
        except Exception as exc:
            return error_response(exc)

    async def get_model(self, model_id: str, request: Request) -> Response:
        try:
            self.frontend.authorize(request.headers.get("authorization"))
            cards = {card["id"]: card for card in await self._model_cards()}
            if model_id not in cards:
                raise ModelNotFound(f"model {model_id!r} is not served here; this server serves "
                                    f"{', '.join(map(repr, cards))}", param="model")
            return JSONResponse(cards[model_id])
        except Exception as exc:
            return error_response(exc)

    async def manage_lora(self, request: Request) -> Response:
        """vLLM's ``/v1/load_lora_adapter`` ({lora_name, lora_path}) and ``/v1/unload_lora_adapter``
        ({lora_name}), behind the API key: on every engine replica."""
        try:
            self.frontend.authorize(request.headers.get("authorization"))
            body = LoRAAdapterRequest.parse(await read_json(request, self.max_body_bytes))
            config = self.frontend.config
            if request.url.path.endswith("/load_lora_adapter"):
                if body.lora_path is None:
                    raise BadRequest("lora_path is required", param="lora_path")
                count = await self.frontend.adapters.load(body.lora_name, body.lora_path,
                                                          (config.served_model_name, config.model))
                done = "added"
            else:
                count = await self.frontend.adapters.unload(body.lora_name)
                done = "removed"
            logger.info("LoRA adapter %r %s on %d engine replicas", body.lora_name, done, count)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' {done} successfully.")
        except Exception as exc:
            return error_response(exc)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def health(self) -> Response:
        try:
            await self.frontend.check_ready()
            return JSONResponse({"status": "ok"})
        except Exception as exc:
            return error_response(exc)

    async def load(self, request: Request) -> Response:
        try:
            self.frontend.authorize(request.headers.get("authorization"))
            return JSONResponse(await self.frontend.load())
        except Exception as exc:
            return error_response(exc)

    async def _generate(self, request: Request, chat: bool) -> Response:
        span, client = ingress_span(self.frontend, request)
        try:
            tenant = self.frontend.authorize(request.headers.get("authorization"))
            span.on_tenant(tenant)
            body = await read_json(request, self.max_body_bytes)
            rid = request.headers.get("x-request-id")
            parsed = (parse_chat_body(body, rid, self.frontend.config.tool_call_parser) if chat
                      else parse_completion_body(body, rid))
            audit = _wants_audit(request.headers.get(AUDIT_HEADER), parsed)
            # Passed beside the input, not into it: a copy would validate the whole body again.
            prepared = await self.frontend.prepare(parsed.input, span.engine_trace_context(client), tenant)
            span.on_request(prepared.operation, prepared.request_id, prepared.params)
            echo = None
            if parsed.echo:
                echo = parsed.input.prompt or self.frontend.tokenizer.decode(list(prepared.prompt_token_ids))
            builder = ResponseBuilder(chat, prepared.request_id, self.frontend.config.served_model_name,
                                      parsed.tools, prepared.params.n, echo)
            headers = id_headers(request, prepared)
            if parsed.stream:
                return await self._stream(prepared, parsed, builder, span, audit, headers)
            _, deltas = await self.frontend.generate_all(prepared)
            span.end(deltas[-1])
            return JSONResponse(_with_audit(builder.whole(deltas), deltas[-1], audit), headers=headers)
        except Exception as exc:
            span.end(error=exc)
            self.frontend.metrics.rejected(exc)
            return error_response(exc)
        except BaseException:  # cancelled: the client went away
            span.end()
            raise

    async def _stream(self, prepared, parsed: ParsedBody, builder: ResponseBuilder, span, audit: bool,
                      headers: dict[str, str]) -> Response:
        deltas = self.frontend.stream(prepared)
        first = await first_delta(deltas)
        return StreamingResponse(_events(first, deltas, parsed, builder, self.frontend.metrics, span, audit),
                                 media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})


def _wants_audit(header: str | None, parsed: ParsedBody) -> bool:
    value = (header or "false").strip().lower()
    if value not in ("true", "1", "false", "0"):
        raise BadRequest(f"{AUDIT_HEADER} must be true or false, got {header!r}", param=AUDIT_HEADER)
    audit = value in ("true", "1")
    if audit and parsed.stream and not parsed.include_usage:
        raise BadRequest(f"{AUDIT_HEADER} on a stream needs stream_options.include_usage=true: the audit "
                         "trail comes in the usage chunk", param="stream_options")
    return audit


def _with_audit(body: dict, last, audit: bool) -> dict:
    """The audit trail as an extension of OpenAI's usage object, when the client asked for it."""
    if audit and body.get("usage") is not None:
        body["usage"]["audit"] = list(last.audit or ())
    return body


async def _events(first, deltas: AsyncIterator, parsed: ParsedBody, builder: ResponseBuilder, metrics, span,
                  audit: bool):
    try:
        for opening in builder.first_chunks():
            yield _sse(opening)
        delta = first
        while True:
            yield _sse(builder.chunk(delta, parsed.include_usage))
            if delta.ends_request:
                break
            delta = await deltas.__anext__()
        span.end(delta)
        if parsed.include_usage:
            yield _sse(_with_audit(builder.usage_chunk(delta.usage), delta, audit))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the status line is gone: report in-band, as OpenAI does
        span.end(error=exc)
        metrics.rejected(exc)
        err = exc if isinstance(exc, ServingError) else to_serving_error(exc)
        yield _sse(err.openai_body())
    finally:
        span.end()  # the client went away mid-stream (no-op when already ended)
        await deltas.aclose()


def build_openai_app(frontend: Frontend, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="slotserve", description="OpenAI-compatible API of slotserve", docs_url="/docs",
                  redoc_url=None)
    routes = OpenAIRoutes(frontend, max_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown paths (404) and wrong methods (405): OpenAI's error body like every other error.
        message = f"{request.method} {request.url.path}: {exc.detail}"
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        if is_anthropic_path(request.url.path):
            body = {"type": "error", "error": {"type": "not_found_error" if exc.status_code == 404
                                               else "invalid_request_error", "message": message}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.get_model, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/load_lora_adapter", routes.manage_lora, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", routes.manage_lora, methods=["POST"])
    add_anthropic_routes(app, frontend, max_body_bytes)
    add_responses_routes(app, frontend, max_body_bytes)
    add_embeddings_routes(app, frontend, max_body_bytes)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/load", routes.load, methods=["GET"])
    install_openapi(app, tuple(dict.fromkeys((frontend.config.served_model_name, frontend.config.model,
                                              *frontend.config.lora_adapters))))
    return app
