"""Text -> token ids: HF tokenizer loading, chat templates (ids -> text: engine.detokenizer).

Engines deal in token ids only; the frontends use this module to turn requests into ids.
Everything here is plain Python over a fast (Rust) tokenizer: no torch, no ray.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from engine.eos import model_eos_token_ids
from engine.errors import InvalidRequestError, ModelLoadError
from engine.validation import Text, validated

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
"""OpenAI's roles. "developer" is its newer name for "system", and is rendered as such: chat
templates written before it know only "system"."""
_TEMPLATE_ROLE = {"developer": "system"}
TEXT_ONLY = ("must be a string or a list of text parts {'type': 'text', 'text': str} "
             "(this server serves text-only models)")


class Tokenizer:
    """A loaded HF fast tokenizer plus the model's end-of-sequence ids."""

    def __init__(self, hf: Any, path: Path, eos_token_ids: frozenset[int]):
        self.hf = hf
        self.path = path
        self.name = path.name
        self.eos_token_ids = eos_token_ids
        self.vocab_size = len(hf)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos={sorted(self.eos_token_ids)})"

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # No "clean-up" of spaces before punctuation: it rewrites text the model wrote and
        # would make streamed text (engine.detokenizer) differ from the whole decode.
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template shows a request's tools to the model itself (a tokenizer may
        hold several named templates; transformers picks ``tool_use`` when tools are given)."""
        template = getattr(self.hf, "chat_template", None) or ""
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default") or ""
        return "tools" in template

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text the model's chat template makes of `messages` (and `tools`, OpenAI's
        function definitions: given to templates that render them, else described in a system
        message in the Hermes format that ``deployments.tools`` parses back)."""
        if not self.has_chat_template:
            raise InvalidRequestError(
                f"model {self.name!r} has no chat template: send a plain prompt (completions API) instead"
            )
        native = self.renders_tools
        clean = normalize_messages(messages, native_tools=native)
        extra = {}
        if tools and native:
            extra["tools"] = list(tools)
        elif tools:
            clean = with_tool_prompt(clean, tools)
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(
                clean, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except TemplateError as exc:
            # Templates raise to reject conversations they cannot render (e.g. role order).
            raise InvalidRequestError(f"messages rejected by the chat template: {exc}") from exc

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        # The template writes its own special tokens; adding BOS again would double it.
        return self.encode(text, add_special_tokens=False)


TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions you may call are "
    "described in <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a JSON "
    'object with the function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n'
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""How tools are described to a model whose template does not render them (the Hermes / Qwen form)."""


def with_tool_prompt(messages: list[dict], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    text = TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


MAX_JSON_DEPTH = 64
"""Deepest JSON a tool's schema or a call's arguments may nest: the template's ``tojson`` and
``json.dumps`` recurse, and a Python stack runs out near 1,000."""


def json_depth(value: Any) -> int:
    """How deep ``value`` (parsed JSON) nests, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


@validated(InvalidRequestError, extra="ignore")
class CalledFunction:
    name: Text = Field(min_length=1, max_length=64)
    arguments: Text = Field("{}", max_length=1 << 20)
    """A JSON object, as text (OpenAI's form)."""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            raise ValueError("must be a JSON object, as text") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object, as text")
        if json_depth(value) > MAX_JSON_DEPTH:
            raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
        return arguments

    def parsed(self) -> dict:
        return json.loads(self.arguments)


@validated(InvalidRequestError, extra="ignore")
class ToolCall:
    function: CalledFunction
    id: Text = Field("", max_length=256)
    type: Literal["function"] = "function"


@validated(InvalidRequestError, extra="ignore")  # OpenAI's other message fields (name, ...) change nothing here
class ChatMessage:
    role: Literal[CHAT_ROLES]
    content: Text = ""
    """A string, or OpenAI's content parts when they are all text (joined)."""
    tool_calls: tuple[ToolCall, ...] | None = Field(None, max_length=128)
    """An assistant's calls, as a response gave them (``arguments`` a JSON text)."""
    tool_call_id: Text | None = Field(None, max_length=256)
    """A ``tool`` message's answer to this call."""
    name: Text | None = Field(None, max_length=256)
    """A ``tool`` message's function (some templates show it)."""

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        if content is None:
            return ""
        if isinstance(content, list):
            if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(TEXT_ONLY)
            return "".join(p["text"] for p in content)
        return content


@validated(InvalidRequestError)
class _Conversation:
    messages: tuple[ChatMessage, ...] = Field(min_length=1)


def normalize_messages(messages: Any, native_tools: bool = True) -> list[dict[str, Any]]:
    """Validated chat messages (dicts or ``ChatMessage``) as the plain dicts templates render; errors
    name the field (``messages.1.role``). An assistant's tool calls go to templates that render them
    with their arguments as objects (as they expect); others get them as Hermes text."""
    out = []
    for m in _Conversation(messages=messages).messages:
        message: dict[str, Any] = {"role": _TEMPLATE_ROLE.get(m.role, m.role), "content": m.content}
        if m.tool_calls and native_tools:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.parsed()}} for c in m.tool_calls]
        elif m.tool_calls:
            message["content"] = "\n".join([m.content] * bool(m.content) + [
                f'<tool_call>\n{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}'
                f"\n</tool_call>" for c in m.tool_calls])
        if m.role == "tool" and native_tools:
            message.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None})
        elif m.role == "tool":  # the Hermes convention: a user turn, so role alternation holds
            message = {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
        out.append(message)
    return out


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer of a local HF model directory (never touches the network)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ModelLoadError(f"tokenizer directory {directory} does not exist")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... here
        raise ModelLoadError(
            f"no usable tokenizer in {directory} (expected tokenizer.json + tokenizer_config.json): {exc}"
        ) from exc
    if hf is None or not callable(getattr(hf, "encode", None)):
        raise ModelLoadError(f"no usable tokenizer in {directory}")
    return Tokenizer(hf, directory, model_eos_token_ids(directory, getattr(hf, "eos_token_id", None)))
