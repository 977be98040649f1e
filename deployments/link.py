"""The engine link: how an ingress reaches an engine replica, one TCP connection per pair.

A Serve call per request and a Serve streaming message per engine step would cost a few
milliseconds of time to first token and most of a millisecond of CPU per message on both
sides (docs/BENCHMARKS.md). Instead the ingress picks the replica with the slot-aware router
(the router Serve keeps up to date in its process, which attaches itself to the ingress), then
writes the request on its connection to that replica, which answers on the same connection
with one frame per engine step carrying every request of that ingress that made progress.
Serve still builds, scales, health-checks and drains the replicas, carries what is not per
request (``model_info``, loads), and routes ``link_address`` for an ingress whose router has
not heard from any replica yet (its first requests, or none running: Serve's queue is what the
autoscaler scales up from).

Frames are typed MessagePack (``deployments.contract``): nothing read from the socket is
unpickled or run, and no frame is read at all before both sides have proved they hold the
application's random token (``new_token``): each sends a fresh nonce and an HMAC of both nonces
under the token, so the token never crosses the wire and a recorded handshake cannot be replayed;
with ``engine_link_tls`` the connection is mutual TLS as well. Both sides probe an idle connection
(TCP keepalive), and the replica bounds what a stalled ingress can make it buffer.

A request lives as long as the connection it came on: when the connection ends, for whatever
reason, the replica aborts its requests and the ingress resumes them elsewhere.

``LinkServer`` is the replica's side, ``deployments.link_client.LinkEngineClient`` the ingress's;
both are plain asyncio, tested over loopback without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from typing import AsyncIterator, Protocol

import msgspec

from deployments.contract import (LINK_VERSION, Abort, EngineMessage, EngineRequest, Found, Hello, SubmitIn, frame,
                                  outputs, read_ingress_frame)
from deployments.link_auth import (LINK_TOKEN_ENV, MAC_BYTES, NONCE_BYTES, LinkTls, ReloadingTls, check_token,
                                   keepalive, link_keys, mac, new_token, proven_key)

__all__ = ["LINK_TOKEN_ENV", "LinkServer", "LinkTls", "check_token", "new_token"]

logger = logging.getLogger(__name__)
access_log = logging.getLogger("ray.serve")
"""One line per linked request as it ends (``LINK <request id> OK|ERROR|CANCELLED <ms>ms``), in the
replica's Serve log beside Serve's own ``CALL`` lines, which linked requests do not make."""

HELLO_TIMEOUT_S = 5.0
MAX_BACKLOG_ITEMS = 1 << 16
WRITE_STALL_S = 30.0
"""An ingress that leaves this many outputs unread, or takes no bytes for this long, is stalled: its
link is closed and its requests here aborted (it resumes them elsewhere), instead of the replica
buffering for it without bound."""


async def settle(task: asyncio.Task) -> None:
    """Wait for a cancelled task; an error it ended with is logged, not lost."""
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - already ending; say why
        logger.exception("engine link task failed")


class Replica(Protocol):
    """What the link needs of ``replica.EngineReplica``."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineMessage]: ...

    def abort(self, request_id: str, index: int | None = None) -> bool: ...


class Connection:
    """One ingress's connection: its requests' pumps and the outputs they wait to send."""

    def __init__(self, ingress_id: str) -> None:
        self.ingress_id = ingress_id
        self.items: list[tuple] = []  # (wire id, EngineMessage or None, exception or None)
        self.ready = asyncio.Event()
        self.pumps: dict[str, asyncio.Task] = {}
        self.unstarted: dict[str, EngineRequest] = {}  # submitted in this read, not handed to the engine yet
        self.started: dict[str, float] = {}  # wire id -> when it came, until it ends (the access log)
        self.closed = False

    def push(self, item: tuple) -> None:
        self.items.append(item)
        self.ready.set()

    def close(self) -> None:
        """Abort every request of this connection: nobody reads their outputs any more."""
        self.closed = True
        for task in self.pumps.values():
            task.cancel()
        for key, t0 in self.started.items():
            log_access(key, "CANCELLED", t0)
        self.started.clear()


def log_access(request_id: str, status: str, since: float) -> None:
    access_log.info("LINK %s %s %.1fms", request_id, status, (time.monotonic() - since) * 1e3)


class LinkServer:
    """A replica's link endpoint: the handshake and a ``Hello``, then ``Submit`` and ``Abort``
    frames in; batches of ``Output`` out (``deployments.contract``)."""

    def __init__(self, replica: Replica, token: str, host: str = "127.0.0.1", tls: LinkTls | None = None) -> None:
        self._keys = link_keys(token)
        self._ssl = ReloadingTls(tls, server=True).listening if tls is not None else None
        self._replica = replica
        # Bound now, so the address is known from the start (the routing stats carry it).
        self._sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        port = self._sock.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
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
        writer.write(nonce + mac(self._keys[0], b"replica", ingress_nonce, nonce))
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            proof = await reader.readexactly(MAC_BYTES)
        if proven_key(self._keys, proof, b"ingress", ingress_nonce, nonce) is None:
            logger.warning("engine link from %s refused: wrong token", writer.get_extra_info("peername"))
            return None
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            hello = await read_ingress_frame(reader)
        if not isinstance(hello, Hello):
            return None
        if hello.version != LINK_VERSION:  # a rolling update: both serve, each ignoring what it does not know
            logger.info("engine link from ingress %s, link version %d (this replica: %d)", hello.ingress_id,
                        hello.version, LINK_VERSION)
        return hello.ingress_id

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        self._connections.add(me)
        keepalive(writer.get_extra_info("socket"))  # an ingress whose node vanished sends no FIN either
        forward: asyncio.Task | None = None
        connection: Connection | None = None
        try:
            ingress_id = await self._handshake(reader, writer)
            if ingress_id is None:
                return
            # An ingress opens a new link only once it gave up the old one (and resumed its streams
            # elsewhere): the old connection, if still open here, is stale. End it and its requests.
            stale = self._by_ingress.get(ingress_id)
            self._by_ingress[ingress_id] = me
            if stale is not None:
                stale.cancel()
                await settle(stale)
            connection = Connection(ingress_id)
            forward = asyncio.create_task(self.forward(connection, writer))
            forward.add_done_callback(lambda _: writer.close())  # a broken forwarder ends the link
            while True:
                message = await read_ingress_frame(reader)
                if isinstance(message, SubmitIn):
                    key, request = message.take()
                    if isinstance(request, Exception):
                        self.refuse(connection, key, request)
                    else:
                        self.submit(connection, request)
                elif isinstance(message, Abort):
                    found = self._abort(connection, message)
                    if message.reply is not None:
                        writer.write(frame(Found(message.reply, found)))
                else:
                    raise ValueError(f"unexpected {type(message).__name__} frame")
        except (asyncio.IncompleteReadError, OSError, asyncio.TimeoutError):
            pass  # the ingress went away (or its keepalive expired): its requests are aborted below
        except asyncio.CancelledError:
            pass  # closed by us (shutdown, or replaced by a newer link of its ingress)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:  # a frame naming no request
            logger.warning("engine link from %s closed: bad frame (%s)", writer.get_extra_info("peername"), exc)
        except Exception:  # noqa: BLE001 - anything else ends this link too, never the replica
            logger.exception("engine link from %s failed", writer.get_extra_info("peername"))
        finally:
            if connection is not None:
                connection.close()
                if self._by_ingress.get(connection.ingress_id) is me:
                    del self._by_ingress[connection.ingress_id]
            if forward is not None:
                forward.cancel()
                await settle(forward)
            writer.close()
            self._connections.discard(me)

    def submit(self, connection: Connection, request: EngineRequest) -> None:
        """Start ``request``; its outputs go out on ``connection``."""
        self.requests += 1
        key = request.wire_id
        connection.started[key] = time.monotonic()
        connection.unstarted[key] = request
        connection.pumps[key] = asyncio.get_running_loop().create_task(self._pump(connection, key, request))

    def refuse(self, connection: Connection, key: str, error: Exception) -> None:
        """Answer a request that cannot be taken with its error; nothing of it runs."""
        logger.warning("engine link from ingress %s: %s", connection.ingress_id, error)
        connection.started[key] = time.monotonic()
        connection.push((key, None, error))

    def _abort(self, connection: Connection, abort: Abort) -> bool:
        key = next((k for k, r in connection.unstarted.items() if r.request_id == abort.request_id), None)
        if key is not None and abort.index is None:  # its submit came in the same read: it never runs
            connection.pumps.pop(key).cancel()
            request = connection.unstarted.pop(key)
            connection.push((key, EngineMessage.aborted(len(request.prompt_token_ids)), None))
            return True
        return self._replica.abort(abort.request_id, abort.index)

    async def _pump(self, connection: Connection, key: str, request: EngineRequest) -> None:
        connection.unstarted.pop(key, None)
        stream = self._replica.generate(request)
        try:
            async for message in stream:
                connection.push((key, message, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the request's own error, raised in its stream at the ingress
            connection.push((key, None, exc))
        finally:
            connection.pumps.pop(key, None)
            await stream.aclose()  # a cancelled pump aborts its engine request here

    async def forward(self, connection: Connection, writer: asyncio.StreamWriter) -> None:
        """Write ``connection``'s outputs as they come, everything since the last write in one go;
        returns (its requests aborted) when the ingress stalls."""
        try:
            while True:
                await connection.ready.wait()
                connection.ready.clear()
                batch, connection.items = connection.items, []
                if writer.is_closing():  # the ingress went away: the reader ends this link
                    return
                if len(batch) > MAX_BACKLOG_ITEMS:
                    logger.warning("ingress %s left %d outputs unread: closing its link", connection.ingress_id,
                                   len(batch))
                    return
                writer.write(outputs(batch))
                for key, message, exc in batch:
                    if exc is not None or message.ends_request:
                        t0 = connection.started.pop(key, None)
                        if t0 is not None:
                            log_access(key, "OK" if exc is None else "ERROR", t0)
                # A slow ingress holds its own batches back, nothing else. Every timeout here is
                # asyncio.timeout: 3.11's wait_for can swallow the cancellation that ends a link.
                try:
                    async with asyncio.timeout(WRITE_STALL_S):
                        await writer.drain()
                except (asyncio.TimeoutError, TimeoutError):
                    logger.warning("ingress %s took nothing for %.0f s: closing its link", connection.ingress_id,
                                   WRITE_STALL_S)
                    return
        finally:
            connection.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
            await settle(task)
        if self._server is None:
            self._sock.close()
