"""OpenAI request bodies in, OpenAI-shaped responses out (completions and chat).

Bodies are checked by hand rather than by pydantic models so that every error is a
``BadRequest`` naming the field, in OpenAI's error shape. vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, seed, ignore_eos, min_tokens, stop_token_ids,
priority, ...) are accepted next to OpenAI's; fields that would change the meaning
of a request but are not served (n > 1, logit_bias, tools, echo, ...) are refused by
name instead of being silently ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

from deployments.errors import BadRequest
from deployments.requests import GenerateInput
from deployments.textstream import TextDelta, TokenLogprob, Usage

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
_PASSTHROUGH = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "top_k", "min_p",
                "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
                "include_stop_str_in_output")
_IGNORED = ("user", "store", "metadata", "service_tier", "parallel_tool_calls")  # no effect on the output
_COMMON = {"model", "stream", "stream_options", "max_tokens", "n", "logit_bias", "priority", *_PASSTHROUGH,
           *_IGNORED}
_COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                          "tools", "tool_choice"}


@dataclass(frozen=True)
class ParsedBody:
    input: GenerateInput
    stream: bool
    include_usage: bool


def _require_object(body: Any) -> Mapping:
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    return body


def _check_fields(body: Mapping, allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) for {endpoint}: {', '.join(unknown)}", param=unknown[0])


def _refuse(body: Mapping, name: str, allowed: tuple, why: str) -> None:
    if name in body and body[name] not in allowed:
        raise BadRequest(f"{name}={body[name]!r} is not supported: {why}", param=name)


def _common(body: Mapping) -> tuple[dict, bool, bool]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: a model id from /v1/models", param="model")
    _refuse(body, "n", (None, 1), "one completion per request")
    _refuse(body, "logit_bias", (None, {}), "logit_bias is not implemented")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")
        if not isinstance(options, Mapping) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise BadRequest("stream_options must be an object with include_usage", param="stream_options")
        include_usage = bool(options.get("include_usage", False))
    sampling = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    if body.get("max_tokens") is not None:
        sampling["max_tokens"] = body["max_tokens"]
    return sampling, stream, include_usage


def parse_completion_body(body: Any, request_id: str | None = None) -> ParsedBody:
    body = _require_object(body)
    _check_fields(body, _COMPLETION_FIELDS, "/v1/completions")
    sampling, stream, include_usage = _common(body)
    _refuse(body, "echo", (None, False), "the prompt is not echoed back")
    _refuse(body, "best_of", (None, 1), "one candidate per request")
    _refuse(body, "suffix", (None, ""), "insertion (suffix) is not supported")
    if body.get("logprobs") is not None:
        sampling["logprobs"] = body["logprobs"]
    prompt, token_ids = _completion_prompt(body.get("prompt"))
    return ParsedBody(GenerateInput(prompt=prompt, prompt_token_ids=token_ids, sampling=sampling,
                                    model=body["model"], request_id=request_id, priority=body.get("priority", 0),
                                    default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS),
                      stream, include_usage)


def _completion_prompt(prompt: Any) -> tuple[str | None, tuple | None]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("send one prompt per request (batches of prompts are not supported)", param="prompt")
    if prompt is None:
        raise BadRequest("prompt is required: a string or a list of token ids", param="prompt")
    raise BadRequest("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


def parse_chat_body(body: Any, request_id: str | None = None) -> ParsedBody:
    body = _require_object(body)
    _check_fields(body, _CHAT_FIELDS, "/v1/chat/completions")
    sampling, stream, include_usage = _common(body)
    _refuse(body, "tools", (None, []), "tool calling is not implemented")
    _refuse(body, "tool_choice", (None, "none"), "tool calling is not implemented")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest("response_format must be {'type': 'text'} (structured output is not implemented)",
                         param="response_format")
    if body.get("max_completion_tokens") is not None:
        sampling["max_tokens"] = body["max_completion_tokens"]
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs not in (None, True, False):
        raise BadRequest(f"logprobs must be true or false, got {logprobs!r}", param="logprobs")
    if top is not None and not logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    if logprobs:
        sampling["logprobs"] = 0 if top is None else top
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("messages is required: a list of {role, content} objects", param="messages")
    return ParsedBody(GenerateInput(messages=messages, sampling=sampling, model=body["model"],
                                    request_id=request_id, priority=body.get("priority", 0)),
                      stream, include_usage)


# -- responses -------------------------------------------------------------------------

def usage_json(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def completion_logprobs(logprobs: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
    if logprobs is None:
        return None
    offsets, pos = [], text_offset
    for lp in logprobs:
        offsets.append(pos)
        pos += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{tok: top_lp for _, top_lp, tok in lp.top} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, l) for _, l, t in lp.top]}
                        for lp in logprobs]}


class ResponseBuilder:
    """Builds the JSON objects of one response (whole or streamed chunks)."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self._text_offset = 0

    def _envelope(self, obj: str, choices: list, usage: Usage | None, with_usage: bool) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            out["usage"] = usage_json(usage)
        return out

    def whole(self, deltas: list[TextDelta]) -> dict:
        text = "".join(d.text for d in deltas)
        last = deltas[-1]
        logprobs = None if last.logprobs is None else [lp for d in deltas for lp in d.logprobs or ()]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": chat_logprobs(logprobs), "finish_reason": last.finish_reason}
            return self._envelope("chat.completion", [choice], last.usage, True)
        choice = {"index": 0, "text": text, "logprobs": completion_logprobs(logprobs),
                  "finish_reason": last.finish_reason}
        return self._envelope("text_completion", [choice], last.usage, True)

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role; completions have no such chunk."""
        if not self.chat:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice], None, False)

    def chunk(self, delta: TextDelta, include_usage: bool) -> dict:
        if self.chat:
            body = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            choice = {"index": 0, "delta": body, "logprobs": chat_logprobs(_list(delta.logprobs)),
                      "finish_reason": delta.finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta.text,
                      "logprobs": completion_logprobs(_list(delta.logprobs), self._text_offset),
                      "finish_reason": delta.finish_reason}
            self._text_offset += len(delta.text)
            obj = "text_completion"
        # with include_usage, every chunk carries "usage": null and a last chunk carries the totals
        return self._envelope(obj, [choice], None, include_usage)

    def usage_chunk(self, usage: Usage | None) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage, True)


def _list(logprobs) -> list | None:
    return None if logprobs is None else list(logprobs)
