"""Tool calling on the chat API: the request's tools, the calls a model writes, parsed back.

A model is given the tools by its chat template (or, when the template has no place for them,
by a system message in the Hermes form: ``engine.tokenizer.TOOL_PROMPT``) and writes its calls
in its family's syntax; a parser per family turns them into OpenAI's ``tool_calls``:

- ``hermes`` (Hermes, Qwen 2.5/3, SmolLM, and any model given the Hermes prompt):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1-3.3): the whole reply is ``{"name": ..., "parameters": {...}}``.

``tool_choice: "required"`` or a named function is enforced with a grammar (structured outputs),
so the reply always parses; ``"auto"`` parses what the model chose to write; ``"none"`` leaves
the reply as text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.errors import BadRequest
from engine.structured import StructuredOutputs, grammar_problem
from engine.tokenizer import MAX_JSON_DEPTH, json_depth
from engine.validation import Bool, Str, Text

PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object (absent: no arguments)."""
    strict: Bool | None = None

    @field_validator("parameters")
    @classmethod
    def _shallow(cls, parameters: dict | None) -> dict | None:
        if parameters is not None and json_depth(parameters) > MAX_JSON_DEPTH:
            raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
        return parameters


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: FunctionDef


class _Name(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: _Name


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


_FIXED_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""As the Hermes and Llama formats write JSON: with any whitespace allowed a model can fill its
budget with it, and a call is re-serialized anyway."""


def forced_grammar(tools: tuple[ToolDef, ...], choice: ToolChoice, parallel: bool, parser: str) -> dict:
    """``structured_outputs`` that make the reply one call of the chosen tool(s), in ``parser``'s
    syntax; with ``required`` and ``parallel``, one or more (a named function is called once).
    Each tool's parameters stay the root of their own schema, so their ``$ref``s resolve."""
    chosen = [t for t in tools if isinstance(choice, str) or t.function.name == choice.function.name]
    key = "parameters" if parser == "llama3_json" else "arguments"
    rules = []
    for i, tool in enumerate(chosen):
        params = {**(tool.function.parameters or {"type": "object", "properties": {}}), "x-guidance": _FIXED_SEPARATORS}
        head = json.dumps(f'{{"name": "{tool.function.name}", "{key}": ')  # names are [A-Za-z0-9_.-]
        rules.append(f'call{i}: {head} args{i} "}}"\nargs{i}: %json {json.dumps(params)}')
    body = "body: " + " | ".join(f"call{i}" for i in range(len(chosen)))
    if parser == "llama3_json":
        return {"grammar": "\n".join(["start: body", body, *rules])}
    repeat = "+" if parallel and choice == "required" else ""
    return {"grammar": "\n".join([f'start: (call "\\n"?){repeat}', 'call: "<tool_call>\\n" body "\\n</tool_call>"',
                                   body, *rules])}


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools change: the grammar of a forced call, the tools the chat template
    shows, and the parser the reply is read with (None when nothing is read)."""

    structured_outputs: dict | None = None
    template_tools: tuple[dict, ...] | None = None
    parser: str | None = None
    single: bool = False
    """``parallel_tool_calls: false``: only a reply's first call is kept."""

    def streams(self, n: int) -> "list[ToolStream] | None":
        """A ``ToolStream`` for each of a streamed reply's ``n`` choices; None when nothing is read."""
        return [ToolStream(self.parser, self.single) for _ in range(n)] if self.parser else None


def tool_use(tools: tuple[ToolDef, ...] | None, choice: ToolChoice | None, parallel: bool | None,
             parser: str, constrained: bool) -> ToolUse:
    """``constrained``: the request already has response_format or structured_outputs."""
    if not tools or choice == "none":
        return ToolUse()
    forced = None
    if choice not in (None, "auto"):
        if constrained:
            raise BadRequest("tool_choice forces a call, which response_format or structured_outputs would "
                             "constrain too: give one of them", param="tool_choice")
        forced = forced_grammar(tools, choice, parallel is not False, parser)  # depth-checked schemas
        problem = grammar_problem(StructuredOutputs(**forced))
        if problem is not None:
            raise BadRequest(f"tools: the chosen functions' parameters cannot be followed: {problem}",
                             param="tools")
    return ToolUse(forced, tuple(t.model_dump(exclude_none=True) for t in tools), parser, parallel is False)


@dataclass
class ToolCalls:
    """A reply split into its text and its calls (OpenAI's ``tool_calls`` entries)."""

    content: str | None
    calls: list[dict] = field(default_factory=list)


def _call(name: Any, arguments: Any) -> dict | None:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str, parser: str, single: bool = False) -> ToolCalls:
    """The calls in a whole reply (``single``: the first only); a reply that does not parse stays text."""
    parsed = _llama3(text) if parser == "llama3_json" else _hermes(text)
    if single and len(parsed.calls) > 1:
        return ToolCalls(parsed.content, parsed.calls[:1])
    return parsed


def _llama3(text: str) -> ToolCalls:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return ToolCalls(text)
    call = _call(value.get("name"), value.get("parameters", value.get("arguments"))) \
        if isinstance(value, dict) else None
    return ToolCalls(None, [call]) if call else ToolCalls(text)


def _hermes(text: str) -> ToolCalls:
    # str.find, not a regex: an opened block that never closes must cost linear time, not cubic.
    calls, rest, pos = [], [], 0
    while (start := text.find(_HERMES_OPEN, pos)) >= 0:
        end = text.find(_HERMES_CLOSE, start)
        if end < 0:
            break
        try:
            value = json.loads(text[start + len(_HERMES_OPEN):end])
        except (ValueError, RecursionError):
            return ToolCalls(text)
        call = _call(value.get("name"), value.get("arguments")) if isinstance(value, dict) else None
        if call is None:
            return ToolCalls(text)
        rest.append(text[pos:start] if not calls else text[pos:start].lstrip())
        calls.append(call)
        pos = end + len(_HERMES_CLOSE)
    if not calls:
        return ToolCalls(text)
    content = "".join(rest + [text[pos:].lstrip()]).strip()
    return ToolCalls(content or None, calls)


class ToolStream:
    """Streamed replies: text goes out as it comes until it may be a call; from there it is held
    and parsed at the end (OpenAI clients take a call's deltas whole as well as in pieces)."""

    def __init__(self, parser: str, single: bool = False) -> None:
        self.parser = parser
        self.single = single
        self._pending = ""  # text not yet streamed and not yet known to be a call
        self._held: list[str] | None = None  # set once a call may have begun
        self._plain = False  # llama3_json: the reply began with something other than "{"

    def push(self, text: str) -> str:
        """What of ``text`` can be streamed now."""
        if self._held is not None:
            self._held.append(text)
            return ""
        pending, self._pending = self._pending + text, ""
        if self.parser == "llama3_json":
            if self._plain:
                return pending
            if not pending.strip():
                self._pending = pending
                return ""
            if pending.lstrip().startswith("{"):
                self._held = [pending]
                return ""
            self._plain = True
            return pending
        start = pending.find(_HERMES_OPEN)
        if start >= 0:
            self._held = [pending[start:]]
            return pending[:start]
        keep = _partial_suffix(pending, _HERMES_OPEN)
        self._pending = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def finish(self) -> ToolCalls:
        """The held text, parsed: its calls, and whatever of it was text after all."""
        if self._held is None:
            return ToolCalls(self._pending or None)
        return parse_tool_calls("".join(self._held), self.parser, self.single)

    def step(self, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """One streamed delta: the text to send now and, on the last one, the calls parsed out and
        the finish reason (``tool_calls_reason``)."""
        out = self.push(text)
        if finish_reason is None:
            return out, [], None
        parsed = self.finish()
        return out + (parsed.content or ""), parsed.calls, tool_calls_reason(finish_reason, parsed)


def tool_calls_reason(reason: str | None, parsed: ToolCalls) -> str | None:
    """OpenAI's ``tool_calls`` when a reply that ended on its own holds calls."""
    return "tool_calls" if parsed.calls and reason == "stop" else reason


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (it may be completed next)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
