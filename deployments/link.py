"""The engine link: how an ingress reaches an engine replica, one TCP connection per pair.

A Serve call per request and a Serve streaming message per engine step would cost a few
milliseconds of time to first token and most of a millisecond of CPU per message on both
sides (docs/BENCHMARKS.md). Instead the ingress picks the replica with the slot-aware router
(found through ``router.inflight``: the router Serve keeps up to date in its process),
then writes the request on its connection to that replica, which answers on the same
connection with one frame per engine step (``deployments.mux``). Serve still builds, scales,
health-checks and drains the replicas, and carries what is not per request (``model_info``,
loads) and an ingress's first requests before its router has heard from any replica
(``submit_linked``).

Frames are typed MessagePack (``deployments.link_wire``): nothing read from the socket is
unpickled or run, and no frame is read at all before both sides have proved they hold the
application's random token (``new_token``): each sends a fresh nonce and an HMAC of both nonces
under the token, so the token never crosses the wire and a recorded handshake cannot be replayed;
with ``engine_link_tls`` the connection is mutual TLS as well. Both sides probe an idle connection
(TCP keepalive), and the replica bounds what a stalled ingress can make it buffer.

``LinkServer`` is the replica's side (over its ``mux.ReplicaHub``), ``LinkTransport`` the
ingress's (a ``mux.MuxTransport``); both are plain asyncio, tested over loopback without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import time
from typing import Any, AsyncIterator, Callable, Protocol

from deployments.engine_client import ends_request
from deployments.errors import Unavailable
import msgspec

from deployments.link_wire import (LINK_TOKEN_ENV, MAC_BYTES, NONCE_BYTES, Abort, Hello, LinkTls, Submit, check_token,
                                   frame, keepalive, mac, new_token, outputs, read_ingress_frame, read_outputs)
from deployments.mux import Item, ReplicaHub, wire_id

__all__ = ["LINK_TOKEN_ENV", "LinkServer", "LinkTls", "LinkTransport", "check_token", "new_token"]

logger = logging.getLogger(__name__)
access_log = logging.getLogger("ray.serve")
"""One line per linked request as it ends (``LINK <request id> OK|ERROR|CANCELLED <ms>ms``), in the
replica's Serve log beside Serve's own ``CALL`` lines, which linked requests do not make."""

HELLO_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
MAX_BACKLOG_ITEMS = 1 << 16
WRITE_STALL_S = 30.0
"""An ingress that leaves this many outputs unread, or takes no bytes for this long, is stalled: its
link is closed and its requests here aborted (it resumes them elsewhere), instead of the replica
buffering for it without bound."""


async def _settle(task: asyncio.Task) -> None:
    """Wait for a cancelled task; an error it ended with is logged, not lost."""
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - already ending; say why
        logger.exception("engine link task failed")


def _log_access(request_id: str, status: str, since: float) -> None:
    access_log.info("LINK %s %s %.1fms", request_id, status, (time.monotonic() - since) * 1e3)


class Replica(Protocol):
    """What the link needs of ``replica.EngineReplica``."""

    async def submit(self, request: dict) -> str: ...

    def abort(self, request: str | dict, index: int | None = None) -> bool: ...


class LinkServer:
    """A replica's link endpoint: the handshake and a ``Hello``, then ``Submit`` and ``Abort``
    frames in; batches of ``Output`` out (``deployments.link_wire``)."""

    def __init__(self, replica: Replica, hub: ReplicaHub, token: str, host: str = "127.0.0.1",
                 tls: LinkTls | None = None) -> None:
        check_token(token)
        self._ssl = tls.context(server=True) if tls is not None else None
        self._replica = replica
        self._hub = hub
        self._token = bytes.fromhex(token)
        # Bound now, so the address is known from the start (the routing stats carry it).
        self._sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address = f"{host}:{self._sock.getsockname()[1]}" if ":" not in host else \
            f"[{host}]:{self._sock.getsockname()[1]}"
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._by_ingress: dict[str, asyncio.Task] = {}  # the connection serving each ingress
        self.requests = 0  # submitted over links (reported with the routing stats)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, sock=self._sock, ssl=self._ssl,
            ssl_handshake_timeout=HELLO_TIMEOUT_S if self._ssl is not None else None)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
        """The ingress's id once it proved it holds the token; None (logged) when it did not."""
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            ingress_nonce = await reader.readexactly(NONCE_BYTES)
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(nonce + mac(self._token, b"replica", ingress_nonce, nonce))
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            proof = await reader.readexactly(MAC_BYTES)
        if not hmac.compare_digest(proof, mac(self._token, b"ingress", ingress_nonce, nonce)):
            logger.warning("engine link from %s refused: wrong token", writer.get_extra_info("peername"))
            return None
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            hello = await read_ingress_frame(reader)
        return hello.ingress_id if isinstance(hello, Hello) else None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        self._connections.add(me)
        keepalive(writer.get_extra_info("socket"))  # an ingress whose node vanished sends no FIN either
        forward: asyncio.Task | None = None
        ingress_id: str | None = None
        started: dict[str, float] = {}  # request id -> when it came, until it ends
        try:
            ingress_id = await self._handshake(reader, writer)
            if ingress_id is None:
                return
            # An ingress opens a new link only once it gave up the old one (and resumed its streams
            # elsewhere): the old connection, if still open here, is stale. End it first, so its
            # requests are aborted rather than adopted by the new one and run twice.
            stale = self._by_ingress.get(ingress_id)
            self._by_ingress[ingress_id] = me
            if stale is not None:
                stale.cancel()
                await _settle(stale)
            forward = asyncio.create_task(self._forward(ingress_id, writer, started))
            forward.add_done_callback(lambda _: writer.close())  # a broken forwarder ends the link
            while True:
                message = await read_ingress_frame(reader)
                if isinstance(message, Submit):
                    await self._submit(message.request.as_dict(), writer, started)
                elif isinstance(message, Abort):
                    self._replica.abort(message.request_id, message.index)
                else:
                    raise ValueError(f"unexpected {type(message).__name__} frame")
        except (asyncio.IncompleteReadError, OSError, asyncio.TimeoutError):
            pass  # the ingress went away (or its keepalive expired): cancelling the forwarder aborts its requests
        except asyncio.CancelledError:
            pass  # closed by us (shutdown, or replaced by a newer link of its ingress)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:  # a bad frame ends this link
            logger.warning("engine link from %s closed: bad frame (%s)", writer.get_extra_info("peername"), exc)
        except Exception:  # noqa: BLE001 - anything else ends this link too, never the replica
            logger.exception("engine link from %s failed", writer.get_extra_info("peername"))
        finally:
            if forward is not None:
                forward.cancel()
                await _settle(forward)
                for rid, t0 in started.items():  # cut off with the link: the replica aborts them
                    _log_access(rid, "CANCELLED", t0)
            if ingress_id is not None and self._by_ingress.get(ingress_id) is me:
                del self._by_ingress[ingress_id]
            writer.close()
            self._connections.discard(me)

    async def _submit(self, request: dict, writer: asyncio.StreamWriter, started: dict[str, float]) -> None:
        self.requests += 1
        started[request["request_id"]] = time.monotonic()
        try:
            await self._replica.submit(request)
        except Exception as exc:  # noqa: BLE001 - refused (shutting down): its stream hears it
            started.pop(request["request_id"], None)
            writer.write(outputs([(wire_id(request), None, exc)]))

    async def _forward(self, ingress_id: str, writer: asyncio.StreamWriter, started: dict[str, float]) -> None:
        async with contextlib.aclosing(self._hub.subscribe(ingress_id)) as batches:
            async for batch in batches:
                if writer.is_closing():  # the ingress went away: the reader ends this link
                    return
                if len(batch) > MAX_BACKLOG_ITEMS:
                    logger.warning("ingress %s left %d outputs unread: closing its link", ingress_id, len(batch))
                    return
                writer.write(outputs(batch))
                for rid, message, exc in batch:
                    if exc is not None or ends_request(message):
                        t0 = started.pop(rid, None)
                        if t0 is not None:
                            _log_access(rid, "OK" if exc is None else "ERROR", t0)
                # A slow ingress holds its own batches back, nothing else. Every timeout here is
                # asyncio.timeout: 3.11's wait_for can swallow the cancellation that ends a link.
                try:
                    async with asyncio.timeout(WRITE_STALL_S):
                        await writer.drain()
                except (asyncio.TimeoutError, TimeoutError):
                    logger.warning("ingress %s took nothing for %.0f s: closing its link", ingress_id, WRITE_STALL_S)
                    return

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
            await _settle(task)
        if self._server is None:
            self._sock.close()


class _Link:
    """The ingress's connection to one replica: writes from anywhere, one reader (``batches``)."""

    def __init__(self, replica_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.replica_id = replica_id
        self.reader = reader
        self.writer = writer
        self.closed = False

    def send(self, message: Submit | Abort) -> None:
        if self.closed:
            raise Unavailable(f"the link to engine replica {self.replica_id} is closed")
        self.writer.write(frame(message))

    async def batches(self) -> AsyncIterator[list[Item]]:
        try:
            while True:
                yield await read_outputs(self.reader)
        except (asyncio.IncompleteReadError, OSError) as exc:  # OSError: also a keepalive's ETIMEDOUT
            raise Unavailable(f"engine replica {self.replica_id} closed its link ({type(exc).__name__})") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Unavailable(f"engine replica {self.replica_id} sent a bad frame ({exc})") from None
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


Chooser = Callable[[dict, frozenset], "tuple[str, str] | None"]
AVOID_S = 30.0
"""A replica whose link failed is not chosen again for this long: the router's view (Serve's)
still lists a dead replica for a while, and the requests it lost resume at once."""


class LinkTransport:
    """``mux.MuxTransport`` over engine links; ``serve`` (a ``HandleEngineClient``) carries the rest.

    ``choose(request, avoid)``: ``(replica_id, link address)`` from the slot-aware router, among
    replicas not in ``avoid``; None when it has none with a link (yet); then the request goes
    through Serve (``submit_linked``), which answers with the replica's address, and its outputs
    still come over the link.
    """

    def __init__(self, serve: Any, token: str, choose: Chooser, tls: LinkTls | None = None) -> None:
        check_token(token)
        self._ssl = tls.context(server=False) if tls is not None else None
        self._serve = serve
        self._token = bytes.fromhex(token)
        self._choose = choose
        self._addresses: dict[str, str] = {}
        self._links: dict[str, _Link] = {}
        self._opening: dict[str, asyncio.Future] = {}
        self._ingress_id: str | None = None
        self._failed: dict[str, float] = {}  # replica id -> when its link failed

    def _avoid(self) -> frozenset:
        now = time.monotonic()
        for rid in [rid for rid, t in self._failed.items() if now - t > AVOID_S]:
            del self._failed[rid]
        return frozenset(self._failed)

    async def submit(self, request: dict) -> str:
        self._ingress_id = request["ingress_id"]
        choice = self._choose(request, self._avoid())
        if choice is None:
            replica_id, address = await self._serve.submit_linked(request)
            self._addresses[replica_id] = address
            return replica_id
        replica_id, address = choice
        self._addresses[replica_id] = address
        link = await self._link(replica_id)
        link.send(Submit(request))
        return replica_id

    async def subscribe(self, replica_id: str, ingress_id: str) -> AsyncIterator[list[Item]]:
        self._ingress_id = ingress_id
        link = await self._link(replica_id)
        try:
            async with contextlib.aclosing(link.batches()) as batches:
                async for batch in batches:
                    yield batch
        except Unavailable:
            self._lost(replica_id)
            raise

    def _lost(self, replica_id: str) -> None:
        self._failed[replica_id] = time.monotonic()
        self._addresses.pop(replica_id, None)  # the router or Serve gives it again if it lives
        if replica_id in self._links and self._links[replica_id].closed:
            del self._links[replica_id]

    async def abort_on(self, request_id: str, replica_id: str, index: int | None = None) -> bool:
        link = self._links.get(replica_id)
        if link is None or link.closed:
            return await self._serve.abort_on(request_id, replica_id, index)
        link.send(Abort(request_id, index))
        return True

    async def _link(self, replica_id: str) -> _Link:
        link = self._links.get(replica_id)
        if link is not None and not link.closed:
            return link
        opening = self._opening.get(replica_id)
        if opening is None:  # one connection per replica, however many requests ask at once
            opening = self._opening[replica_id] = asyncio.ensure_future(self._open(replica_id))
            opening.add_done_callback(lambda _: self._opening.pop(replica_id, None))
        return await asyncio.shield(opening)

    async def _open(self, replica_id: str) -> _Link:
        address = self._addresses.get(replica_id)
        if address is None:
            raise Unavailable(f"no link address for engine replica {replica_id}")
        host, _, port = address.rpartition(":")
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(host.strip("[]"), int(port), ssl=self._ssl)
        except (OSError, asyncio.TimeoutError) as exc:
            self._lost(replica_id)
            raise Unavailable(f"engine replica {replica_id} at {address} unreachable: {exc!r}") from None
        keepalive(writer.get_extra_info("socket"))
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await self._handshake(reader, writer)
        except BaseException as exc:
            writer.close()
            if isinstance(exc, (OSError, asyncio.IncompleteReadError)):  # OSError: also the timeout
                self._lost(replica_id)
                raise Unavailable(f"engine replica {replica_id} at {address}: handshake failed ({exc!r})") from None
            if isinstance(exc, Unavailable):
                self._lost(replica_id)
            raise
        link = self._links[replica_id] = _Link(replica_id, reader, writer)
        return link

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Prove the token to the replica, and have it prove the token first (nothing it sends is
        read before that)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(nonce)
        answer = await reader.readexactly(NONCE_BYTES + MAC_BYTES)
        replica_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(proof, mac(self._token, b"replica", nonce, replica_nonce)):
            raise Unavailable(f"{writer.get_extra_info('peername')} does not hold this application's "
                              "engine link token")
        writer.write(mac(self._token, b"ingress", nonce, replica_nonce) + frame(Hello(self._ingress_id)))

    # -- the rest of the engine client, through Serve

    async def model_info(self) -> dict:
        return await self._serve.model_info()

    async def replica_loads(self) -> list[dict]:
        return await self._serve.replica_loads()

    async def manage_lora(self, name: str, path: str | None) -> int:
        return await self._serve.manage_lora(name, path)

    async def abort(self, request_id: str) -> bool:
        for link in self._links.values():  # the stream's own abort goes to its replica; this is a fallback
            if not link.closed:
                link.send(Abort(request_id))
        return await self._serve.abort(request_id)
