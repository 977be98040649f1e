"""Streamed token ids to text: one pipeline for the offline ``LLM`` and serving alike.

``IncrementalDetokenizer`` runs tokenizers' ``DecodeStream`` on a fast tokenizer's Rust
backend (for slow tokenizers, the same windowed decoding over ``decode``): each step
decodes a short window and holds back text ending in U+FFFD, a multi-byte character
still arriving. ``StopStringMatcher`` finds stop strings in that text; ``TextStream``
runs both token by token, so a stop string ends the output at the token completing it.
Everything here is plain Python over the tokenizer: no torch, no ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable

from tokenizers.decoders import DecodeStream

from engine.errors import InvalidRequestError

_REPLACEMENT = "\ufffd"  # what byte-level and byte-fallback decoders make of an unfinished character
# A UTF-8 character is at most 4 bytes and a token adds at least one, so a window still
# ending in U+FFFD this many tokens on holds invalid bytes, not a character in progress.
_MAX_HOLD_TOKENS = 8
# The unfinished character at the end is at most 3 bytes, so within the last 3 tokens.
_UNSTABLE_TOKENS = 3
# Ids kept as decoding context, so the next token keeps its leading space.
_CONTEXT_TOKENS = 5


class _WindowStream:
    """``DecodeStream``'s contract over a plain ``decode`` (slow tokenizers): ``step`` returns
    the text the ids complete, or None while the window ends inside a character."""

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(context)
        self._read = len(self._ids)  # ids before this are the context of the next step
        self._prefix = len(decode(self._ids)) if self._ids else 0

    def step(self, ids: list[int]) -> str | None:
        self._ids.extend(ids)
        text = self._decode(self._ids)
        if text.endswith(_REPLACEMENT) or len(text) <= self._prefix:
            return None
        chunk = text[self._prefix:]
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix = len(self._decode(self._ids))
        return chunk


class _RustStream:
    def __init__(self, backend: Any, skip_special_tokens: bool, context: Sequence[int]) -> None:
        self._backend = backend
        self._stream = DecodeStream(ids=list(context) or None, skip_special_tokens=skip_special_tokens)

    def step(self, ids: list[int]) -> str | None:
        return self._stream.step(self._backend, ids)


class IncrementalDetokenizer:
    """Token ids in, text out, as it becomes final. All pieces plus ``flush()`` equal
    ``tokenizer.decode(all_ids)``; no piece splits a character.

    ``context_ids`` (the prompt's last ids) let the first output token decode as it would
    after them (a "▁word" token keeps its space). Invalid bytes held for
    ``_MAX_HOLD_TOKENS`` tokens are let out and the stream restarts after them, so a
    stream of garbage costs constant work per token.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()) -> None:
        backend = getattr(getattr(tokenizer, "hf", None), "backend_tokenizer", None)
        if backend is not None:
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
            self._new_stream = lambda context: _RustStream(backend, skip_special_tokens, context)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            self._new_stream = lambda context: _WindowStream(self._decode, context)
        context = self._clean_context(list(context_ids))
        self._context = context  # ids whose text is out: what the pending ones decode after
        self._pending: list[int] = []  # ids whose text is held back
        self._next_resync = _MAX_HOLD_TOKENS
        self._stream = self._new_stream(context)

    @property
    def held_tokens(self) -> int:
        return len(self._pending)

    def push(self, ids: Iterable[int]) -> str:
        """Add generated ids; return the text they completed (possibly empty)."""
        pieces = []
        for token_id in ids:  # one at a time: text before an unfinished character goes out now
            self._pending.append(token_id)
            chunk = self._stream.step([token_id])
            if chunk is not None:
                self._settle()
                pieces.append(chunk)
            elif len(self._pending) > self._next_resync:
                pieces.append(self._resync())
        return "".join(pieces)

    def flush(self) -> str:
        """At the end of generation: whatever was held back, as decoded."""
        if not self._pending:
            return ""
        text = self._text(self._context, self._pending)
        self._context, self._pending = self._clean_context(self._context + self._pending), []
        self._stream = self._new_stream(self._context)
        return text

    def _settle(self) -> None:
        self._context = (self._context + self._pending)[-_CONTEXT_TOKENS:]
        self._pending = []
        self._next_resync = _MAX_HOLD_TOKENS

    def _clean_context(self, ids: list[int]) -> list[int]:
        context = ids[-_CONTEXT_TOKENS:]
        if context and self._decode(context).endswith(_REPLACEMENT):
            return []  # ending inside a character (or in invalid bytes) would skew the text arithmetic
        return context

    def _text(self, context: list[int], ids: list[int]) -> str:
        """What ``ids`` add to the text after ``context``."""
        return self._decode(context + ids)[len(self._decode(context)):] if context else self._decode(ids)

    def _resync(self) -> str:
        """After a long hold: let out the text before the last few tokens, which no later byte
        can change, and restart the stream there. The cut is at a token where decoding splits
        cleanly (head + tail == whole), so the pieces still add up to the whole decode."""
        whole = self._text(self._context, self._pending)
        for j in range(len(self._pending) - _UNSTABLE_TOKENS, 0, -1):
            head_ids, tail_ids = self._pending[:j], self._pending[j:]
            head = self._text(self._context, head_ids)
            context = self._clean_context(self._context + head_ids)
            if head + self._text(context, tail_ids) == whole:
                self._context, self._pending = context, []
                self._next_resync = _MAX_HOLD_TOKENS
                self._stream = self._new_stream(context)
                return head + self.push(tail_ids)
        self._next_resync += _MAX_HOLD_TOKENS  # no clean cut yet: try again a few tokens on
        return ""


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


class TextStream:
    """One request's output: ids in, text out, through the detokenizer and stop strings."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, context_ids: Sequence[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, context_ids)
        self._stop = StopStringMatcher(stop, include_stop_str_in_output) if stop else None

    @classmethod
    def for_params(cls, tokenizer: Any, params: Any, context_ids: Sequence[int] = ()) -> "TextStream":
        """From a request's SamplingParams (skip_special_tokens, stop, include_stop_str_in_output)."""
        return cls(tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output, context_ids)

    @property
    def stopped(self) -> bool:
        return self._stop is not None and self._stop.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return None if self._stop is None else self._stop.stop_reason

    def push(self, ids: Sequence[int]) -> tuple[str, int]:
        """The text ``ids`` complete, and how many of them count: all of them, or up to the
        one that completed a stop string (the rest were never part of the output)."""
        if self.stopped:
            return "", 0
        if self._stop is None:
            return self._detok.push(ids), len(ids)
        pieces = []
        for n, token_id in enumerate(ids, 1):  # one at a time: the stop lands on its token
            text, stopped = self._stop.push(self._detok.push((token_id,)))
            pieces.append(text)
            if stopped:
                return "".join(pieces), n
        return "".join(pieces), len(ids)

    def finish(self) -> str:
        """At the end: what the detokenizer held (an unfinished character), then what the
        stop matcher held (it never became a stop string)."""
        if self.stopped:
            return ""
        text = self._detok.flush()
        if self._stop is None:
            return text
        text, _ = self._stop.push(text)
        return text + self._stop.flush()
