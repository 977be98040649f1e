"""The engine link's wire (deployments.link): the token, the handshake's proofs, frames, socket options.

A frame is a 4-byte length and a pickle. A peer proves it holds the application's token
with an HMAC over both sides' fresh nonces, labelled by its side, so the token itself never
crosses the wire and a recorded proof is worth nothing on the next connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import pickle
import secrets
import socket
import struct
from typing import Any

from deployments.errors import Unavailable
from deployments.mux import Item

TOKEN_BYTES = 16
LINK_TOKEN_ENV = "SLOTSERVE_LINK_TOKEN"
"""Where ``build_app`` takes the token from (hex, 32 digits) before making one up."""
MAX_FRAME_BYTES = 256 << 20  # a 2 MB prompt is ~2 MB of token ids pickled; far below this
FRAME_ITEMS = 1024
"""Outputs per frame at most: a backlog goes out in several frames, each far below the limit."""
HEADER = struct.Struct("!I")
NONCE_BYTES = 16
MAC_BYTES = 32


def new_token() -> str:
    """The application's link token (hex): made once by ``build_app``, given to both sides."""
    return secrets.token_hex(TOKEN_BYTES)


def check_token(token: str) -> None:
    try:
        if len(bytes.fromhex(token)) == TOKEN_BYTES:
            return
    except (TypeError, ValueError):
        pass
    raise ValueError(f"the engine link token ({LINK_TOKEN_ENV}) must be {2 * TOKEN_BYTES} hex digits")


def mac(key: bytes, side: bytes, ingress_nonce: bytes, replica_nonce: bytes) -> bytes:
    return hmac.new(key, side + ingress_nonce + replica_nonce, hashlib.sha256).digest()


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"link frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    return pickle.loads(await reader.readexactly(size))


def portable(batch: list[Item]) -> list[Item]:
    """The batch with every error one the other side can unpickle (the message, at least)."""
    out = []
    for rid, message, exc in batch:
        if exc is not None:
            try:
                pickle.loads(pickle.dumps(exc))
            except Exception:  # noqa: BLE001 - an exception class pickle cannot rebuild
                exc = Unavailable(f"{type(exc).__name__}: {exc}")
        out.append((rid, message, exc))
    return out


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


def frames(batch: list[Item]) -> bytes:
    return b"".join(frame(portable(batch[i:i + FRAME_ITEMS])) for i in range(0, len(batch), FRAME_ITEMS))
