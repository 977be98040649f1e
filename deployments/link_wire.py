"""The engine link's wire (deployments.link): the token, the handshake's proofs, typed frames.

A frame is a 4-byte length and a MessagePack document decoded by msgspec into the structs
below, and into nothing else: what a peer sends can be a wrong value, never code to run. A
request the replica cannot take is answered with its error alone (``SubmitIn``); a frame that names
no request ends the link. Sampling parameters arrive as a plain map and go through ``SamplingParams``'s own
validation. A peer proves it holds the application's token with an HMAC over both sides' fresh
nonces, labelled by its side, so the token itself never crosses the wire and a recorded proof
is worth nothing on the next connection; with TLS configured the link is also encrypted.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from deployments.contract import EngineMessage, EngineRequest, wire_key
from deployments.errors import (BadRequest, Cancelled, DeadlineExceeded, ModelNotFound, Overloaded, ServingError,
                                Unauthenticated, Unavailable)
from engine.errors import (AdapterLoadError, EngineDeadError, EngineOverloadedError, InvalidRequestError,
                           UnknownAdapterError)

TOKEN_BYTES = 16
LINK_TOKEN_ENV = "SLOTSERVE_LINK_TOKEN"
"""Where ``build_app`` takes the token from (hex, 32 digits) before making one up; two, comma-separated,
while one is rotated (``link_keys``)."""
LINK_VERSION = 1
"""What an ingress's ``Hello`` says it speaks. Peers of other versions still link: fields either side
does not know are ignored, and a request the replica cannot take fails alone (``SubmitIn``)."""
MAX_FRAME_BYTES = 64 << 20  # a 2M-token prompt is ~10 MB of MessagePack; far below this
FRAME_ITEMS = 1024
"""Outputs per frame at most: a backlog goes out in several frames, each far below the limit."""
HEADER = struct.Struct("!I")
NONCE_BYTES = 16
MAC_BYTES = 32

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class LinkTls:
    """Mutual TLS on engine links (``engine_link_tls``): every node holds the application's CA and
    a certificate with its key that the CA signed. Peers are reached by node IP, so names are not
    checked: a certificate of this CA is the identity (keep the CA for this application alone)."""

    certfile: str
    keyfile: str
    cafile: str

    def context(self, server: bool) -> ssl.SSLContext:
        purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
        try:
            context = ssl.create_default_context(purpose, cafile=self.cafile)
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"engine_link_tls: cannot load {self}: {exc}") from None
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context


class ReloadingTls:
    """``LinkTls``'s context, made again when its files change (cert-manager renews a Secret in place and
    the mount follows), checked at each new connection: renewed certificates need no restart, and the
    links already open keep theirs."""

    def __init__(self, tls: LinkTls, server: bool) -> None:
        self._tls, self._server = tls, server
        self._stamp = self._files()
        self._context = tls.context(server)
        self.listening = self._context
        """What a server listens with: each handshake then takes the newest context (``_swap``)."""
        if server:
            self.listening.sni_callback = self._swap

    def _files(self) -> tuple:
        stamps = []
        for path in (self._tls.certfile, self._tls.keyfile, self._tls.cafile):
            try:
                st = os.stat(path)  # through the Secret mount's symlinks
                stamps.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def current(self) -> ssl.SSLContext:
        stamp = self._files()
        if stamp != self._stamp:
            try:
                self._context = self._tls.context(self._server)
                self._stamp = stamp
                logger.info("engine link TLS: certificate files changed, new connections use them")
            except ValueError as exc:  # caught mid-rotation: the old context serves, the next connection retries
                logger.warning("engine link TLS: keeping the loaded certificate (%s)", exc)
        return self._context

    def _swap(self, ssl_object, server_name, context) -> None:
        ssl_object.context = self.current()


# -- frames

def new_token() -> str:
    """The application's link token (hex): made once by ``build_app``, given to both sides."""
    return secrets.token_hex(TOKEN_BYTES)


def check_token(token: str) -> None:
    link_keys(token)


def link_keys(token: str) -> tuple[bytes, ...]:
    """The keys ``token`` names: one, or ``"new,old"`` while a token is rotated. A side proves itself
    with the first and accepts a proof under either, so a rotation is three deploys that each keep
    serving: ``old,new``, then ``new,old``, then ``new``."""
    try:
        keys = tuple(bytes.fromhex(part) for part in token.split(","))
        if 1 <= len(keys) <= 2 and all(len(key) == TOKEN_BYTES for key in keys):
            return keys
    except (AttributeError, TypeError, ValueError):
        pass
    raise ValueError(f"the engine link token ({LINK_TOKEN_ENV}) must be {2 * TOKEN_BYTES} hex digits, or two "
                     "such tokens separated by a comma while one is rotated")


def proven_key(keys: tuple[bytes, ...], proof: bytes, side: bytes, ingress_nonce: bytes,
               replica_nonce: bytes) -> bytes | None:
    """The key of ``keys`` that ``proof`` was made with, or None."""
    found = None
    for key in keys:  # every key is tried, so the time taken tells nothing of which one matched
        if hmac.compare_digest(proof, mac(key, side, ingress_nonce, replica_nonce)):
            found = key
    return found


def mac(key: bytes, side: bytes, ingress_nonce: bytes, replica_nonce: bytes) -> bytes:
    return hmac.new(key, side + ingress_nonce + replica_nonce, hashlib.sha256).digest()


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


def keepalive(sock: socket.socket | None) -> None:
    """Probe an idle link: a replica whose node vanished sends no FIN, and its streams would wait
    for their deadlines; with these they fail (and resume elsewhere) within ~25 s."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", 25_000)):  # ms; the same bound while data is unacknowledged
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
