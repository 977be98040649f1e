"""OpenAI request bodies (completions and chat); the responses are ``deployments.openai_responses``.

The request bodies are pydantic models: every error is a ``BadRequest`` naming the
field as OpenAI's ``param`` (``messages.0.role``). vLLM's extra sampling fields (top_k,
min_p, repetition_penalty, seed, ignore_eos, min_tokens, stop_token_ids, priority, ...)
are accepted next to OpenAI's and checked by ``SamplingParams``; fields that would
change the meaning of a request but are not served (best_of, suffix) are refused
by name instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from deployments.errors import BadRequest
from deployments.requests import GenerateInput, Messages, bad_request
from deployments.tools import MAX_TOOLS, NamedToolChoice, ToolChoice, ToolDef, ToolUse, tool_use
from engine.structured import StructuredOutputs, grammar_problem
from engine.validation import Bool, Str, field_errors

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


def model_id(model: Any) -> Any:
    """Any string goes on: one not served is NOT_FOUND (the frontend's check), not a bad request."""
    if not isinstance(model, str) or not model:
        raise ValueError("must be a model id from /v1/models")
    return model


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


@dataclass(frozen=True)
class ParsedBody:
    input: GenerateInput
    stream: bool
    include_usage: bool
    tools: ToolUse = ToolUse()
    """How the reply is read for tool calls (``deployments.tools``; nothing read by default)."""
    echo: bool = False
    """Completions: the prompt comes back before each choice's text (and logprobs)."""


def validate_body(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    unknown = [k for k in body if k not in model.model_fields]
    if unknown:  # here, not by pydantic: a key with a lone surrogate would lose its name there
        raise BadRequest(f"unknown field {unknown[0]}; allowed: {', '.join(model.model_fields)}", param=unknown[0])
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise bad_request(field_errors(exc, model)) from None


class LoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: Str = Field(min_length=1, max_length=128)
    lora_path: Str | None = Field(None, min_length=1, max_length=4096)
    load_inplace: Literal[False] = False
    """vLLM's in-place reload is not served: unload, then load."""

    @classmethod
    def parse(cls, body: Any) -> "LoRAAdapterRequest":
        return validate_body(cls, body)


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
