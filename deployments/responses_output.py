"""OpenAI Responses API objects: a whole ``response``, or its stream of events in OpenAI's order.

A stream is ``response.created`` and ``response.in_progress``; then the reply's message item
(``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``);
then each function call item (``output_item.added``, ``function_call_arguments.delta`` and
``.done``, ``output_item.done``); then ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it) with the whole response. Every event has a ``sequence_number``.
Text streams as it comes until it may be a tool call (``deployments.tools.ToolStream``).
"""

from __future__ import annotations

import time
import uuid

from deployments.responses_protocol import ResponsesRequest
from deployments.textstream import TextDelta, Usage
from deployments.tools import ToolCalls, ToolUse, parse_tool_calls


def usage_json(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def _status(delta: TextDelta) -> tuple[str, dict | None]:
    if delta.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return ("incomplete", None) if delta.finish_reason == "abort" else ("completed", None)


class ResponseObject:
    """The JSON of one response; ``final`` is the whole response once it has ended."""

    def __init__(self, request_id: str, model: str, req: ResponsesRequest, tools: ToolUse = ToolUse()) -> None:
        self.id = "resp_" + request_id
        self.model = model
        self.created_at = int(time.time())
        self._req = req
        self._tool_use = tools
        self._stream = (tools.streams(1) or [None])[0]
        self._message_id = "msg_" + uuid.uuid4().hex
        self._text: list[str] = []
        self._message_open = False
        self._seq = 0
        self.final: dict | None = None
        self.reply: dict | None = None
        """The reply as a chat message (its text and tool calls): what a follow-up continues from."""

    def _response(self, status: str, output: list[dict], usage: Usage | None, incomplete: dict | None) -> dict:
        req = self._req
        choice = req.tool_choice
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage_json(usage), "error": None,
                "incomplete_details": incomplete, "instructions": req.instructions,
                "metadata": req.metadata or {}, "previous_response_id": req.previous_response_id,
                "store": req.store is not False, "background": False, "truncation": "disabled",
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
                "text": req.text.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format
                else {"format": {"type": "text"}},
                "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
                "user": req.user}

    def _message(self, status: str) -> dict:
        content = [{"type": "output_text", "text": "".join(self._text), "annotations": [], "logprobs": []}]
        return {"type": "message", "id": self._message_id, "status": status, "role": "assistant",
                "content": content if status != "in_progress" else []}

    @staticmethod
    def _call(call: dict, status: str) -> dict:
        fn = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"] if status != "in_progress" else "", "status": status}

    def _finish(self, last: TextDelta, calls: list[dict]) -> dict:
        status, incomplete = _status(last)
        text = "".join(self._text)
        output = ([self._message("completed" if status == "completed" else "incomplete")] if text else [])
        output += [self._call(c, "completed") for c in calls]
        self.reply = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        self.final = self._response(status, output, last.usage, incomplete)
        return self.final

    def whole(self, deltas: list[TextDelta]) -> dict:
        text = "".join(d.text for d in deltas)
        use = self._tool_use
        parsed = parse_tool_calls(text, use.parser, use.single) if use.parser else ToolCalls(text)
        self._text = [parsed.content or ""]
        return self._finish(deltas[-1], parsed.calls)

    # -- streamed --------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        self._seq += 1
        return kind, {"type": kind, "sequence_number": self._seq - 1, **fields}

    def start(self) -> list[tuple[str, dict]]:
        opening = self._response("in_progress", [], None, None)
        return [self._event("response.created", response=opening), self._event("response.in_progress",
                                                                                response=opening)]

    def events(self, delta: TextDelta) -> list[tuple[str, dict]]:
        text, calls = delta.text, []
        if self._stream is not None:
            text, calls, _ = self._stream.step(delta.text, delta.finish_reason)
        out, at = [], {"item_id": self._message_id, "output_index": 0, "content_index": 0}
        if text:
            if not self._message_open:
                self._message_open = True
                out += [self._event("response.output_item.added", output_index=0, item=self._message("in_progress")),
                        self._event("response.content_part.added", **at,
                                    part={"type": "output_text", "text": "", "annotations": []})]
            self._text.append(text)
            out.append(self._event("response.output_text.delta", **at, delta=text, logprobs=[]))
        if not delta.ends_request:
            return out
        final = self._finish(delta, calls)
        if self._message_open:
            item = final["output"][0]
            out += [self._event("response.output_text.done", **at, text=item["content"][0]["text"], logprobs=[]),
                    self._event("response.content_part.done", **at, part=item["content"][0]),
                    self._event("response.output_item.done", output_index=0, item=item)]
        for index, call in enumerate(calls, start=int(self._message_open)):
            item = self._call(call, "completed")
            out += [self._event("response.output_item.added", output_index=index, item=self._call(call, "in_progress")),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=final)]

    def error_event(self, code: str, message: str, param: str | None) -> tuple[str, dict]:
        return self._event("error", code=code, message=message, param=param)
