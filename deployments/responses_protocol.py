"""OpenAI's Responses API request body (``POST /v1/responses``), mapped onto the chat path: the
replies are ``deployments.responses_output``, the stored conversations ``deployments.responses_store``.

A Responses conversation is a chat conversation written as items:

- ``input`` is a string (one user message) or a list of items: messages (``input_text`` parts, or an
  assistant's ``output_text``), ``function_call`` (the assistant's tool calls) and
  ``function_call_output`` (a ``tool`` message answering ``call_id``);
- ``instructions`` is a system message first, for this response only (not carried over by
  ``previous_response_id``, as OpenAI documents);
- ``previous_response_id`` puts the stored conversation (that response's input and output) before
  ``input``;
- function ``tools`` (``name``, ``description``, ``parameters``, ``strict``) and ``tool_choice`` are
  chat's, in the flat form; ``text.format`` is structured outputs; ``max_output_tokens``,
  ``temperature`` and ``top_p`` are the sampling fields.

Images, files, reasoning items, hosted tools (web search, file search, MCP, ...), ``background``
and ``truncation: auto`` are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, ValidationInfo, field_validator

from deployments.http_common import model_id, validate_body
from deployments.requests import MAX_MESSAGES, GenerateInput, Unread, kind_tag, parse_messages
from deployments.tools import MAX_TOOLS, FunctionDef, NamedToolChoice, ToolDef, ToolUse, tool_use
from engine.structured import StructuredOutputs, grammar_problem
from engine.validation import Bool, Int, Str, Text, union_tag

class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _as_parts(content: Any) -> Any:
    return ({"type": "input_text", "text": content},) if isinstance(content, str) else content


def _part_kind(part: Any) -> str:
    return kind_tag(part, ("input_text", "output_text"))


Part = Annotated[Union[Annotated[_Part, union_tag("input_text")], Annotated[_Part, union_tag("output_text")],
                       Annotated[Unread, union_tag("other")]], Discriminator(_part_kind)]


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[tuple[Part, ...], BeforeValidator(_as_parts)]
    id: Str | None = None
    status: Str | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["function_call"]
    call_id: Str = Field(min_length=1, max_length=256)
    name: Str = Field(min_length=1, max_length=64)
    arguments: Text
    id: Str | None = None
    status: Str | None = None
    # the output item's other fields, sent back as they came: no effect here
    namespace: Str | None = None
    caller: dict[str, Any] | None = None
    async_: Bool | None = Field(None, alias="async")


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function_call_output"]
    call_id: Str = Field(min_length=1, max_length=256)
    output: Annotated[tuple[_Part, ...], BeforeValidator(_as_parts)]
    id: Str | None = None
    status: Str | None = None


def _item_kind(item: Any) -> str:
    return kind_tag(item, ("message", "function_call", "function_call_output"), default="message")


Item = Annotated[Union[Annotated[MessageItem, union_tag("message")],
                       Annotated[FunctionCallItem, union_tag("function_call")],
                       Annotated[FunctionCallOutputItem, union_tag("function_call_output")],
                       Annotated[Unread, union_tag("other")]], Discriminator(_item_kind)]


def _as_items(value: Any) -> Any:
    """A bare string is one user message."""
    return ({"type": "message", "role": "user", "content": value},) if isinstance(value, str) else value


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    name: Str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None

    def as_chat(self) -> ToolDef:
        return ToolDef(type="function", function=FunctionDef(name=self.name, description=self.description,
                                                             parameters=self.parameters, strict=self.strict))


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    name: Str


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON under a schema (flat, as this API writes it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: Bool | None = None

    @field_validator("schema_")
    @classmethod
    def _followable(cls, schema: dict | None) -> dict | None:
        problem = None if schema is None else grammar_problem(StructuredOutputs(json=schema))
        if problem is not None:
            raise ValueError(f"cannot be followed: {problem}")
        return schema

    def structured(self) -> dict | None:
        if self.type == "json_object" or (self.type == "json_schema" and self.schema_ is None):
            return {"json_object": True}
        return {"json": self.schema_} if self.type == "json_schema" else None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """No effect."""


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Any = Field(description="a model id from /v1/models")
    input: Annotated[tuple[Item, ...], BeforeValidator(_as_items)] = Field(min_length=1, max_length=MAX_MESSAGES)
    instructions: Text | None = None
    previous_response_id: Str | None = Field(None, min_length=1, max_length=256)
    store: Bool | None = True
    stream: Bool | None = False
    tools: tuple[FunctionTool, ...] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: Bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Any = None
    top_p: Any = None
    truncation: Literal["disabled"] | None = None
    """``auto`` (dropping the conversation's middle to fit) is not served: a prompt too long is a 400."""
    background: Literal[False] | None = None
    """Background responses are not served: the response comes back on this connection."""
    # no effect on the output
    metadata: dict[Str, Str] | None = Field(None, max_length=16)
    user: Str | None = None
    safety_identifier: Str | None = None
    prompt_cache_key: Str | None = None
    service_tier: Str | None = None
    include: tuple[Str, ...] | None = None
    reasoning: dict[str, Any] | None = None

    _model_id = field_validator("model")(model_id)

    @field_validator("tool_choice")
    @classmethod
    def _known_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.name for t in info.data.get("tools") or ()]
        if (isinstance(choice, NamedFunction) or choice == "required") and not names:
            raise ValueError("needs tools to choose from")
        if isinstance(choice, NamedFunction) and choice.name not in names:
            raise ValueError(f"names {choice.name!r}, which is not among the tools")
        return choice

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, reasoning: dict | None) -> dict | None:
        if reasoning and any(v is not None for v in reasoning.values()):
            raise ValueError("is not supported: the served models do not reason")
        return reasoning

    def sampling(self) -> dict[str, Any]:
        fields = {k: getattr(self, k) for k in ("temperature", "top_p") if getattr(self, k) is not None}
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.structured() is not None:
            fields["structured_outputs"] = fmt.structured()
        return fields

    def tool_use(self, parser: str, constrained: bool) -> ToolUse:
        tools = tuple(t.as_chat() for t in self.tools) if self.tools else None
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = NamedToolChoice(type="function", function={"name": choice.name})
        return tool_use(tools, choice, self.parallel_tool_calls, parser, constrained)


def items_as_chat(items: tuple) -> list[dict]:
    """Input items as chat messages (plain dicts, as ``parse_messages`` takes them): consecutive
    function calls join one assistant message, as a chat reply holds them."""
    out: list[dict] = []
    for item in items:
        if item.type == "message":
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": "".join(p.text for p in item.output)})
    return out


@dataclass(frozen=True)
class ParsedResponses:
    conversation: list[dict]
    """Chat messages this response continues from: the stored ones, then ``input`` (no instructions)."""
    input: GenerateInput
    tools: ToolUse


def parse_responses_body(body: Any) -> ResponsesRequest:
    return validate_body(ResponsesRequest, body)


def responses_input(req: ResponsesRequest, earlier: list[dict] | None, request_id: str | None = None,
                    tool_parser: str = "hermes") -> ParsedResponses:
    """``earlier``: the conversation stored under ``previous_response_id`` (the caller looks it up)."""
    conversation = [*(earlier or ()), *items_as_chat(req.input)]
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = parse_messages(system + conversation)
    sampling = req.sampling()
    tools = req.tool_use(tool_parser, constrained="structured_outputs" in sampling)
    if tools.structured_outputs is not None:
        sampling["structured_outputs"] = tools.structured_outputs
    inp = GenerateInput(messages=messages, sampling=sampling, tools=tools.template_tools, model=req.model,
                        request_id=request_id)
    return ParsedResponses(conversation, inp, tools)

