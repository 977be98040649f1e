"""Who may open an engine link, and how it is kept: the application's token, the handshake's proofs,
mutual TLS, TCP keepalive.

A peer proves it holds the application's token with an HMAC over both sides' fresh nonces, labelled
by its side, so the token itself never crosses the wire and a recorded proof is worth nothing on the
next connection; with TLS configured the link is also encrypted. What then travels on the link is
``deployments.contract``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
from dataclasses import dataclass

TOKEN_BYTES = 16
LINK_TOKEN_ENV = "SLOTSERVE_LINK_TOKEN"
"""Where ``build_app`` takes the token from (hex, 32 digits) before making one up; two, comma-separated,
while one is rotated (``link_keys``)."""
NONCE_BYTES = 16
MAC_BYTES = 32

logger = logging.getLogger(__name__)


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
