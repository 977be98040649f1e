"""Anthropic's Messages API request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``),
mapped onto the chat path: the responses are ``deployments.anthropic_responses``.

A Messages conversation is the chat one written differently, so it becomes the same
``GenerateInput`` a chat completion does:

- ``system`` (a string or text blocks) is the first message;
- an assistant's ``tool_use`` blocks are its tool calls; a user's ``tool_result`` blocks are
  ``tool`` messages answering them, before whatever text the user turn adds;
- ``tools`` (``name``, ``description``, ``input_schema``) are function tools, and ``tool_choice``
  ``auto``/``any``/``tool``/``none`` are chat's ``auto``/``required``/named/``none``
  (``disable_parallel_tool_use`` is ``parallel_tool_calls: false``);
- ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` and ``max_tokens`` (required, as in
  Anthropic's API) are the sampling fields of the same names (Anthropic's newest SDKs no longer
  send the middle three; older clients and vLLM's do);
- ``output_config.format`` (a JSON schema) is structured outputs.

Images, documents and extended thinking are refused by name: the served models read text only.
Errors name the field as Anthropic's clients send it (``messages.1.content.0.tool_use_id``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, ValidationInfo, field_validator

from deployments.errors import BadRequest
from deployments.http_common import ParsedBody, model_id, validate_body
from deployments.requests import MAX_MESSAGES, GenerateInput, Unread, kind_tag, parse_messages
from deployments.tools import MAX_TOOLS, FunctionDef, NamedToolChoice, ToolDef, tool_use
from engine.structured import StructuredOutputs, grammar_problem
from engine.tokenizer import MAX_JSON_DEPTH, json_depth
from engine.validation import Bool, Int, Str, Text, union_tag

class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_control: dict[str, Any] | None = None
    """Accepted and not needed: every prompt's blocks are cached automatically."""


class TextBlock(_Block):
    type: Literal["text"]
    text: Text
    citations: list[Any] | None = None


def _as_blocks(content: Any) -> Any:
    """A bare string is one text block, as Anthropic reads it."""
    return ({"type": "text", "text": content},) if isinstance(content, str) else content


TextBlocks = Annotated[tuple[TextBlock, ...], BeforeValidator(_as_blocks)]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Str = Field(min_length=1, max_length=256)
    name: Str = Field(min_length=1, max_length=64)
    input: dict[str, Any]

    @field_validator("input")
    @classmethod
    def _shallow(cls, value: dict) -> dict:
        if json_depth(value) > MAX_JSON_DEPTH:
            raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
        return value


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Str = Field(min_length=1, max_length=256)
    content: TextBlocks = ()
    is_error: Bool | None = None


def _block_kind(block: Any) -> str:
    return kind_tag(block, ("text", "tool_use", "tool_result"))


Block = Annotated[Union[Annotated[TextBlock, union_tag("text")], Annotated[ToolUseBlock, union_tag("tool_use")],
                        Annotated[ToolResultBlock, union_tag("tool_result")], Annotated[Unread, union_tag("other")]],
                  Discriminator(_block_kind)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["user", "assistant"]
    content: Annotated[tuple[Block, ...], BeforeValidator(_as_blocks)]

    @field_validator("content")
    @classmethod
    def _blocks_of_their_role(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        for i, block in enumerate(content):
            if (block.type == "tool_use" and role != "assistant") or (block.type == "tool_result" and role != "user"):
                raise ValueError(f"block {i}: {block.type} blocks belong to "
                                 f"{'assistant' if block.type == 'tool_use' else 'user'} messages")
        return content


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    def as_function(self) -> ToolDef:
        return ToolDef(type="function", function=FunctionDef(name=self.name, description=self.description,
                                                             parameters=self.input_schema))


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["auto", "any", "tool", "none"]
    name: Str | None = None
    disable_parallel_tool_use: Bool | None = None

    @field_validator("name")
    @classmethod
    def _only_for_tool(cls, name: str | None, info: ValidationInfo) -> str | None:
        if (name is not None) != (info.data.get("type") == "tool"):
            raise ValueError("is required with type 'tool', and only then")
        return name


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    type: Literal["disabled", "adaptive"]
    """The served models do not think: ``adaptive`` (the model decides) is accepted, a budget is not."""


class JsonFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_")
    @classmethod
    def _followable(cls, schema: dict) -> dict:
        problem = grammar_problem(StructuredOutputs(json=schema))
        if problem is not None:
            raise ValueError(f"cannot be followed: {problem}")
        return schema


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: JsonFormat | None = None
    """The reply is JSON under this schema (structured outputs)."""
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """No effect: the served models do not think."""


class _Conversation(BaseModel):
    """What both endpoints read: the prompt as the chat template renders it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Any = Field(description="a model id from /v1/models")
    messages: tuple[Message, ...] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: TextBlocks | None = None
    tools: tuple[Tool, ...] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    _model_id = field_validator("model")(model_id)

    @field_validator("tool_choice")
    @classmethod
    def _known_tool(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = [t.name for t in info.data.get("tools") or ()]
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError("needs tools to choose from")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"names {choice.name!r}, which is not among the tools")
        return choice

    def chat_messages(self) -> tuple:
        """The conversation as chat messages (``engine.tokenizer.ChatMessage``)."""
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system)})
        for message in self.messages:
            out.extend(_chat_turn(message))
        return parse_messages(out)

    def tool_use(self, parser: str, constrained: bool = False):
        tools = tuple(t.as_function() for t in self.tools) if self.tools else None
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            chat_choice = None
        elif choice.type == "tool":
            chat_choice = NamedToolChoice(type="function", function={"name": choice.name})
        else:
            chat_choice = {"any": "required", "none": "none"}[choice.type]
        if constrained and choice is not None and choice.type in ("any", "tool"):
            raise BadRequest("tool_choice forces a call, which output_config.format would constrain too: give one "
                             "of them", param="tool_choice")
        parallel = None if choice is None or choice.disable_parallel_tool_use is None \
            else not choice.disable_parallel_tool_use
        return tool_use(tools, chat_choice, parallel, parser, constrained)


class MessagesRequest(_Conversation):
    max_tokens: Int = Field(ge=1)
    stop_sequences: tuple[Str, ...] | None = None
    stream: Bool | None = False
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    output_config: OutputConfig | None = None
    # no effect on the output
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: Str | None = None
    cache_control: dict[str, Any] | None = None
    """Every prompt's blocks are cached automatically."""

    def sampling(self) -> dict[str, Any]:
        fields = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k") if getattr(self, k) is not None}
        fields["max_tokens"] = self.max_tokens
        if self.stop_sequences:
            fields["stop"] = list(self.stop_sequences)
        if self.output_config is not None and self.output_config.format is not None:
            fields["structured_outputs"] = {"json": self.output_config.format.schema_}
        return fields


class CountTokensRequest(_Conversation):
    pass


def _text(blocks: tuple[TextBlock, ...]) -> str:
    return "".join(b.text for b in blocks)


def _chat_turn(message: Message) -> list[dict]:
    texts = "".join(b.text for b in message.content if b.type == "text")
    if message.role == "assistant":
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(
            b.input, ensure_ascii=False)}} for b in message.content if b.type == "tool_use"]
        return [{"role": "assistant", "content": texts, **({"tool_calls": calls} if calls else {})}]
    # A user turn answers the calls first (Anthropic puts the results first), then says more.
    turn = [{"role": "tool", "tool_call_id": b.tool_use_id,
             "content": ("error: " if b.is_error else "") + _text(b.content)}
            for b in message.content if b.type == "tool_result"]
    if texts or not turn:
        turn.append({"role": "user", "content": texts})
    return turn


def parse_messages_body(body: Any, request_id: str | None = None, tool_parser: str = "hermes") -> ParsedBody:
    req = validate_body(MessagesRequest, body)
    sampling = req.sampling()
    tools = req.tool_use(tool_parser, constrained="structured_outputs" in sampling)
    if tools.structured_outputs is not None:
        sampling["structured_outputs"] = tools.structured_outputs
    inp = GenerateInput(messages=req.chat_messages(), sampling=sampling, tools=tools.template_tools, model=req.model,
                        request_id=request_id)
    return ParsedBody(inp, bool(req.stream), False, tools)


def parse_count_tokens_body(body: Any, tool_parser: str = "hermes") -> tuple[str, tuple, tuple | None]:
    """(model, chat messages, the tools the template shows) of a count_tokens body."""
    req = validate_body(CountTokensRequest, body)
    return req.model, req.chat_messages(), req.tool_use(tool_parser).template_tools

