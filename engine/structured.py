"""Structured outputs: a request's tokens held to a JSON schema, a regex, a choice or a grammar.

The grammar library is llguidance (one wheel, no dependencies; vLLM ships it as one of its
two backends). Each constrained request gets an ``LLMatcher``: before a step samples, the
matcher writes the request's allowed tokens into a bitmask row and the sampler masks the
logits with it; after, the sampled token advances the matcher. Requests without a grammar
pay nothing: the sampler only looks for matchers when a row has one.

A grammar stays right across preemption (the tokens it consumed stay the request's) and on
resume (the resumed tokens are consumed when the request is added). When the grammar is
complete the matcher allows only EOS, and the request ends with finish reason "stop".
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from engine.errors import InvalidRequestError
from engine.outputs import FINISH_ABORT, FINISH_STOP
from engine.validation import Bool, Text, validated

logger = logging.getLogger(__name__)

MAX_SPEC_CHARS = 64 * 1024
"""Longest schema, regex or grammar accepted (its JSON text, for a schema)."""
MAX_CHOICES = 256
KINDS = ("json", "regex", "choice", "grammar", "json_object")
CLEAN_MATCHERS = 64
"""Specs whose clean matcher is kept for the next request of the same spec."""


@validated(InvalidRequestError)
class StructuredOutputs:
    """vLLM's ``structured_outputs``: exactly one of the constraints below."""

    json: dict[str, Any] | Text | None = None
    """A JSON schema, as an object or as its JSON text."""
    regex: Text | None = Field(None, min_length=1, max_length=MAX_SPEC_CHARS)
    choice: tuple[Text, ...] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    """The output is one of these strings."""
    grammar: Text | None = Field(None, min_length=1, max_length=MAX_SPEC_CHARS)
    """A Lark grammar (llguidance's syntax; GBNF is accepted too)."""
    json_object: Bool | None = None
    """true: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"set exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"json must be a JSON schema, as an object or its JSON text ({exc})") from None
            if not isinstance(schema, dict):
                raise ValueError("json must be a JSON schema: an object, not a JSON " + type(schema).__name__)
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            if len(text) > MAX_SPEC_CHARS:
                raise ValueError(f"json schema has {len(text)} characters; the limit is {MAX_SPEC_CHARS}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, its text): what the compiled grammar is cached under."""
        value = getattr(self, self.kind)
        if self.kind == "json_object":
            return "json", '{"type": "object"}'
        if self.kind == "choice":
            return "choice", json.dumps(list(value))
        # Not sorted: a schema's key order is the order its JSON is generated in.
        return self.kind, value if isinstance(value, str) else json.dumps(value)


_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


@lru_cache(maxsize=512)
def _grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint, checked; raises ValueError saying what is wrong."""
    import llguidance
    from llguidance import LLMatcher

    grammar = llguidance.grammar_from(_FORMATS[kind], text)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError("; ".join(str(m).strip() for m in messages) or "rejected by the grammar compiler")
    return grammar


def grammar_problem(spec: StructuredOutputs) -> str | None:
    """Why the spec cannot be followed (a bad schema, regex or grammar), or None; for callers that
    name the field as their client sent it."""
    try:
        _grammar(*spec.key())
    except ValueError as exc:
        return str(exc)
    return None


def check(spec: StructuredOutputs) -> str:
    """The spec's compiled grammar (cached); raises InvalidRequestError naming the field when it
    cannot be followed."""
    try:
        return _grammar(*spec.key())
    except ValueError as exc:
        raise InvalidRequestError(f"structured_outputs.{spec.kind} cannot be followed: {exc}") from None


class GrammarBook:
    """Matchers for one model: its tokenizer as llguidance sees it (built on first use), and a clean
    matcher per recent spec that each request of it copies (building one can take milliseconds)."""

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._path = model_path
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None
        self._problem: str | None = None
        self._clean: OrderedDict[tuple[str, str], object] = OrderedDict()

    def _lltokenizer(self):
        if self._tokenizer is None and self._problem is None:
            import llguidance.hf
            from engine.tokenizer import load_tokenizer

            try:
                hf = load_tokenizer(self._path).hf
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self._vocab_size,
                                                              eos_token=self._eos or None)
            except Exception as exc:  # noqa: BLE001 - every constrained request is refused with it
                self._problem = f"structured_outputs need the model's tokenizer, which llguidance cannot use: {exc}"
        if self._problem is not None:
            raise InvalidRequestError(self._problem)
        return self._tokenizer

    def matcher(self, spec: StructuredOutputs, consumed: list[int]):
        """A new matcher for ``spec`` that has already consumed ``consumed`` (resumed tokens)."""
        from llguidance import LLMatcher

        key = spec.key()
        clean = self._clean.get(key)
        if clean is None:
            clean = LLMatcher(self._lltokenizer(), check(spec))
            if clean.is_error():
                raise InvalidRequestError(f"structured_outputs.{spec.kind} cannot be followed: {clean.get_error()}")
            self._clean[key] = clean
            if len(self._clean) > CLEAN_MATCHERS:
                self._clean.popitem(last=False)
        self._clean.move_to_end(key)
        matcher = clean.deep_copy()
        if consumed and not matcher.consume_tokens(consumed):
            raise InvalidRequestError(f"resume_token_ids do not follow structured_outputs.{spec.kind}: "
                                      f"{matcher.get_error()}")
        return matcher


_NEG_INF_BITS = -(1 << 23)
"""0xFF800000 as an int32: the bit pattern of float32 -inf."""


def grammar_step(req, tok: int) -> str | None:
    """Advance a request's grammar by its sampled token: FINISH_STOP once the grammar is complete,
    FINISH_ABORT when the matcher refused it (a limit hit), else None."""
    if not req.matcher.consume_token(tok):  # its mask allowed only EOS: the matcher failed (a limit hit)
        logger.error("request %s: token %d refused by its grammar (%s); ending it", req.request_id, tok,
                     req.matcher.get_error())
        return FINISH_ABORT
    return FINISH_STOP if req.matcher.is_stopped() else None


def mask_logits(logits, requests, offsets=None):
    """Each constrained row of ``logits`` limited to the tokens its matcher allows, in place (so the
    step's peak memory stays the sampler's filters', which the memory budget measures).

    ``offsets`` (a step verifying drafts, engine.spec_verify): a request's row at offset j samples
    after its first j draft tokens, so its mask is the matcher's after them. The matcher is advanced
    through the drafts (checked against the grammar when they were proposed) and rolled back."""
    import llguidance.torch as llt
    import torch

    rows = [i for i, r in enumerate(requests) if r.matcher is not None]
    bitmask = llt.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, i in enumerate(rows):
        matcher = requests[i].matcher
        ahead = offsets[i] if offsets is not None else 0
        if ahead:
            matcher.consume_token(requests[i].spec.drafts[ahead - 1])
        llt.fill_next_token_bitmask(matcher, bitmask, j)
        if ahead and (i + 1 == len(requests) or offsets[i + 1] == 0):  # the request's last row
            matcher.rollback(ahead)
    index = torch.tensor(rows)
    if logits.is_cuda:  # pinned, so neither copy waits for the device
        bitmask, index = (t.pin_memory().to(logits.device, non_blocking=True) for t in (bitmask, index))
    bias = mask_bias(bitmask, logits.shape[1])
    if len(rows) == logits.shape[0]:
        return logits.add_(bias)
    return logits.index_copy_(0, index, logits.index_select(0, index).add_(bias))


def mask_bias(bitmask, vocab: int, numpy: bool | None = None):
    """``[rows, vocab]`` float32: 0 for the tokens llguidance's bitmask allows (bit ``t % 32`` of word
    ``t // 32``), -inf for the rest. An add, not ``masked_fill``: torch's CPU masked_fill took 1.8 ms
    at 16 x 49k here, unpacking and adding 0.8 ms (llguidance's own helper is a torch.compile'd
    function: seconds of compiling on a process's first constrained request). ``numpy``: unpack
    with numpy (default: when the bitmask is on the CPU) or with torch ops (on its device)."""
    import numpy as np
    import torch

    if numpy if numpy is not None else bitmask.device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little"))
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
        bits = ((bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).flatten(1)
    return ((bits[:, :vocab].to(torch.int32) - 1) & _NEG_INF_BITS).view(torch.float32)
