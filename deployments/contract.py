"""The serving path's typed contract: what an ingress asks of an engine replica, and what comes back.

``EngineRequest`` is made once by the ingress (``PreparedRequest.engine_request``), noted by the
router that picks its replica, sent on the engine link as it is and read by the replica, which
hands its fields to the engine. ``EngineMessage`` is one engine output of one request, as the
replica makes it from the engine's ``StreamOutput``, as the engine link carries it (msgspec encodes
the struct as it is, and decodes into it and nothing else), and as the frontend's text assembler
reads it. Wherever messages queue behind a slow reader, ``coalesce`` joins them with the one
``merge``.

On the engine link a frame is a 4-byte length and a MessagePack document decoded by msgspec into
the structs here, and into nothing else: what a peer sends can be a wrong value, never code to run.
A request the replica cannot take is answered with its error alone (``SubmitIn``); a frame that names
no request ends the link. Who may link, and how (the token's proofs, TLS), is ``deployments.link_auth``.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Union

import msgspec

from deployments.errors import (BadRequest, Cancelled, DeadlineExceeded, ModelNotFound, Overloaded, ServingError,
                                Unauthenticated, Unavailable)
from engine.errors import (AdapterLoadError, EngineDeadError, EngineOverloadedError, InvalidRequestError,
                           UnknownAdapterError)
from engine.outputs import FINISH_ABORT, StreamOutput, audit_records
from engine.sampling import SamplingParams

LINK_VERSION = 1
"""What an ingress's ``Hello`` says it speaks. Peers of other versions still link: fields either side
does not know are ignored, and a request the replica cannot take fails alone (``SubmitIn``)."""
MAX_FRAME_BYTES = 64 << 20  # a 2M-token prompt is ~10 MB of MessagePack; far below this
FRAME_ITEMS = 1024
"""Outputs per frame at most: a backlog goes out in several frames, each far below the limit."""
HEADER = struct.Struct("!I")


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


# -- ingress -> replica

class Hello(msgspec.Struct, tag="hello"):
    ingress_id: str
    version: int = 0
    """``LINK_VERSION`` of the ingress; 0: one from before versions were sent."""


class Submit(msgspec.Struct, tag="submit"):
    request: EngineRequest


class SubmitIn(msgspec.Struct, tag="submit"):
    """A ``Submit`` as the replica reads it: the request stays encoded until ``take``, so a request the
    replica cannot take (a wrong field, a newer ingress's value) fails alone, not the link with every
    other stream on it."""

    request: msgspec.Raw

    def take(self) -> tuple[str, EngineRequest | Exception]:
        """The request's wire id and the request, or the error to answer it with. Raises
        msgspec.ValidationError when not even its id can be read: then nothing can be answered."""
        head = _request_head.decode(self.request)
        key = wire_key(head.request_id, head.attempt)
        try:
            return key, _engine_request.decode(self.request)
        except msgspec.ValidationError as exc:  # SamplingParams's own checks included
            return key, InvalidRequestError(f"engine replica refused request {head.request_id!r}: {exc}")


class RequestHead(msgspec.Struct):
    """What names a request on the wire: enough to answer one that is otherwise unreadable."""

    request_id: str
    attempt: int = 0


class Abort(msgspec.Struct, tag="abort"):
    request_id: str
    index: int | None = None
    """Only this choice of the request (``n`` > 1)."""
    reply: int | None = None
    """Answer with ``Found(reply, ...)``: an abort by request id, of a stream another ingress may hold."""


# -- replica -> ingress: batches of outputs, one per engine step

class Found(msgspec.Struct, tag="found"):
    """The answer to an ``Abort`` with ``reply``: whether the request ran here (it is now aborted)."""

    reply: int
    found: bool


class WireError(msgspec.Struct, array_like=True):
    """An error by its class's name (one of ``ERRORS``) and message."""

    kind: str
    message: str
    param: str | None = None


class Output(msgspec.Struct, array_like=True):
    """Sent as a ``(wire_id, EngineMessage, WireError)`` tuple: the same array on the wire."""

    wire_id: str
    message: EngineMessage | None = None
    error: WireError | None = None


ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    ServingError, BadRequest, ModelNotFound, Unauthenticated, Overloaded, Unavailable, DeadlineExceeded,
    Cancelled, EngineDeadError, EngineOverloadedError, InvalidRequestError, UnknownAdapterError, AdapterLoadError)}
"""What an error can be on the ingress's side: the frontend tells a crashed engine loop from a lost
replica from an overloaded one by class."""

_encoder = msgspec.msgpack.Encoder()
_ingress_frames = msgspec.msgpack.Decoder(Union[Hello, SubmitIn, Abort])
_engine_request = msgspec.msgpack.Decoder(EngineRequest)
_request_head = msgspec.msgpack.Decoder(RequestHead)
_replica_frames = msgspec.msgpack.Decoder(Union[list[Output], Found])


def wire_error(exc: BaseException) -> WireError:
    if type(exc).__name__ in ERRORS and isinstance(exc, ERRORS[type(exc).__name__]):
        return WireError(type(exc).__name__, getattr(exc, "message", None) or str(exc), getattr(exc, "param", None))
    return WireError("Unavailable", f"{type(exc).__name__}: {exc}")


def rebuild_error(error: WireError) -> Exception:
    cls = ERRORS.get(error.kind, ServingError)
    return cls(error.message, param=error.param) if issubclass(cls, ServingError) else cls(error.message)


def as_item(output: Output) -> tuple:
    """``(wire_id, EngineMessage or None, exception or None)``: one item of a batch."""
    return output.wire_id, output.message, None if output.error is None else rebuild_error(output.error)


# -- frames

def frame(obj: Any) -> bytes:
    data = _encoder.encode(obj)
    return HEADER.pack(len(data)) + data


async def _read(reader: asyncio.StreamReader) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"link frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    return await reader.readexactly(size)


def decode_ingress_frame(data: bytes) -> Hello | SubmitIn | Abort:
    """A frame's body from an ingress; msgspec.ValidationError / DecodeError when it is not one."""
    return _ingress_frames.decode(data)


async def read_ingress_frame(reader: asyncio.StreamReader) -> Hello | SubmitIn | Abort:
    return decode_ingress_frame(await _read(reader))


async def read_outputs(reader: asyncio.StreamReader) -> list[tuple] | Found:
    """The next frame from a replica: a batch (``as_item`` items), or an abort's answer."""
    frame = _replica_frames.decode(await _read(reader))
    return frame if isinstance(frame, Found) else [as_item(output) for output in frame]


def outputs(batch: list[tuple]) -> bytes:
    """Items ``(wire id, EngineMessage or None, exception or None)`` as frames of at most ``FRAME_ITEMS``
    outputs."""
    wire = [(key, message, None if exc is None else wire_error(exc)) for key, message, exc in batch]
    return b"".join(frame(wire[i:i + FRAME_ITEMS]) for i in range(0, len(wire), FRAME_ITEMS))
