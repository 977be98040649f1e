"""The serving path's typed contract: what an ingress asks of an engine replica, and what comes back.

``EngineRequest`` is made once by the ingress (``PreparedRequest.engine_request``), noted by the
router that picks its replica, sent on the engine link as it is and read by the replica, which
hands its fields to the engine. ``EngineMessage`` is one engine output of one request, as the
replica makes it from the engine's ``StreamOutput``, as the engine link carries it (msgspec encodes
the struct as it is, and decodes into it and nothing else), and as the frontend's text assembler
reads it. Wherever messages queue behind a slow reader, ``coalesce`` joins them with the one
``merge``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.outputs import FINISH_ABORT, StreamOutput, audit_records
from engine.sampling import SamplingParams


def wire_key(request_id: str, attempt: int) -> str:
    """A request's key on the wire: one per attempt, so an error left over from a first attempt
    never reaches the resumed one."""
    return request_id if not attempt else f"{request_id}~{attempt}"


class EngineRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request as an engine replica takes it: token ids only, no text."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    """``SamplingParams``. On the wire a map of its fields, made one (and so checked, an unknown field
    refused) when the replica decodes it: a request it cannot take fails alone."""
    ingress_id: str = ""
    """The ingress whose engine link carries it (set by that link)."""
    priority: int = 0
    attempt: int = 0
    """How many times it was sent before (a replica died under it): its wire key differs each time."""
    resume_token_ids: list[int] = []
    """Output tokens the client already has: the engine recomputes them and goes on from there."""
    resume_choices: dict[int, list[int]] | None = None
    """With ``n`` > 1: the choices still to run, each with the tokens it has."""
    lora: str | None = None
    """The LoRA adapter to run with (its name); None: the base model."""
    lora_path: str | None = None
    """Where a replica that lacks ``lora`` loads it from (an adapter loaded at run time)."""
    trace_context: dict[str, str] | None = None
    cache_salt: str | None = None
    tenant: str | None = None
    """Whose request it is: the replica's waiting queue shares service between tenants."""
    tenant_weight: float = 1.0
    operation: str = "text_completion"
    routing: dict[str, Any] | None = None
    """Why its replica was picked (``reason``, ``time_ns``): the replica's trace shows it."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            if not isinstance(self.params, dict):
                raise TypeError(f"params must be a map of sampling fields, got {type(self.params).__name__}")
            self.params = SamplingParams(**self.params)

    @property
    def wire_id(self) -> str:
        return wire_key(self.request_id, self.attempt)

    def noted(self, reason: str, time_ns: int) -> None:
        """Record why its replica was picked (a re-routed request gets a new note)."""
        self.routing = {"reason": reason, "time_ns": time_ns}


class EngineMessage(msgspec.Struct, omit_defaults=True):
    """One engine output of one request: every token of one choice since its previous message.

    The six fields without a default are always on the wire, as every link version sends and
    expects them; the others only when set."""

    token_ids: list[int]
    finish_reason: str | None
    """Set on the choice's last message (``engine.outputs``' FINISH_*)."""
    logprobs: list[dict[int, float]] | None
    """Per token: {token id: logprob} of it and the alternatives asked for."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    audit: list[dict[str, Any]] | None = None
    """On the choice's last message: the scheduling audit trail (``engine.outputs.audit_records``)."""
    index: int = 0
    """Which of the request's ``n`` choices."""
    choices_running: int = 0
    """The request's choices still running after this message."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """On choice 0's first message, when asked: per prompt token (None for the first)."""
    embedding: list[float] | None = None
    """A pooling request's only message: its prompt's embedding."""
    queue_time_s: float | None = None
    """On the request's first message: engine arrival to first scheduled (per-tenant queue time)."""

    @classmethod
    def of(cls, out: StreamOutput, first: bool = False) -> "EngineMessage":
        """``out`` as sent: token ids only, the audit trail on a finished choice. ``first``: the
        request's first message, which carries its queue time in the engine."""
        timing = out.timing
        queued = None
        if first and timing is not None and timing.first_scheduled_time is not None:
            queued = timing.first_scheduled_time - timing.arrival_time
        return cls(list(out.new_token_ids), out.finish_reason, out.new_logprobs, out.num_prompt_tokens,
                   out.num_output_tokens, out.num_cached_tokens,
                   audit=audit_records(timing) if out.finished and timing is not None else None,
                   index=out.index, choices_running=out.choices_running, prompt_logprobs=out.prompt_logprobs,
                   embedding=out.embedding, queue_time_s=queued)

    @classmethod
    def aborted(cls, num_prompt_tokens: int) -> "EngineMessage":
        """The last message of a request aborted before its engine saw it."""
        return cls([], FINISH_ABORT, None, num_prompt_tokens, 0, 0)

    @property
    def ends_request(self) -> bool:
        """Its choice finished and no other one still runs."""
        return self.finish_reason is not None and not self.choices_running

    def merge(self, later: "EngineMessage") -> "EngineMessage":
        """This message and the same choice's next one as one: tokens and logprobs joined, what is
        sent once (prompt logprobs, queue time) kept from this one, the rest as of ``later``."""
        logprobs = later.logprobs
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = [*(self.logprobs or ()), *(later.logprobs or ())]
        return msgspec.structs.replace(
            later, token_ids=[*self.token_ids, *later.token_ids], logprobs=logprobs,
            prompt_logprobs=later.prompt_logprobs if self.prompt_logprobs is None else self.prompt_logprobs,
            queue_time_s=later.queue_time_s if self.queue_time_s is None else self.queue_time_s)


def coalesce(messages: list[EngineMessage]) -> list[EngineMessage]:
    """Consecutive messages of one request as one per choice, in order of first appearance, and the
    one that ends the request last."""
    by_choice: dict[int, EngineMessage] = {}
    for message in messages:
        earlier = by_choice.get(message.index)
        by_choice[message.index] = message if earlier is None else earlier.merge(message)
    return sorted(by_choice.values(), key=lambda m: m.ends_request)
