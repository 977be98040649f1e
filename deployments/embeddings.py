"""Embeddings at the ingress: OpenAI's ``POST /v1/embeddings`` and gRPC ``Embed``, over the same
frontend and engines as generation.

Each input is one engine request with ``pooling`` (``engine.pooling``): it is routed by load like
any request, runs as a prefill in the continuous batch, holds a slot only while its prompt runs,
and frees its KV blocks at once. Inputs of one call run a few at a time (``CONCURRENT_INPUTS``), so
one call of 2,048 inputs does not take every slot of the fleet. The pooling (last token or mean)
is the model directory's (``engine.pooling.pooling_of``); embeddings are L2-normalised.

A decoder's pooled states are only as good as its training for them: an embedding model
(e5-mistral, gte-Qwen2, Qwen3-Embedding, ...) gives retrieval-grade vectors; the default chat
model's are a demonstration, not a retrieval model.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any, Literal, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, field_validator

from deployments.errors import BadRequest, ServingError
from deployments.frontend import Frontend
from deployments.http_common import error_response, ingress_span, model_id, read_json, validate_body
from deployments.requests import GenerateInput
from deployments.tenants import Tenant
from engine.validation import Int, Str, union_tag

MAX_INPUTS = 2048
"""Inputs of one call, as OpenAI allows."""
CONCURRENT_INPUTS = 8


def _inputs(value: Any) -> Any:
    """One text or token list is a call of one input."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        return [value]
    return value


def _kind(value: Any) -> str:
    return union_tag("text" if isinstance(value, str) else "token_ids").tag


Text = Annotated[Str, Field(min_length=1), union_tag("text")]
TokenIds = Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1), union_tag("token_ids")]
Input = Annotated[list[Annotated[Union[Text, TokenIds], Discriminator(_kind)]], BeforeValidator(_inputs),
                  Field(min_length=1, max_length=MAX_INPUTS)]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Any = Field(description="a model id from /v1/models")
    input: Input
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    encoding_format: Literal["float", "base64"] | None = None
    """``base64``: each vector's little-endian float32 bytes, base64-encoded (what OpenAI's SDK asks for)."""
    dimensions: Int | None = Field(None, ge=1)
    user: Str | None = None

    _model_id = field_validator("model")(model_id)


async def embed(frontend: Frontend, inputs: list, model: str | None, tenant: Tenant | None = None,
                trace_context=None, request_id: str | None = None,
                dimensions: int | None = None) -> tuple[list[list[float]], int]:
    """Each input's embedding, in order, and the prompt tokens they took in all."""
    info = await frontend.engine_info()
    size = info.get("hidden_size")
    if dimensions is not None and dimensions != size:
        raise BadRequest(f"dimensions is {dimensions}, but this model's embeddings have {size} and it was not "
                         "trained to be cut shorter (Matryoshka); leave dimensions out", param="dimensions")
    sampling = {"pooling": info.get("pooling", "last"), "max_tokens": 1}
    # Within the tenant's own limit too: its inputs wait their turn instead of being refused.
    gate = asyncio.Semaphore(min(CONCURRENT_INPUTS, frontend.quotas.concurrency(tenant and tenant.name)
                                 or CONCURRENT_INPUTS))

    async def one(i: int, value) -> tuple[list[float], int]:
        text = value if isinstance(value, str) else None
        inp = GenerateInput(prompt=text, prompt_token_ids=None if text is not None else tuple(value),
                            sampling=sampling, model=model, request_id=request_id)
        async with gate:
            try:
                prepared = await frontend.prepare(inp, trace_context, tenant)
            except BadRequest as exc:
                where = "input" if len(inputs) == 1 else f"input.{i}"
                raise BadRequest(f"{where}: {exc.message}", param=where) from None
            _, deltas = await frontend.generate_all(prepared)
        last = deltas[-1]
        if last.embedding is None:
            raise ServingError(f"the engine replica returned no embedding for input {i} (finish reason "
                               f"{last.finish_reason!r})")
        return last.embedding, last.usage.prompt_tokens

    try:
        async with asyncio.TaskGroup() as group:  # one input failing cancels the others
            tasks = [group.create_task(one(i, v)) for i, v in enumerate(inputs)]
    except ExceptionGroup as failed:  # the first input's error is the call's
        raise failed.exceptions[0] from None
    done = [t.result() for t in tasks]
    return [vector for vector, _ in done], sum(n for _, n in done)


def encode(vector: list[float], encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class EmbeddingsRoutes:
    def __init__(self, frontend: Frontend, max_body_bytes: int) -> None:
        self.frontend = frontend
        self.max_body_bytes = max_body_bytes

    async def create(self, request: Request) -> Response:
        frontend = self.frontend
        span, client = ingress_span(frontend, request)
        try:
            tenant = frontend.authorize(request.headers.get("authorization"))
            span.on_tenant(tenant)
            req = validate_body(EmbeddingRequest, await read_json(request, self.max_body_bytes))
            vectors, tokens = await embed(frontend, req.input, req.model, tenant, span.engine_trace_context(client),
                                          request.headers.get("x-request-id"), req.dimensions)
            span.end()
            data = [{"object": "embedding", "index": i, "embedding": encode(v, req.encoding_format)}
                    for i, v in enumerate(vectors)]
            return JSONResponse({"object": "list", "data": data, "model": frontend.config.served_model_name,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        except Exception as exc:
            span.end(error=exc)
            frontend.metrics.rejected(exc)
            return error_response(exc)
        except BaseException:
            span.end()
            raise


def add_embeddings_routes(app: FastAPI, frontend: Frontend, max_body_bytes: int) -> None:
    app.add_api_route("/v1/embeddings", EmbeddingsRoutes(frontend, max_body_bytes).create, methods=["POST"],
                      include_in_schema=False)
