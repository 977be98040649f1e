"""The OpenAPI document of the OpenAI API: every request and response body, from the models that check them.

The routes read their bodies themselves (deployments.openai_protocol), so that each problem comes
back in OpenAI's error shape under the field's own name; FastAPI therefore sees no body to
describe. This module writes what it cannot infer:

- request bodies: the fields of ``CompletionRequest`` / ``ChatRequest``, each sampling field typed
  and bounded as ``SamplingParams`` declares it (the same source as the check), refused fields
  with the only values served;
- responses: models of what ``ResponseBuilder`` writes, whole and streamed, of the model list and
  of OpenAI's error body, under every status the API answers with.

A test checks live responses against this document, and a bounded schemathesis run fuzzes the
API from it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

from deployments.adapters import LoRAAdapterRequest
from deployments.openai_protocol import REFUSED, ChatRequest, CompletionRequest, ResponseFormat, StreamOptions
from deployments.requests import PRIORITY_RANGE, Messages
from deployments.tools import MAX_TOOLS, NamedToolChoice, ToolDef
from engine.kv.hashing import MAX_CACHE_SALT_CHARS
from engine.sampling import MAX_LOGPROBS, SamplingParams

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {400: "a bad request: the field is named in error.param", 401: "a missing or wrong API key",
                  404: "an unknown model or path", 413: "a body over the size limit",
                  429: "the engines' queues are full (retry after the retry-after header)",
                  500: "a server error", 503: "no healthy engine (retry after the retry-after header)",
                  504: "the server-side deadline passed"}


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    audit: list[Any] | None = None
    """With the header ``x-slotserve-audit: true``: the request's scheduling audit trail."""


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    """None for an echoed prompt's first token, which nothing predicts."""
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    """A whole completion, and also each chunk of a streamed one (``usage`` null but in the last)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str
    """A JSON object, as text."""


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunctionOut


class ToolCallDelta(ToolCallOut):
    index: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    """The base model of a LoRA adapter; None for the base model itself."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]


def _nullable(schema: dict) -> dict:
    if {"type": "null"} in schema.get("anyOf", ()):
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


def _sampling_fields() -> dict[str, dict]:
    """Each sampling field's type and bounds as SamplingParams checks them; null means its default.
    (Its docstrings are written for maintainers, so they stay out.)"""
    props = TypeAdapter(SamplingParams).json_schema(ref_template=REF)["properties"]
    out = {}
    for name, schema in props.items():
        schema = {k: v for k, v in schema.items() if k not in ("default", "title", "description")}
        if name == "stop":  # one string is a list of one (a field validator makes it a tuple)
            schema = {"anyOf": [schema["items"], schema]}
        if name == "logit_bias":  # JSON keys are strings: token ids in decimal
            schema["anyOf"][0]["propertyNames"] = {"pattern": "^[0-9]{1,18}$"}
        if name == "structured_outputs":  # rules checked by StructuredOutputs and the request models
            schema["description"] = ("exactly one of json, regex, choice, grammar or json_object; not with a "
                                     "response_format other than text, nor with a tool_choice that forces a call")
        out[name] = _nullable(schema)
    return out


def _own_fields(chat: bool, models: tuple[str, ...]) -> dict[str, dict]:
    """Fields that are not SamplingParams', typed as the request models accept them."""
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    fields: dict[str, dict] = {
        "model": {"enum": list(models), "description": "the served model's id (/v1/models); another is a 404"},
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"$ref": REF.format(model="StreamOptions")}),
        "response_format": _nullable({"$ref": REF.format(model="ResponseFormat")}),
        "tools": _nullable({"type": "array", "items": {"$ref": REF.format(model="ToolDef")}, "maxItems": MAX_TOOLS}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]},
                                            {"$ref": REF.format(model="NamedToolChoice")}]}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "priority": _nullable({"type": "integer", "minimum": PRIORITY_RANGE[0], "maximum": PRIORITY_RANGE[1],
                               "description": "lower is scheduled first (vLLM's priority scheduling)"}),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                                 "description": "cached prompt blocks are shared only with requests of the same "
                                                "salt (vLLM's field)"}),
    }
    if chat:
        fields["messages"] = {"$ref": REF.format(model="Messages")}
        fields["max_completion_tokens"] = _nullable({"type": "integer", "minimum": 1})
        fields["logprobs"] = _nullable({"type": "boolean"})
        fields["top_logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS})
    else:
        fields["prompt"] = {"anyOf": [{"type": "string", "minLength": 1}, token_ids,
                                      {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 1},
                                                                             token_ids]},
                                       "minItems": 1, "maxItems": 1}],
                            "description": "a string or a list of token ids (a batch of one is unwrapped)"}
        fields["logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS})
        fields["echo"] = _nullable({"type": "boolean", "description": "the prompt comes back before each "
                                    "completion (with logprobs: the prompt's too, computed in its prefill)"})
    return fields


def request_schema(body: type[BaseModel], chat: bool, models: tuple[str, ...]) -> dict:
    sampling, own = _sampling_fields(), _own_fields(chat, models)
    props = {}
    for name, field in body.model_fields.items():
        if name in REFUSED:
            allowed, why = REFUSED[name]
            schema = {"anyOf": [{"const": v} if v is not None else {"type": "null"} for v in allowed],
                      "description": f"only these values are served: {why}"}
        elif name in own:
            schema = own[name]
        elif name in sampling:
            schema = sampling[name]
        else:  # accepted and ignored (user, store, metadata, ...)
            schema = {"description": "accepted, no effect on the output"}
        if field.description and "description" not in schema:
            schema = {**schema, "description": field.description}
        props[name] = schema
    required = ["model", "messages" if chat else "prompt"]
    rules = [_needs("stream_options", "object", "stream")] + ([_needs("top_logprobs", "integer", "logprobs")]
                                                             if chat else [])
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False,
            "allOf": rules}


def _needs(field: str, kind: str, flag: str) -> dict:
    """``field`` given (not null) only with ``flag: true``."""
    return {"if": {"required": [field], "properties": {field: {"type": kind}}},
            "then": {"required": [flag], "properties": {flag: {"const": True}}}}


def _components(models: tuple[str, ...]) -> dict[str, dict]:
    """Every body's schema under components/schemas, nested models included."""
    out: dict[str, dict] = {}

    def add(name: str, schema: dict) -> None:
        out.update(schema.pop("$defs", {}))
        out[name] = schema

    for body in (Completion, ChatCompletion, ChatCompletionChunk, ModelList, ModelCard, ErrorBody, Health,
                 StreamOptions, ResponseFormat, ToolDef, NamedToolChoice, LoRAAdapterRequest):
        add(body.__name__, body.model_json_schema(ref_template=REF))
    out.update(TypeAdapter(SamplingParams).json_schema(ref_template=REF).get("$defs", {}))
    add("Messages", TypeAdapter(Messages).json_schema(ref_template=REF))
    text_parts = {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
    out["ChatMessage"]["description"] = "other OpenAI message fields (name, ...) are accepted and not used"
    out["ChatMessage"]["properties"]["content"] = {
        "anyOf": [{"type": "string"}, text_parts, {"type": "null"}],
        "description": "a string, or content parts that are all text (joined)"}
    out["CompletionRequest"] = request_schema(CompletionRequest, chat=False, models=models)
    out["ChatRequest"] = request_schema(ChatRequest, chat=True, models=models)
    return out


def _json(model: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": REF.format(model=model)}}}}


def _errors(*statuses: int) -> dict:
    return {str(s): _json("ErrorBody", ERROR_STATUSES[s]) for s in statuses}


def _event(chunk: str) -> dict:
    """One server-sent event (OpenAPI 3.1: the media type's schema describes each event): its data is a
    chunk, an error body (once the status line is sent) or the closing ``[DONE]``."""
    payload = {"anyOf": [{"$ref": REF.format(model=chunk)}, {"$ref": REF.format(model="ErrorBody")}]}
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json", "contentSchema": payload}}
    return {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"const": "message"}}}


def _generate_operation(request: str, whole: str, chunk: str) -> dict:
    ok = _json(whole, f"the {whole} (stream false), or a stream of {chunk} events (stream true), then [DONE]")
    ok["content"]["text/event-stream"] = {"schema": _event(chunk)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(
        model=request)}}}}, "responses": {"200": ok, **_errors(400, 401, 404, 413, 429, 500, 503, 504)}}


def install_openapi(app: FastAPI, models: tuple[str, ...]) -> None:
    """``app.openapi()`` (and /openapi.json) returns the full document, built once; ``models``: the
    ids a request may name (the served name, and what the engines load)."""

    def build() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, never sent
                schemas.pop(unused, None)
            schemas.update(_components(models))
            paths = doc["paths"]
            paths["/v1/completions"]["post"].update(_generate_operation("CompletionRequest", "Completion",
                                                                        "Completion"))
            paths["/v1/chat/completions"]["post"].update(_generate_operation("ChatRequest", "ChatCompletion",
                                                                             "ChatCompletionChunk"))
            paths["/v1/models"]["get"]["responses"] = {"200": _json("ModelList", "the served model"),
                                                       **_errors(401)}
            paths["/v1/models/{model_id}"]["get"]["responses"] = {"200": _json("ModelCard", "the model"),
                                                                  **_errors(401, 404)}
            paths["/health"]["get"]["responses"] = {"200": _json("Health", "an engine is ready"), **_errors(503)}
            for path, done in (("/v1/load_lora_adapter", "loaded on every engine replica"),
                               ("/v1/unload_lora_adapter", "unloaded from every engine replica")):
                paths[path]["post"].update({
                    "requestBody": {"required": True, "content": {"application/json": {
                        "schema": {"$ref": REF.format(model="LoRAAdapterRequest")}}}},
                    "responses": {"200": {"description": done,
                                          "content": {"text/plain": {"schema": {"type": "string"}}}},
                                  **_errors(400, 401, 404, 413, 503)}})
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build
