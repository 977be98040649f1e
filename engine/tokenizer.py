"""Text <-> token ids: HF tokenizer loading, chat templates, streaming detokenization, stop strings.

Engines deal in token ids only; the frontends use this module to turn requests into ids
and streamed ids back into text. Everything here is plain Python over a fast (Rust)
tokenizer: no torch, no ray.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError, ModelLoadError

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
"""OpenAI's roles. "developer" is its newer name for "system", and is rendered as such: chat
templates written before it know only "system"."""
_TEMPLATE_ROLE = {"developer": "system"}

# Byte-level and byte-fallback decoders render an incomplete UTF-8 sequence as U+FFFD.
_REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes and a byte token adds at least one, so a window
# still ending in U+FFFD this many tokens after it started holds invalid bytes, not just a
# character in progress: then the window is cut short so it cannot grow without bound.
_MAX_HOLD_TOKENS = 8
# The unfinished character at the end is at most 3 bytes: at most 3 replacement characters
# (one per byte with byte-fallback decoders, one in all with lossy UTF-8 decoding).
_MAX_UNSTABLE_CHARS = 3
# Prompt tokens kept as decoding context, so the first output token keeps its leading space.
_CONTEXT_TOKENS = 5


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
        # would make streamed text (decoded in windows) differ from the whole decode.
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


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Validated chat messages as plain {"role", "content"} dicts.

    content is a string, or a list of OpenAI-style text parts {"type": "text", "text": ...}
    which are joined. Other keys are dropped: templates here render role and content only.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of {'role', 'content'} objects")
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}"
            )
        clean.append({"role": _TEMPLATE_ROLE.get(role, role), "content": _content_text(message.get("content"), i)})
    return clean


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': str}}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(
        f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}"
    )


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


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, one push per engine message.

    Each push decodes only a small window: the tokens of the previous emission (context,
    so merges and leading spaces come out as in a whole decode) plus the new ones, and
    emits the part of the window's text past the context. Text ending in U+FFFD (an
    unfinished multi-byte character) is held back until the character completes, so no
    piece ever splits a character. The concatenation of all pieces plus `flush()` equals
    `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(context_ids)[-_CONTEXT_TOKENS:]
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # a prompt cut inside a character would skew the window arithmetic
        self._ids: list[int] = context
        self._prefix = 0  # window start
        self._read = len(context)  # tokens before this are fully emitted
        self._prefix_len = len(self._decode(context)) if context else 0
        self._sent = 0  # characters of the window past the prefix text already emitted
        self._held_since: int | None = None
        self._pieces: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, new_ids: Iterable[int]) -> str:
        """Add generated ids; return the text they completed (possibly empty)."""
        self._ids.extend(new_ids)
        if len(self._ids) == self._read:
            return ""
        window = self._decode(self._ids[self._prefix:])
        if not window.endswith(_REPLACEMENT):
            return self._emit(window, len(window), advance=True)
        if self._held_since is None:
            self._held_since = len(self._ids)
        piece = self._emit(window, len(window.rstrip(_REPLACEMENT)), advance=False)
        if len(self._ids) - self._held_since >= _MAX_HOLD_TOKENS:
            piece += self._rebase(window)
        return piece

    def flush(self) -> str:
        """At the end of generation: whatever was held back, as decoded."""
        if len(self._ids) == self._read:
            return ""
        window = self._decode(self._ids[self._prefix:])
        return self._emit(window, len(window), advance=True)

    def _rebase(self, window: str) -> str:
        """After a long hold: emit what is final and restart the window near its end.

        Only the last few characters can still change. The new window starts at a token
        boundary where decoding splits cleanly (head + tail == window), so the text
        already emitted past that boundary is still counted in `_sent`.
        """
        piece = self._emit(window, len(window) - _MAX_UNSTABLE_CHARS, advance=False)
        emitted = self._prefix_len + self._sent
        n = len(self._ids)
        self._held_since = n
        for j in range(n - 1, max(self._prefix, n - _MAX_HOLD_TOKENS), -1):
            head = self._decode(self._ids[self._prefix:j])
            if len(head) <= emitted and head + self._decode(self._ids[j:]) == window:
                self._prefix = self._read = j
                self._prefix_len, self._sent = 0, emitted - len(head)
                break
        return piece

    def _emit(self, window: str, end: int, advance: bool) -> str:
        start = self._prefix_len + self._sent
        piece = window[start:end] if end > start else ""
        if advance:
            # The whole window is out: the new ids become the next window's context.
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_len = len(self._decode(self._ids[self._prefix:self._read]))
            self._sent = 0
            self._held_since = None
        else:
            self._sent += len(piece)
        if piece:
            self._pieces.append(piece)
        return piece


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back what might begin one.

    The first stop string to *complete* wins (ties: the longer one), which is what a
    token-by-token stream would see, so results do not depend on how text is chunked.
    """

    def __init__(self, stop: str | Sequence[str] | None, include_stop_str_in_output: bool = False):
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop[{i}] must be a non-empty string, got {s!r}")
        self.stop = tuple(dict.fromkeys(stops))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._prefixes = frozenset(s[:k] for s in self.stop for k in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)
        self._held = ""
        self.stop_reason: str | None = None  # the stop string that matched

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        if not self.stop:
            return text, False
        buffer = self._held + text
        match = self._earliest_match(buffer)
        if match is not None:
            start, s = match
            self.stop_reason = s
            self._held = ""
            return buffer[: start + len(s) if self.include_stop_str_in_output else start], True
        hold = self._held_suffix_len(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At the end of generation: the held-back text (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for s in self.stop:
            start = buffer.find(s)
            if start >= 0:
                key = (start + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, s = best
        return end + neg_len, s

    def _held_suffix_len(self, buffer: str) -> int:
        for k in range(min(self._max_hold, len(buffer)), 0, -1):
            if buffer[-k:] in self._prefixes:
                return k
        return 0
