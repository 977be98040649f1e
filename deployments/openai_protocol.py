"""The OpenAI protocol of completions and chat, both ways: request bodies in, whole bodies and streamed
chunks out (``ResponseBuilder``, with tool calls read back out of the reply, ``deployments.tools``).

The request bodies are pydantic models: every error is a ``BadRequest`` naming the
field as OpenAI's ``param`` (``messages.0.role``). vLLM's extra sampling fields (top_k,
min_p, repetition_penalty, seed, ignore_eos, min_tokens, stop_token_ids, priority, ...)
are accepted next to OpenAI's and checked by ``SamplingParams``; fields that would
change the meaning of a request but are not served (best_of, suffix) are refused
by name instead of being silently ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from deployments.http_common import ParsedBody, model_id, validate_body
from deployments.requests import GenerateInput, Messages
from deployments.textstream import TextDelta, TokenLogprob, Usage
from deployments.tools import (MAX_TOOLS, NamedToolChoice, ToolCalls, ToolChoice, ToolDef, ToolUse, parse_tool_calls,
                              tool_calls_reason, tool_use)
from engine.structured import StructuredOutputs, grammar_problem
from engine.validation import Bool, Str

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
_PASSTHROUGH = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "top_k", "min_p",
                "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
                "include_stop_str_in_output", "logit_bias", "structured_outputs", "n")
REFUSED = {  # field: (the values served, why others are not)
    "best_of": ((None, 1), "one candidate per request"),
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
}


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema`` (what ``client.chat.completions.parse`` sends)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: Str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """Absent: any JSON (as OpenAI and vLLM read it)."""
    description: Str | None = None
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self

    def structured(self) -> dict | None:
        """The ``structured_outputs`` it asks for (None: plain text)."""
        if self.type == "json_object" or (self.type == "json_schema" and self.json_schema.schema_ is None):
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class _Request(BaseModel):
    """What both endpoints accept. Sampling values are checked by SamplingParams and
    ``priority`` by GenerateInput, each under its own name."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model: Any = Field(description="a model id from /v1/models")
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Any = None
    priority: Any = 0
    cache_salt: Any = None
    temperature: Any = None
    top_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    seed: Any = None
    stop: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    n: Any = None
    logit_bias: Any = None
    response_format: ResponseFormat | None = None
    """OpenAI's structured output: text, any JSON object, or JSON under a schema."""
    structured_outputs: Any = None
    """vLLM's: exactly one of json (a schema), regex, choice, grammar (Lark) or json_object."""
    # no effect on the output
    user: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    _model_id = field_validator("model")(model_id)

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("is only allowed with stream=true")
        return options

    @field_validator(*REFUSED, check_fields=False)
    @classmethod
    def _served(cls, value: Any, info: ValidationInfo) -> Any:
        allowed, why = REFUSED[info.field_name]
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):  # True is not 1
            raise ValueError(f"is not supported ({why})")
        return value

    @field_validator("response_format")
    @classmethod
    def _followable(cls, fmt: ResponseFormat | None) -> ResponseFormat | None:
        # Checked here, so an unusable schema is named as the client sent it.
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema.schema_ is not None:
            problem = grammar_problem(StructuredOutputs(json=fmt.json_schema.schema_))
            if problem is not None:
                raise ValueError(f"json_schema.schema cannot be followed: {problem}")
        return fmt

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: Any, info: ValidationInfo) -> Any:
        fmt = info.data.get("response_format")
        if value is not None and fmt is not None and fmt.type != "text":
            raise ValueError("and response_format both constrain the output: give one of them")
        return value

    def sampling(self) -> dict[str, Any]:
        fields = {k: getattr(self, k) for k in _PASSTHROUGH if getattr(self, k) is not None}
        if self.max_tokens is not None:
            fields["max_tokens"] = self.max_tokens
        if self.response_format is not None and self.response_format.structured() is not None:
            fields["structured_outputs"] = self.response_format.structured()
        return fields

    @property
    def priority_or_default(self) -> Any:
        return 0 if self.priority is None else self.priority  # null means the default, as for every field

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: Any = Field(description="a string or a list of token ids")
    logprobs: Any = None
    echo: Bool | None = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | tuple[int, ...]:
        """A string or token ids; a batch of one is unwrapped. The values are GenerateInput's to check."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return tuple(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("must be one prompt per request (batches of prompts are not supported)")
        raise ValueError("must be a non-empty string or a non-empty list of token ids")


class ChatRequest(_Request):
    messages: Messages = Field(description="a list of {role, content} objects")
    max_completion_tokens: Any = None
    logprobs: Bool | None = None
    top_logprobs: Any = None
    tools: tuple[ToolDef, ...] | None = Field(None, max_length=MAX_TOOLS)
    """Functions the model may call (OpenAI's form); its calls come back as ``tool_calls``."""
    tool_choice: ToolChoice | None = None
    """none, auto (the default with tools), required, or {"type": "function", "function": {"name"}}."""
    parallel_tool_calls: Bool | None = None
    """Whether one reply may hold several calls (default true)."""

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: tuple[ToolDef, ...] | None) -> tuple[ToolDef, ...] | None:
        names = [t.function.name for t in tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"function names must be distinct; repeated: {', '.join(twice)}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _known_tool(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        tools = info.data.get("tools") or ()
        named = isinstance(choice, NamedToolChoice)
        if (named or choice == "required") and not tools:
            raise ValueError("needs tools to choose from")
        if named and choice.function.name not in [t.function.name for t in tools]:
            raise ValueError(f"names {choice.function.name!r}, which is not among the tools")
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: Any, info: ValidationInfo) -> Any:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("is only allowed with logprobs=true")
        return top

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, limit: Any, info: ValidationInfo) -> Any:
        other = info.data.get("max_tokens")
        if limit is not None and other is not None and (type(other), other) != (type(limit), limit):
            raise ValueError(f"and max_tokens ({other!r}) differ: give one of them")
        return limit

    def sampling(self) -> dict[str, Any]:
        fields = super().sampling()
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            fields["logprobs"] = 0 if self.top_logprobs is None else self.top_logprobs
        return fields


def parse_completion_body(body: Any, request_id: str | None = None) -> ParsedBody:
    req = validate_body(CompletionRequest, body)
    sampling = req.sampling()
    if req.logprobs is not None:
        sampling["logprobs"] = req.logprobs
        if req.echo:  # the prompt's logprobs too, scored in its prefill
            sampling["prompt_logprobs"] = req.logprobs
    text = req.prompt if isinstance(req.prompt, str) else None
    inp = GenerateInput(prompt=text, prompt_token_ids=None if text is not None else req.prompt, sampling=sampling,
                        model=req.model, request_id=request_id, priority=req.priority_or_default,
                        cache_salt=req.cache_salt,
                        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)
    return ParsedBody(inp, bool(req.stream), req.include_usage, echo=bool(req.echo))


def parse_chat_body(body: Any, request_id: str | None = None, tool_parser: str = "hermes") -> ParsedBody:
    req = validate_body(ChatRequest, body)
    sampling = req.sampling()
    tools = tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser,
                     constrained="structured_outputs" in sampling)
    if tools.structured_outputs is not None:
        sampling["structured_outputs"] = tools.structured_outputs
    inp = GenerateInput(messages=req.messages, sampling=sampling, tools=tools.template_tools, model=req.model,
                        request_id=request_id, priority=req.priority_or_default, cache_salt=req.cache_salt)
    return ParsedBody(inp, bool(req.stream), req.include_usage, tools)


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
