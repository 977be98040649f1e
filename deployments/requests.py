"""Client requests, validated: what the gRPC and HTTP layers hand to the frontend.

Both protocols map their wire format onto a ``GenerateInput`` (text, chat messages or
token ids plus vLLM-named sampling fields), a pydantic model: a bad value is a
``BadRequest`` naming the field (``messages.0.role``, OpenAI's ``param``) and what is
allowed, before anything is tokenized. Limits that depend on the server (prompt
characters, vocabulary, context) are checked by the frontend with the same naming.
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, TypeAdapter, ValidationError, field_validator

from deployments.contract import EngineRequest
from deployments.errors import BadRequest
from engine.errors import InvalidRequestError
from engine.engine import MAX_REQUEST_ID_CHARS
from engine.kv.hashing import MAX_CACHE_SALT_CHARS
from engine.sampling import SamplingParams
from engine.structured import check as check_grammar
from engine.tokenizer import ChatMessage
from engine.validation import FieldError, Float, Int, Str, Text, field_errors, union_tag, validated

MAX_MESSAGES = 1024
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def bad_request(errors: list[FieldError]) -> BadRequest:
    """Every problem in the message; the first one's field is the ``param``."""
    return BadRequest("; ".join(e.message for e in errors), param=errors[0].param)


Messages = Annotated[tuple[ChatMessage, ...], Field(min_length=1, max_length=MAX_MESSAGES)]


@validated(bad_request)
class _Messages:
    messages: Messages


def parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    """OpenAI-style chat messages: [{"role": ..., "content": str | [{"type": "text", ...}]}]."""
    return _Messages(messages=value).messages


class Unread(BaseModel):
    """A content or item type of the Messages or Responses API that the served models cannot take
    (images, files, reasoning, hosted tools' calls, ...): refused by name."""

    model_config = ConfigDict(extra="allow", frozen=True)
    type: Str

    @field_validator("type")
    @classmethod
    def _refused(cls, kind: str) -> str:
        raise ValueError(f"{kind!r} is not supported: the served models read text and call only functions")


def kind_tag(value: Any, served: tuple[str, ...], default: str | None = None) -> str:
    """The union tag of a tagged item by its ``type`` (``default`` when it has none): its own when
    it is one of ``served``, else "other" (``Unread``)."""
    kind = value.get("type", default) if isinstance(value, Mapping) else getattr(value, "type", default)
    return union_tag(kind if kind in served else "other").tag


@validated(bad_request)
class GenerateInput:
    """One generation request as a client sent it, before tokenization.

    Exactly one of ``prompt``, ``messages`` and ``prompt_token_ids`` is set.
    ``sampling`` holds vLLM-named SamplingParams fields (checked by SamplingParams);
    ``max_tokens`` absent means ``default_max_tokens`` (the protocol's) or the server's.
    """

    prompt: Text | None = Field(None, min_length=1)
    messages: Messages | None = None
    prompt_token_ids: tuple[Annotated[Int, Field(ge=0)], ...] | None = Field(None, min_length=1)
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tools: SkipValidation[tuple[Mapping[str, Any], ...] | None] = None
    """OpenAI function definitions for the chat template (checked by the protocol that sent them)."""
    model: SkipValidation[str | None] = None
    """Checked against the served names: one that is not served is NOT_FOUND, whatever it holds."""
    request_id: Str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)
    """The client's own id: echoed back and logged, never a key. Empty means none."""
    priority: Int = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    timeout_s: Float | None = Field(None, ge=0)
    """Seconds the request may take; None or 0: the server's limit (if any)."""
    default_max_tokens: int | None = None
    cache_salt: Str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """vLLM's field: the prompt's cached blocks are shared only with requests of the same salt."""

    @field_validator("request_id", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("request_id")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        if value is not None and not value.isprintable():
            raise ValueError("must be printable (no control characters)")
        return value


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for an engine replica."""

    request_id: str
    """The server's id (``new_request_id``): the engine's key, never chosen by a client."""
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    """As the client asked, stop strings included (the ingress applies them to the text)."""
    priority: int = 0
    timeout_s: float | None = None
    trace_context: Mapping[str, str] | None = None
    """W3C trace context headers (``traceparent``, ``tracestate``) the engine replica's spans
    descend from (the ingress span's)."""
    client_request_id: str | None = None
    """The client's own id, if it sent one: logged and echoed back, never a key."""
    operation: str = "text_completion"
    """GenAI operation name for traces: ``chat`` (messages) or ``text_completion``."""
    lora: str | None = None
    """The LoRA adapter the client named as its ``model``; None: the base model."""
    lora_path: str | None = None
    """Its directory, when it was loaded at run time (a replica lacking it loads it from there)."""
    cache_salt: str | None = None
    """Cached prefix blocks are shared only between requests of the same salt (``salted_root``)."""
    tenant: str | None = None
    """Whose request it is (``deployments.tenants``): its limits apply (``deployments.admission``), and
    the engines share service between tenants by weight (``engine.fairness``)."""
    tenant_weight: float = 1.0
    arrival_time: float | None = None
    """``time.monotonic()`` when the ingress started preparing it: where the tenant's time to first token starts."""

    def engine_request(self, resume_token_ids: Sequence[int] = (), attempt: int = 0,
                       resume_choices: Mapping[int, Sequence[int]] | None = None) -> EngineRequest:
        """What an engine replica is sent (``deployments.contract``): token ids only, no text.

        ``resume_token_ids``: output tokens the client already has (a replica died mid-stream).
        ``attempt``: how many times it was sent before. ``resume_choices``: with ``n`` > 1, the
        choices still to run, each with the tokens it has.
        """
        cleared = ["stop", "include_stop_str_in_output"]  # the ingress applies stop strings, not the engine
        if resume_token_ids or any((resume_choices or {}).values()):  # the client has the prompt's logprobs
            cleared.append("prompt_logprobs")
        return EngineRequest(
            request_id=self.request_id, prompt_token_ids=list(self.prompt_token_ids),
            params=with_defaults(self.params, cleared), priority=self.priority, attempt=attempt,
            resume_token_ids=list(resume_token_ids),
            resume_choices=None if resume_choices is None else {int(i): list(ids) for i, ids in resume_choices.items()},
            lora=self.lora, lora_path=self.lora_path if self.lora is not None else None,
            trace_context=self.trace_context, cache_salt=self.cache_salt, tenant=self.tenant,
            tenant_weight=self.tenant_weight if self.tenant is not None else 1.0, operation=self.operation)


_DEFAULT_SAMPLING = SamplingParams()


def with_defaults(params: SamplingParams, names: Sequence[str]) -> SamplingParams:
    """``params`` with the fields ``names`` back at their defaults, not validated again (unlike
    ``dataclasses.replace``): it was when built, and no field's default makes it invalid."""
    cleared = copy.copy(params)
    for name in names:
        object.__setattr__(cleared, name, getattr(_DEFAULT_SAMPLING, name))  # frozen: set once, on the copy
    return cleared


def new_request_id() -> str:
    """An unguessable server-side id: knowing it is what lets a client abort its request."""
    return uuid.uuid4().hex


def check_text(name: str, text: str, max_chars: int) -> str:
    """A text within the server's character limit (checked before tokenizing it)."""
    if not text:
        raise BadRequest(f"{name} is empty; send at least one character", param=name)
    if len(text) > max_chars:
        raise BadRequest(f"{name} has {len(text)} characters; the limit is {max_chars}", param=name)
    return text


def check_messages_length(messages: Sequence[ChatMessage], max_chars: int) -> None:
    total = 0
    for i, message in enumerate(messages):
        if len(message.content) > max_chars:
            raise BadRequest(f"messages.{i}.content has {len(message.content)} characters; the limit is "
                             f"{max_chars}", param=f"messages.{i}.content")
        total += len(message.content) + sum(len(c.function.arguments) for c in message.tool_calls or ())
    if total > max_chars:
        raise BadRequest(f"messages have {total} characters in all; the limit is {max_chars}", param="messages")


def check_vocab(token_ids: Sequence[int], vocab_size: int) -> None:
    for i, t in enumerate(token_ids):
        if t >= vocab_size:
            raise BadRequest(f"prompt_token_ids.{i} must be a token id in [0, {vocab_size}), got {t}",
                             param=f"prompt_token_ids.{i}")


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    for t in params.logit_bias or ():
        if t >= vocab_size:
            raise BadRequest(f"logit_bias.{t}: {t} is not a token id of this model (its vocabulary is "
                             f"[0, {vocab_size}))", param=f"logit_bias.{t}")


def effective_timeout(timeout_s: float | None, server_limit: float | None) -> float | None:
    """None or 0: the server's limit (if any); never more than it."""
    if not timeout_s:
        return server_limit
    return timeout_s if server_limit is None else min(timeout_s, server_limit)


_SAMPLING = TypeAdapter(SamplingParams)


def build_sampling_params(fields: Mapping[str, Any], *, num_prompt_tokens: int, max_model_len: int,
                          default_max_tokens: int) -> SamplingParams:
    """SamplingParams from vLLM-named fields, with max_tokens checked against the context."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise BadRequest(f"the prompt has {num_prompt_tokens} tokens, which leaves no room to generate "
                         f"within the model's context of {max_model_len} tokens; shorten the prompt",
                         param="prompt")
    values = {k: v for k, v in fields.items() if v is not None}
    max_tokens = values.get("max_tokens")
    if max_tokens is None:
        values["max_tokens"] = min(default_max_tokens, room)
    elif isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > room:
        raise BadRequest(f"max_tokens is {max_tokens}, but the prompt has {num_prompt_tokens} tokens and the "
                         f"model's context is {max_model_len}: at most {room} tokens can be generated",
                         param="max_tokens")
    try:
        params = _SAMPLING.validate_python(values)
    except ValidationError as exc:
        raise bad_request(field_errors(exc, SamplingParams)) from None
    if params.structured_outputs is not None:  # here, not at a replica: a 400 before any routing
        try:
            check_grammar(params.structured_outputs)
        except InvalidRequestError as exc:
            raise BadRequest(str(exc), param=f"structured_outputs.{params.structured_outputs.kind}") from None
    return params
