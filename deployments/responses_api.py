"""OpenAI's Responses API, served by the ingress over the same frontend as chat:
``POST /v1/responses`` (JSON, or server-sent events with ``stream: true``),
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}`` (stored responses,
``deployments.responses_store``). Errors are OpenAI's, as on the other routes.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.frontend import Frontend
from deployments.http_common import error_response, first_delta, id_headers, ingress_span, named_events, read_json
from deployments.responses_output import ResponseObject
from deployments.responses_protocol import parse_responses_body, responses_input
from deployments.responses_store import ResponseStore


class ResponsesRoutes:
    def __init__(self, frontend: Frontend, max_body_bytes: int, store: ResponseStore | None = None) -> None:
        self.frontend = frontend
        self.max_body_bytes = max_body_bytes
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: Request) -> Response:
        frontend = self.frontend
        span, client = ingress_span(frontend, request)
        try:
            tenant = frontend.authorize(request.headers.get("authorization"))
            span.on_tenant(tenant)
            owner = tenant.name if tenant is not None else None
            req = parse_responses_body(await read_json(request, self.max_body_bytes))
            earlier = None
            if req.previous_response_id is not None:
                earlier = list(self.store.get(owner, req.previous_response_id, "previous_response_id").conversation)
            parsed = responses_input(req, earlier, request.headers.get("x-request-id"),
                                     frontend.config.tool_call_parser)
            prepared = await frontend.prepare(parsed.input, span.engine_trace_context(client), tenant)
            span.on_request(prepared.operation, prepared.request_id, prepared.params)
            built = ResponseObject(prepared.request_id, frontend.config.served_model_name, req, parsed.tools)
            keep = (lambda: self.store.put(owner, built.final, [*parsed.conversation, built.reply])) \
                if req.store is not False else (lambda: None)
            headers = id_headers(request, prepared)
            if req.stream:
                deltas = frontend.stream(prepared)
                first = await first_delta(deltas)
                events = named_events(first, deltas, built, span, frontend.metrics,
                                      lambda err: built.error_event(err.openai_type, err.message, err.param), keep)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={**headers, "cache-control": "no-cache"})
            _, deltas = await frontend.generate_all(prepared)
            span.end(deltas[-1])
            body = built.whole(deltas)
            keep()
            return JSONResponse(body, headers=headers)
        except Exception as exc:
            span.end(error=exc)
            frontend.metrics.rejected(exc)
            return error_response(exc)
        except BaseException:  # cancelled: the client went away
            span.end()
            raise

    async def read(self, response_id: str, request: Request) -> Response:
        try:
            tenant = self.frontend.authorize(request.headers.get("authorization"))
            owner = tenant.name if tenant is not None else None
            if request.method == "DELETE":
                self.store.delete(owner, response_id)
                return JSONResponse({"id": response_id, "object": "response", "deleted": True})
            return JSONResponse(self.store.get(owner, response_id).response)
        except Exception as exc:
            return error_response(exc)


def add_responses_routes(app: FastAPI, frontend: Frontend, max_body_bytes: int) -> None:
    routes = ResponsesRoutes(frontend, max_body_bytes)
    app.add_api_route("/v1/responses", routes.create, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/responses/{response_id}", routes.read, methods=["GET", "DELETE"], include_in_schema=False)
