"""Client requests, validated: what the gRPC and HTTP layers hand to the frontend.

Both protocols parse their wire format into a ``GenerateInput`` (text, chat messages
or token ids plus vLLM-named sampling fields); ``build_sampling_params`` and the
``check_*`` helpers turn every bad value into a ``BadRequest`` that names the field
and what is allowed, before anything reaches an engine.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from deployments.errors import BadRequest
from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from engine.tokenizer import CHAT_ROLES

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"extra", "n"}
MAX_REQUEST_ID_CHARS = 128
MAX_MESSAGES = 1024
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerateInput:
    """One generation request as a client sent it, before tokenization.

    Exactly one of ``prompt``, ``messages`` and ``prompt_token_ids`` is set.
    ``sampling`` holds vLLM-named SamplingParams fields; ``max_tokens`` absent means
    ``default_max_tokens`` (the protocol's default) or the server's.
    """

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    model: str | None = None
    request_id: str | None = None
    priority: int = 0
    timeout_s: float | None = None
    trace_context: str | None = None
    default_max_tokens: int | None = None


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
    trace_context: str | None = None
    client_request_id: str | None = None
    """The client's own id, if it sent one: logged and echoed back, never a key."""

    def engine_request(self, resume_token_ids: Sequence[int] = ()) -> dict:
        """The dict sent to ``EngineReplica.generate``: token ids only, no text.

        Routers read ``prompt_token_ids`` from it (the first positional argument) to
        match cached prefixes. ``resume_token_ids``: output tokens the client already has
        (a replica died mid-stream); the engine recomputes them and goes on from there.
        """
        engine_params = dataclasses.replace(self.params, stop=(), include_stop_str_in_output=False)
        request = {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                   "params": engine_params, "priority": self.priority, "trace_context": self.trace_context}
        if resume_token_ids:
            request["resume_token_ids"] = list(resume_token_ids)
        return request


def new_request_id() -> str:
    """An unguessable server-side id: knowing it is what lets a client abort its request."""
    return uuid.uuid4().hex


def check_text(name: str, value: Any, max_chars: int) -> str:
    """A non-empty str of at most ``max_chars`` characters that encodes to UTF-8."""
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string, got {type(value).__name__}", param=name)
    if not value:
        raise BadRequest(f"{name} is empty; send at least one character", param=name)
    if len(value) > max_chars:
        raise BadRequest(f"{name} has {len(value)} characters; the limit is {max_chars}", param=name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{name} is not valid UTF-8 text (unpaired surrogate at character {exc.start})",
                         param=name) from None
    return value


def parse_messages(value: Any, max_chars: int) -> tuple[ChatMessage, ...]:
    """OpenAI-style chat messages: [{"role": ..., "content": str | [{"type": "text", ...}]}]."""
    if not isinstance(value, (list, tuple)) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    if len(value) > MAX_MESSAGES:
        raise BadRequest(f"messages has {len(value)} entries; the limit is {MAX_MESSAGES}", param="messages")
    out = []
    total = 0
    for i, message in enumerate(value):
        name = f"messages[{i}]"
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, Mapping):
            role, content = message.get("role"), _message_text(message.get("content"), name)
        else:
            raise BadRequest(f"{name} must be an object with role and content", param="messages")
        if role not in CHAT_ROLES:
            raise BadRequest(f"{name}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param="messages")
        if not isinstance(content, str):
            raise BadRequest(f"{name}.content must be a string", param="messages")
        total += len(content)
        if content:
            check_text(f"{name}.content", content, max_chars)
        out.append(ChatMessage(role=role, content=content))
    if total > max_chars:
        raise BadRequest(f"messages have {total} characters in all; the limit is {max_chars}", param="messages")
    return tuple(out)


def _message_text(content: Any, name: str) -> Any:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts; only text parts can be served
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{name}.content parts must be {{'type': 'text', 'text': str}} "
                                 "(this server serves text-only models)", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    return content


def check_token_ids(name: str, value: Any, vocab_size: int | None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise BadRequest(f"{name} must be a non-empty list of token ids", param=name)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise BadRequest(f"{name} must hold integers in {limit}, got {t!r}", param=name)
    return tuple(value)


def check_request_id(value: Any) -> str | None:
    """A client's own request id (None when it sent none): echoed back and logged, never a key."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > MAX_REQUEST_ID_CHARS or not value.isprintable():
        raise BadRequest(f"request_id must be a printable string of at most {MAX_REQUEST_ID_CHARS} "
                         "characters (or empty)", param="request_id")
    return value


def check_priority(value: Any) -> int:
    lo, hi = PRIORITY_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"priority must be an integer in [{lo}, {hi}], got {value!r}", param="priority")
    return value


def check_timeout(value: Any, server_limit: float | None) -> float | None:
    """Seconds the request may take; None or 0 means the server's limit (if any)."""
    if value is None or value == 0:
        return server_limit
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise BadRequest(f"timeout_s must be a non-negative number of seconds, got {value!r}", param="timeout_s")
    return value if server_limit is None else min(value, server_limit)


def build_sampling_params(fields: Mapping[str, Any], *, num_prompt_tokens: int, max_model_len: int,
                          default_max_tokens: int) -> SamplingParams:
    """SamplingParams from vLLM-named fields, with max_tokens checked against the context."""
    unknown = set(fields) - SAMPLING_FIELDS
    if unknown:
        raise BadRequest(f"unknown sampling field(s): {', '.join(sorted(unknown))}; "
                         f"allowed: {', '.join(sorted(SAMPLING_FIELDS))}", param=sorted(unknown)[0])
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
        params = SamplingParams(**values)
    except InvalidRequestError as exc:
        raise BadRequest(str(exc), param=str(exc).split(" ", 1)[0]) from None
    except TypeError as exc:  # e.g. stop=5: not iterable
        raise BadRequest(f"invalid sampling value: {exc}") from None
    for stop in params.stop:  # a lone surrogate (JSON allows one) could never match the text
        check_text("stop", stop, len(stop))
    return params
