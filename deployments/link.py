"""The engine link: an ingress reaches an engine replica over one plain TCP connection.

With ``deployments.mux`` an ingress already reads all its requests on a replica from one
stream, but each request still starts with a Serve call and each engine step still comes
back as a Serve streaming message: a few milliseconds of time to first token and most of a
millisecond of CPU per message on both sides (docs/BENCHMARKS.md). Here the ingress picks
the replica with the same slot-aware router (``router.inflight.choose``, which reads the
router Serve keeps up to date in its process), then writes the request on a connection to
that replica, which answers on the same connection with one frame per engine step. Serve
still builds, scales, health-checks and routes everything else (the first requests before
the router has heard from any replica, ``model_info``, loads, drains).

Frames are a 4-byte length and a pickle, as Ray's own calls are: the link listens on the
node's address like Ray's ports do, and a connection is served only once it has sent the
application's random token (``new_token``), compared in constant time before anything is
unpickled.

``LinkServer`` is the replica's side (over its ``mux.ReplicaHub``), ``LinkTransport`` the
ingress's (a ``mux.MuxTransport``); both are plain asyncio, tested over loopback without Ray.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import socket
import struct
import time
from typing import Any, AsyncIterator, Callable, Protocol

from deployments.errors import Unavailable
from deployments.mux import Item, ReplicaHub

logger = logging.getLogger(__name__)
access_log = logging.getLogger("ray.serve")
"""One line per linked request as it ends (``LINK <request id> OK|ERROR|CANCELLED <ms>ms``), in the
replica's Serve log beside Serve's own ``CALL`` lines, which linked requests no longer make."""

TOKEN_BYTES = 16
LINK_TOKEN_ENV = "SLOTSERVE_LINK_TOKEN"
"""Where ``build_app`` takes the token from (hex, 32 digits) before making one up."""
HELLO_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
MAX_FRAME_BYTES = 256 << 20  # a 2 MB prompt is ~2 MB of token ids pickled; far below this
_HEADER = struct.Struct("!I")


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


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"link frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    return pickle.loads(await reader.readexactly(size))


def _portable(batch: list[Item]) -> list[Item]:
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


def _keepalive(sock: socket.socket | None) -> None:
    """Probe an idle link: a replica whose node vanished sends no FIN, and its streams would wait
    for their deadlines; with these they fail (and resume elsewhere) within ~25 s."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", 25_000)):  # ms; the same bound while data is unacknowledged
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _log_access(request_id: str, status: str, since: float) -> None:
    access_log.info("LINK %s %s %.1fms", request_id, status, (time.monotonic() - since) * 1e3)


class Replica(Protocol):
    """What the link needs of ``replica.EngineReplica``."""

    async def submit(self, request: dict) -> str: ...

    def abort(self, request: str | dict) -> bool: ...


class LinkServer:
    """A replica's link endpoint: ``("hello", ingress_id)``, then ``("submit", request)`` and
    ``("abort", request_id)`` frames in; batches of ``(request_id, message, error)`` out."""

    def __init__(self, replica: Replica, hub: ReplicaHub, token: str, host: str = "127.0.0.1") -> None:
        check_token(token)
        self._replica = replica
        self._hub = hub
        self._token = bytes.fromhex(token)
        # Bound now, so the address is known from the start (the routing stats carry it).
        self._sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address = f"{host}:{self._sock.getsockname()[1]}" if ":" not in host else \
            f"[{host}]:{self._sock.getsockname()[1]}"
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self.requests = 0  # submitted over links (reported with the routing stats)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._sock)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(asyncio.current_task())
        forward: asyncio.Task | None = None
        try:
            token = await asyncio.wait_for(reader.readexactly(len(self._token)), HELLO_TIMEOUT_S)
            if not hmac.compare_digest(token, self._token):
                logger.warning("engine link from %s refused: wrong token", writer.get_extra_info("peername"))
                return
            kind, ingress_id = await asyncio.wait_for(_read_frame(reader), HELLO_TIMEOUT_S)
            if kind != "hello" or not isinstance(ingress_id, str):
                return
            started: dict[str, float] = {}  # request id -> when it came, until it ends
            forward = asyncio.create_task(self._forward(ingress_id, writer, started))
            forward.add_done_callback(lambda _: writer.close())  # a broken forwarder ends the link
            while True:
                kind, value = await _read_frame(reader)
                if kind == "submit":
                    self.requests += 1
                    started[value["request_id"]] = time.monotonic()
                    try:
                        await self._replica.submit(value)
                    except Exception as exc:  # noqa: BLE001 - refused (shutting down): its stream hears it
                        writer.write(_frame(_portable([(value.get("request_id"), None, exc)])))
                elif kind == "abort":
                    self._replica.abort(value)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, TimeoutError):
            pass  # the ingress went away: cancelling the forwarder aborts its requests here (mux)
        except asyncio.CancelledError:
            pass  # closed by us (shutdown)
        except Exception:  # noqa: BLE001 - a bad frame ends this link, never the replica
            logger.exception("engine link from %s failed", writer.get_extra_info("peername"))
        finally:
            if forward is not None:
                forward.cancel()
                await asyncio.gather(forward, return_exceptions=True)
                for rid, t0 in started.items():  # cut off with the link: the replica aborts them
                    _log_access(rid, "CANCELLED", t0)
            writer.close()
            self._connections.discard(asyncio.current_task())

    async def _forward(self, ingress_id: str, writer: asyncio.StreamWriter, started: dict[str, float]) -> None:
        async for batch in self._hub.subscribe(ingress_id, idle_end_s=None):
            writer.write(_frame(_portable(batch)))
            for rid, message, exc in batch:
                if exc is not None or message.get("finish_reason") is not None:
                    t0 = started.pop(rid, None)
                    if t0 is not None:
                        _log_access(rid, "OK" if exc is None else "ERROR", t0)
            await writer.drain()  # a slow ingress holds its own batches back, nothing else

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is None:
            self._sock.close()


class _Link:
    """The ingress's connection to one replica: writes from anywhere, one reader (``batches``)."""

    def __init__(self, replica_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.replica_id = replica_id
        self.reader = reader
        self.writer = writer
        self.closed = False

    def send(self, kind: str, value: Any) -> None:
        if self.closed:
            raise Unavailable(f"the link to engine replica {self.replica_id} is closed")
        self.writer.write(_frame((kind, value)))

    async def batches(self) -> AsyncIterator[list[Item]]:
        try:
            while True:
                yield await _read_frame(self.reader)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise Unavailable(f"engine replica {self.replica_id} closed its link ({type(exc).__name__})") from None
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

    def __init__(self, serve: Any, token: str, choose: Chooser) -> None:
        check_token(token)
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
        link.send("submit", request)
        return replica_id

    async def subscribe(self, replica_id: str, ingress_id: str) -> AsyncIterator[list[Item]]:
        self._ingress_id = ingress_id
        link = await self._link(replica_id)
        try:
            async for batch in link.batches():
                yield batch
        except Unavailable:
            self._failed[replica_id] = time.monotonic()
            raise

    async def abort_on(self, request_id: str, replica_id: str) -> bool:
        link = self._links.get(replica_id)
        if link is None or link.closed:
            return await self._serve.abort_on(request_id, replica_id)
        link.send("abort", request_id)
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
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)),
                                                    CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, TimeoutError) as exc:
            self._failed[replica_id] = time.monotonic()
            raise Unavailable(f"engine replica {replica_id} at {address} unreachable: {exc}") from None
        _keepalive(writer.get_extra_info("socket"))
        writer.write(self._token + _frame(("hello", self._ingress_id)))
        link = self._links[replica_id] = _Link(replica_id, reader, writer)
        return link

    # -- the rest of the engine client, through Serve

    async def model_info(self) -> dict:
        return await self._serve.model_info()

    async def replica_loads(self) -> list[dict]:
        return await self._serve.replica_loads()

    async def abort(self, request_id: str) -> bool:
        for link in self._links.values():  # the stream's own abort goes to its replica; this is a fallback
            if not link.closed:
                link.send("abort", request_id)
        return await self._serve.abort(request_id)
