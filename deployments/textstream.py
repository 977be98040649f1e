"""Engine messages (token ids) to text deltas: incremental detokenization and stop strings.

Text work lives here, in the ingress, so engine replicas never spend time on it. The
text pipeline is the offline LLM's (``engine.detokenizer.TextStream``): a stop string
ends the output at the exact token that completed it, so the reported token ids and
usage match the text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from deployments.contract import EngineMessage
from engine.sampling import SamplingParams
from engine.detokenizer import TextStream


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None
    """None only for a prompt's first token, which nothing predicts."""
    token: str
    top: tuple[tuple[int, float, str], ...] = ()
    """Alternatives as (token_id, logprob, text), most likely first (the sampled token included)."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one engine step adds to one choice of a request's output."""

    request_id: str
    """The server's id (what Abort takes)."""
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    """None while running; "stop", "length" or "abort" on the last delta."""
    usage: Usage | None = None
    """Set on the last delta of the request: all its choices' output tokens."""
    client_request_id: str | None = None
    """The client's own id, echoed back."""
    audit: tuple[dict, ...] | None = None
    """On the last delta: the engine's scheduling audit trail (``engine.outputs.audit_records``)."""
    index: int = 0
    """Which of the request's ``n`` choices it belongs to."""
    ends_request: bool = False
    """The request's last delta: every choice has finished (``finish_reason`` is that of this one)."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """On choice 0's first delta, with ``prompt_logprobs``: one per prompt token (before any other
    choice's delta: the engine starts the siblings after it)."""
    stop_string: str | None = None
    """On a choice's last delta: the stop string that ended it (vLLM's ``stop_reason``), if one did."""
    embedding: list[float] | None = None
    """A pooling request's one delta: the prompt's embedding (``engine.pooling``)."""


class TextAssembler:
    """Turns one choice's engine messages into text deltas."""

    def __init__(self, tokenizer, request_id: str, params: SamplingParams, prompt_token_ids: Sequence[int],
                 client_request_id: str | None = None, index: int = 0) -> None:
        self._tokenizer = tokenizer
        self._request_id = request_id
        self.index = index
        self._client_request_id = client_request_id
        self.token_ids: list[int] = []
        """Every output token passed on so far: where a resumed request picks up."""
        self._want_logprobs = params.logprobs is not None
        self._num_top = params.logprobs or 0
        self._num_prompt_top = params.prompt_logprobs or 0
        self._text = TextStream.for_params(tokenizer, params)
        self._prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = 0
        self.finished = False

    def push(self, message: EngineMessage) -> TextDelta:
        """One engine message in, one text delta out."""
        text, used = self._text.push(message.token_ids)
        ids = list(message.token_ids[:used])
        finish = message.finish_reason
        if finish and not self._text.stopped:
            text += self._text.finish()
        if self._text.stopped:
            finish = "stop"
        self.token_ids.extend(ids)
        self.num_cached_tokens = message.num_cached_tokens
        logprobs = None
        if self._want_logprobs:
            logprobs = tuple(self._logprob(t, lp) for t, lp in zip(ids, message.logprobs or []))
        audit = None
        if finish:
            self.finished = True
            audit = tuple(message.audit or ())
        scored = message.prompt_logprobs
        prompt = None if scored is None else self._prompt_logprobs(scored)
        return TextDelta(self._request_id, text, tuple(ids), logprobs, finish, None, self._client_request_id, audit,
                         self.index, prompt_logprobs=prompt, stop_string=self._text.stop_string if finish else None,
                         embedding=message.embedding)

    def abort(self) -> TextDelta:
        """The last delta of a choice that ended without the engine saying so."""
        self.finished = True
        return TextDelta(self._request_id, self._text.finish(), (), () if self._want_logprobs else None, "abort",
                         None, self._client_request_id, None, self.index)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def _prompt_logprobs(self, scored: list) -> tuple[TokenLogprob, ...]:
        ids = self._prompt_token_ids
        first = TokenLogprob(int(ids[0]), None, self._tokenizer.decode([int(ids[0])]))
        return (first, *(self._logprob(t, lp, self._num_prompt_top) for t, lp in zip(ids[1:], scored[1:])))

    def _logprob(self, token_id: int, alternatives: dict, num_top: int | None = None) -> TokenLogprob:
        num_top = self._num_top if num_top is None else num_top
        ranked = sorted(alternatives.items(), key=lambda kv: -kv[1])[:num_top]
        top = tuple((int(t), float(lp), self._tokenizer.decode([int(t)])) for t, lp in ranked)
        own = alternatives.get(token_id, float("nan"))
        return TokenLogprob(int(token_id), float(own), self._tokenizer.decode([int(token_id)]), top)


def last_delta(delta: TextDelta, choices: list[TextAssembler], num_prompt_tokens: int) -> TextDelta:
    """``delta`` as the request's last: the usage of all its choices (the prompt counted once)."""
    usage = Usage(num_prompt_tokens, sum(c.num_output_tokens for c in choices), choices[0].num_cached_tokens)
    return dataclasses.replace(delta, usage=usage, ends_request=True)


def abort_all(choices: list[TextAssembler], num_prompt_tokens: int) -> list[TextDelta]:
    """The last deltas of the choices still running, for a request that ended without the engine saying so."""
    deltas = [c.abort() for c in choices if not c.finished]
    deltas[-1] = last_delta(deltas[-1], choices, num_prompt_tokens)
    return deltas
