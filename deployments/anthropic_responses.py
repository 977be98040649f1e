"""Anthropic-shaped responses of ``POST /v1/messages``: a whole ``message``, or its server-sent
events in Anthropic's order, and errors in Anthropic's shape.

A stream is ``message_start``; then each content block as ``content_block_start``, its deltas
(``text_delta``, or ``input_json_delta`` for a tool's input) and ``content_block_stop``; then
``message_delta`` (the stop reason and the final usage) and ``message_stop``. Text streams as it
comes until it may be a tool call (``deployments.tools.ToolStream``); calls go out whole at the end.
"""

from __future__ import annotations

import json

from deployments.errors import ServingError
from deployments.textstream import TextDelta, Usage
from deployments.tools import ToolCalls, ToolUse, parse_tool_calls

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error"}


def error_body(err: ServingError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.http_status, "api_error"), "message": err.message}}


def usage_json(usage: Usage | None, num_prompt_tokens: int) -> dict:
    """Anthropic counts cache reads apart from ``input_tokens``: the two add up to the prompt."""
    if usage is None:
        return {"input_tokens": num_prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0}
    cached = usage.cached_prompt_tokens or 0
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(delta: TextDelta, calls: list[dict]) -> str | None:
    if delta.stop_string is not None:
        return "stop_sequence"
    if delta.finish_reason == "stop":
        return "tool_use" if calls else "end_turn"
    return {"length": "max_tokens"}.get(delta.finish_reason)


def tool_use_block(call: dict) -> dict:
    """An OpenAI-shaped call (``deployments.tools``) as a ``tool_use`` block."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


class MessageBuilder:
    """The JSON of one reply (``n`` is 1 in this API)."""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int, tools: ToolUse = ToolUse()) -> None:
        self.id = "msg_" + request_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self._tool_use = tools
        self._stream = (tools.streams(1) or [None])[0]
        self._open: str | None = None  # the kind of content block now open in a stream
        self._blocks = 0

    def _message(self, content: list[dict], reason: str | None, stop: str | None, usage: Usage | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": usage_json(usage, self.num_prompt_tokens)}

    def whole(self, deltas: list[TextDelta]) -> dict:
        text, last = "".join(d.text for d in deltas), deltas[-1]
        use = self._tool_use
        parsed = parse_tool_calls(text, use.parser, use.single) if use.parser else ToolCalls(text)
        content = [{"type": "text", "text": parsed.content}] if parsed.content else []
        content += [tool_use_block(c) for c in parsed.calls]
        return self._message(content, stop_reason(last, parsed.calls), last.stop_string, last.usage)

    # -- streamed --------------------------------------------------------------------

    def start(self) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start", "message": self._message([], None, None, None)})]

    def events(self, delta: TextDelta) -> list[tuple[str, dict]]:
        """The events one delta makes: text as it may go out, and on the last one the calls,
        ``message_delta`` and ``message_stop``."""
        text, calls = delta.text, []
        if self._stream is not None:
            text, calls, _ = self._stream.step(delta.text, delta.finish_reason)
        out = []
        if text:
            out += self._begin("text", {"type": "text", "text": ""})
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self._blocks - 1,
                                                "delta": {"type": "text_delta", "text": text}}))
        for call in calls:
            block = tool_use_block(call)
            out += self._begin("tool_use", {**block, "input": {}})
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self._blocks - 1, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        if delta.ends_request:
            out += self._close()
            body = {"type": "message_delta", "delta": {"stop_reason": stop_reason(delta, calls),
                                                       "stop_sequence": delta.stop_string},
                    "usage": usage_json(delta.usage, self.num_prompt_tokens)}
            out += [("message_delta", body), ("message_stop", {"type": "message_stop"})]
        return out

    def _begin(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        """Opens a block of ``kind`` unless a text block is open and more text comes."""
        if self._open == "text" and kind == "text":
            return []
        out = self._close()
        self._open = kind
        self._blocks += 1
        return out + [("content_block_start", {"type": "content_block_start", "index": self._blocks - 1,
                                               "content_block": block})]

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]
