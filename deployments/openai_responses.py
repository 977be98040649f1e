"""OpenAI-shaped responses: whole bodies and streamed chunks of completions and chat, tool calls
read back out of the reply (``deployments.tools``)."""

from __future__ import annotations

import time

from deployments.textstream import TextDelta, TokenLogprob, Usage
from deployments.tools import ToolCalls, ToolUse, parse_tool_calls, tool_calls_reason


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
            "top_logprobs": [None if lp.logprob is None else {tok: top_lp for _, top_lp, tok in lp.top}
                             for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, l) for _, l, t in lp.top]}
                        for lp in logprobs]}


class ResponseBuilder:
    """Builds the JSON objects of one response (whole or streamed chunks), ``n`` choices of it."""

    def __init__(self, chat: bool, request_id: str, model: str, tools: ToolUse = ToolUse(), n: int = 1,
                 echo: str | None = None) -> None:
        """``tools``: how the reply is read for tool calls (``deployments.tools``); ``echo``: the
        prompt's text, to come back before each completion (with its logprobs, when they come)."""
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        self._text_offsets = [0] * n
        self._tool_use = tools
        self._tools = tools.streams(n)
        self._echo = echo
        self._echoed: set[int] = set()
        self._prompt_logprobs: tuple = ()

    def _envelope(self, obj: str, choices: list, usage: Usage | None, with_usage: bool) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            out["usage"] = usage_json(usage)
        return out

    def whole(self, deltas: list[TextDelta]) -> dict:
        by_choice: dict[int, list[TextDelta]] = {i: [] for i in range(self.n)}
        for d in deltas:
            by_choice[d.index].append(d)
            self._prompt_logprobs = d.prompt_logprobs or self._prompt_logprobs
        choices = [self._whole_choice(i, mine) for i, mine in by_choice.items()]
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, deltas[-1].usage, True)

    def _whole_choice(self, index: int, deltas: list[TextDelta]) -> dict:
        text = "".join(d.text for d in deltas)
        last = deltas[-1]
        logprobs = None if last.logprobs is None else [lp for d in deltas for lp in d.logprobs or ()]
        if not self.chat:
            if self._echo is not None:
                text = self._echo + text
                logprobs = None if logprobs is None else [*self._prompt_logprobs, *logprobs]
            return {"index": index, "text": text, "logprobs": completion_logprobs(logprobs),
                    "finish_reason": last.finish_reason}
        use = self._tool_use
        parsed = parse_tool_calls(text, use.parser, use.single) if use.parser else ToolCalls(text)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = parsed.calls
        return {"index": index, "message": message, "logprobs": chat_logprobs(logprobs),
                "finish_reason": tool_calls_reason(last.finish_reason, parsed)}

    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant's role, a chunk per choice; completions have none."""
        if not self.chat:
            return []
        return [self._envelope("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}], None, False)
                for i in range(self.n)]

    def chunk(self, delta: TextDelta, include_usage: bool) -> dict:
        i = delta.index
        if self.chat:
            text, calls, finish = delta.text, [], delta.finish_reason
            if self._tools is not None:
                text, calls, finish = self._tools[i].step(delta.text, finish)
            body = {"content": text} if text or not finish else {}
            if calls:  # each call whole, in one delta (OpenAI clients accept a call in one piece or many)
                body["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            choice = {"index": i, "delta": body, "logprobs": chat_logprobs(_list(delta.logprobs)),
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            text, logprobs = delta.text, _list(delta.logprobs)
            self._prompt_logprobs = delta.prompt_logprobs or self._prompt_logprobs
            if self._echo is not None and i not in self._echoed:  # the choice's first chunk
                self._echoed.add(i)
                text = self._echo + text
                logprobs = None if logprobs is None else [*self._prompt_logprobs, *logprobs]
            choice = {"index": i, "text": text, "logprobs": completion_logprobs(logprobs, self._text_offsets[i]),
                      "finish_reason": delta.finish_reason}
            # Offsets count the tokens' own texts, as a whole response's do (an echoed BOS has one).
            self._text_offsets[i] += len(text) if logprobs is None else sum(len(lp.token) for lp in logprobs)
            obj = "text_completion"
        # with include_usage, every chunk carries "usage": null and a last chunk carries the totals
        return self._envelope(obj, [choice], None, include_usage)

    def usage_chunk(self, usage: Usage | None) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage, True)


def _list(logprobs) -> list | None:
    return None if logprobs is None else list(logprobs)
