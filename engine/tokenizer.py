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

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template makes of `messages`."""
        if not self.has_chat_template:
            raise InvalidRequestError(
                f"model {self.name!r} has no chat template: send a plain prompt (completions API) instead"
            )
        clean = normalize_messages(messages)
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(
                clean, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError as exc:
            # Templates raise to reject conversations they cannot render (e.g. role order).
            raise InvalidRequestError(f"messages rejected by the chat template: {exc}") from exc

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        # The template writes its own special tokens; adding BOS again would double it.
        return self.encode(text, add_special_tokens=False)


@validated(InvalidRequestError, extra="ignore")  # OpenAI's other message fields (name, ...) change nothing here
class ChatMessage:
    role: Literal[CHAT_ROLES]
    content: Text = ""
    """A string, or OpenAI's content parts when they are all text (joined)."""

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


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Validated chat messages (dicts or ``ChatMessage``) as the plain {"role", "content"}
    dicts templates render; errors name the field (``messages.1.role``)."""
    return [{"role": _TEMPLATE_ROLE.get(m.role, m.role), "content": m.content}
            for m in _Conversation(messages=messages).messages]


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
    return Tokenizer(hf, directory, _eos_token_ids(hf, directory))


def _eos_token_ids(hf: Any, directory: Path) -> frozenset[int]:
    ids = set(_as_ids(getattr(hf, "eos_token_id", None)))
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{file} is not readable JSON: {exc}") from exc
        if isinstance(data, dict):
            ids.update(_as_ids(data.get("eos_token_id")))
    return frozenset(ids)


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value] if value >= 0 else []
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return []
