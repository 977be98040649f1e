"""The ingress's side of the engine links (``deployments.link``): an ``EngineClient``, and beside it
what still goes through Serve (``HandleEngineClient``: model info, LoRA loads, the first replica).

Each request goes to the replica the slot-aware router picks (``choose``), written on this
ingress's one connection to that replica; a reader per connection hands each stream its
messages. A stream looks to the frontend like a single request's stream: messages, the last one
finished, errors raised where they happened. A connection that fails (closed, keepalive expired,
a bad frame) raises ``Unavailable`` in every stream it carried, which the frontend resumes
elsewhere, and its replica is not chosen again for ``AVOID_S``.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import secrets
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import msgspec

from deployments.contract import (LINK_VERSION, Abort, EngineMessage, EngineRequest, Found, Hello, Submit, coalesce,
                                  frame, read_outputs)
from deployments.errors import Unavailable
from deployments.link_auth import MAC_BYTES, NONCE_BYTES, LinkTls, ReloadingTls, keepalive, link_keys, mac, proven_key
from router import registry
from router.policy import RoutingStats

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

CONNECT_TIMEOUT_S = 5.0
ABORT_REPLY_S = 10.0
AVOID_S = 30.0
"""A replica whose link failed is not chosen again for this long: the router's view (Serve's)
still lists a dead replica for a while, and the requests it lost resume at once."""

Chooser = Callable[[dict, frozenset], "tuple[str, str] | None"]


class LinkStream:
    """One request's messages, fed by its replica's connection (``EngineStream`` contract)."""

    def __init__(self, client: "LinkEngineClient", request: EngineRequest) -> None:
        self._client = client
        self.request = request
        self.request_id = request.request_id
        self.wire_id = request.wire_id
        self.replica_id: str | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = False
        self.done = False
        self.abort_wanted = False
        self._pending_error: BaseException | None = None
        self._held: list[EngineMessage] = []  # caught up with, handed out one per call

    def __aiter__(self) -> "LinkStream":
        return self

    async def __anext__(self) -> EngineMessage:
        if self.done:
            raise StopAsyncIteration
        if not self.started:
            self.started = True
            self._client.start(self)
        if self._held:
            message, error = self._held.pop(0), None
        elif self._pending_error is not None:
            message, error = None, self._pending_error
        else:
            message, error = await self.queue.get()
            if error is None and not self.queue.empty():
                message = self._catch_up(message)
        if error is not None or message.ends_request:
            self.done = True
            self._client.forget(self)
        if error is not None:
            raise error
        return message

    def _catch_up(self, message: EngineMessage) -> EngineMessage:
        """Behind: everything queued as one message per choice (one hop less per step missed), the
        one that ends the request last; an error that came is raised after them."""
        messages = [message]
        while not self.queue.empty():
            later, error = self.queue.get_nowait()
            if error is not None:
                self._pending_error = error
                break
            messages.append(later)
        first, *self._held = coalesce(messages)
        return first

    def abort(self, index: int | None = None) -> None:
        if index is None:
            self.abort_wanted = True  # still submitting: the request is never sent, and ends as aborted
        if self.replica_id is not None and not self.done:
            self._client.abort_on(self.request_id, self.replica_id, index)

    async def aclose(self) -> None:
        if not self.done:
            self.abort()
            self.done = True
            self._client.forget(self)


class _Link:
    """This ingress's connection to one replica: writes from anywhere, one reader task."""

    def __init__(self, replica_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.replica_id = replica_id
        self.reader = reader
        self.writer = writer
        self.closed = False

    def send(self, message: Submit | Abort) -> None:
        if self.closed:
            raise Unavailable(f"the link to engine replica {self.replica_id} is closed")
        self.writer.write(frame(message))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


class LinkEngineClient:
    """``EngineClient`` over engine links; ``serve`` (``HandleEngineClient``, or
    ``engine_client.LocalEngineClient`` in tests) carries what is not per request.

    ``choose(request, avoid)``: ``(replica_id, link address)`` from the slot-aware router, among
    replicas not in ``avoid``; None when it has none with a link (yet): then ``serve.link_address``
    (a call Serve routes and queues) names the replica. ``on_done(request_id)``: a stream ended (the
    router stops counting it as load).
    """

    def __init__(self, serve: Any, token: str, choose: Chooser | None = None, tls: LinkTls | None = None,
                 on_done: Callable[[str], None] | None = None) -> None:
        self._keys = link_keys(token)
        self._tls = ReloadingTls(tls, server=False) if tls is not None else None
        self._serve = serve
        self._choose = choose or (lambda request, avoid: None)
        self._on_done = on_done
        self.ingress_id = uuid.uuid4().hex
        self._streams: dict[str, LinkStream] = {}
        self._links: dict[str, _Link] = {}
        self._opening: dict[str, asyncio.Future] = {}
        self._failed: dict[str, float] = {}  # replica id -> when its link failed
        self._tasks: set[asyncio.Task] = set()
        self._replies: dict[int, tuple[_Link, asyncio.Future]] = {}  # aborts by request id awaiting Found
        self._reply_ids = itertools.count()

    def generate(self, request: EngineRequest) -> LinkStream:
        return LinkStream(self, msgspec.structs.replace(request, ingress_id=self.ingress_id))

    def start(self, stream: LinkStream) -> None:
        # Registered before submitting: the first message can come before the submit returns.
        self._streams[stream.wire_id] = stream
        self.spawn(self._submit(stream))

    async def _submit(self, stream: LinkStream) -> None:
        try:
            link = await self._link_for(stream.request)
            stream.replica_id = link.replica_id  # from here on, the link's failure reaches the stream
            if stream.abort_wanted:  # aborted or closed while submitting: it ends as an abort, never sent
                stream.queue.put_nowait((EngineMessage.aborted(len(stream.request.prompt_token_ids)), None))
                return
            link.send(Submit(stream.request))
        except Exception as exc:  # noqa: BLE001 - refused, no replica, unreachable: the stream raises it
            stream.queue.put_nowait((None, exc))

    async def _link_for(self, request: EngineRequest) -> _Link:
        choice = self._choose(request, self._avoid())
        if choice is None:
            choice = await self._serve.link_address(request)
        return await self._link_to(*choice)

    async def _link_to(self, replica_id: str, address: str) -> _Link:
        link = self._links.get(replica_id)
        if link is not None and not link.closed:
            return link
        opening = self._opening.get(replica_id)
        if opening is None:  # one connection per replica, however many requests ask at once
            opening = self._opening[replica_id] = asyncio.ensure_future(self._open(replica_id, address))
            opening.add_done_callback(lambda _: self._opening.pop(replica_id, None))
        return await asyncio.shield(opening)

    def _avoid(self) -> frozenset:
        now = time.monotonic()
        for rid in [rid for rid, t in self._failed.items() if now - t > AVOID_S]:
            del self._failed[rid]
        return frozenset(self._failed)

    async def _open(self, replica_id: str, address: str) -> _Link:
        host, _, port = address.rpartition(":")
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(host.strip("[]"), int(port), ssl=self._tls and self._tls.current())
        except (OSError, asyncio.TimeoutError) as exc:
            self._failed[replica_id] = time.monotonic()
            raise Unavailable(f"engine replica {replica_id} at {address} unreachable: {exc!r}") from None
        keepalive(writer.get_extra_info("socket"))
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await self._handshake(reader, writer)
        except BaseException as exc:
            writer.close()
            if isinstance(exc, (OSError, asyncio.IncompleteReadError, Unavailable)):  # OSError: also the timeout
                self._failed[replica_id] = time.monotonic()
                raise Unavailable(f"engine replica {replica_id} at {address}: handshake failed ({exc})") from None
            raise
        link = self._links[replica_id] = _Link(replica_id, reader, writer)
        self.spawn(self._read(link))
        return link

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Prove the token to the replica, and have it prove the token first (nothing it sends is
        read before that)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(nonce)
        answer = await reader.readexactly(NONCE_BYTES + MAC_BYTES)
        replica_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        key = proven_key(self._keys, proof, b"replica", nonce, replica_nonce)
        if key is None:
            raise Unavailable(f"{writer.get_extra_info('peername')} does not hold this application's "
                              "engine link token")
        writer.write(mac(key, b"ingress", nonce, replica_nonce) + frame(Hello(self.ingress_id, LINK_VERSION)))

    async def _read(self, link: _Link) -> None:
        try:
            while True:
                batch = await read_outputs(link.reader)
                if isinstance(batch, Found):
                    _, answer = self._replies.get(batch.reply, (None, None))
                    if answer is not None and not answer.done():
                        answer.set_result(batch.found)
                    continue
                for key, message, exc in batch:
                    stream = self._streams.get(key)
                    if stream is not None:
                        stream.queue.put_nowait((message, exc))
        except (asyncio.IncompleteReadError, OSError) as exc:  # OSError: also a keepalive's ETIMEDOUT
            error = Unavailable(f"engine replica {link.replica_id} closed its link ({type(exc).__name__})")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            error = Unavailable(f"engine replica {link.replica_id} sent a bad frame ({exc})")
        except Exception as exc:  # noqa: BLE001 - the link is unusable either way: its streams resume elsewhere
            error = Unavailable(f"engine replica {link.replica_id}'s link failed ({exc!r})")
        finally:
            link.close()  # before the streams hear it: none is submitted on this link after
        self._failed[link.replica_id] = time.monotonic()
        if self._links.get(link.replica_id) is link:
            del self._links[link.replica_id]
        for stream in [s for s in self._streams.values() if s.replica_id == link.replica_id and not s.done]:
            stream.queue.put_nowait((None, error))
        for on, answer in self._replies.values():
            if on is link and not answer.done():
                answer.set_exception(error)

    def forget(self, stream: LinkStream) -> None:
        if self._streams.get(stream.wire_id) is stream:
            del self._streams[stream.wire_id]
            if self._on_done is not None:
                self._on_done(stream.request_id)

    def spawn(self, coro: Awaitable) -> asyncio.Task:
        # A fresh context: Serve's request context would tie this call to the request that
        # happened to start it (Serve indexes in-flight calls by the request they serve).
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def abort_on(self, request_id: str, replica_id: str, index: int | None = None) -> bool:
        """Abort a request (or its choice ``index``) on the replica running it."""
        link = self._links.get(replica_id)
        if link is None or link.closed:  # its link is gone, and the request with it
            return False
        link.send(Abort(request_id, index))
        return True

    # -- what is not per request, through Serve

    async def model_info(self) -> dict:
        return await self._serve.model_info()

    async def replica_loads(self) -> list[RoutingStats]:
        return await self._serve.replica_loads()

    async def manage_lora(self, name: str, path: str | None) -> int:
        return await self._serve.manage_lora(name, path)

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it runs (one another ingress streams too): every replica with a
        link is asked over it, all at once; True when one ran it."""
        replicas = await self._linked_replicas()
        answers = await asyncio.gather(*(self._ask_abort(request_id, *r) for r in replicas), return_exceptions=True)
        return any(answer is True for answer in answers)

    async def _linked_replicas(self) -> list[tuple[str, str]]:
        """``(replica id, link address)`` of every replica, as Serve's router polled them. An ingress
        that has routed nothing yet has no such view: it waits for one, up to ``ABORT_REPLY_S``."""
        deadline = time.monotonic() + ABORT_REPLY_S
        while True:
            replicas = [(s.replica_id, s.link) for s in await self._serve.replica_loads() if s.link is not None]
            if replicas or time.monotonic() > deadline:
                return replicas
            await asyncio.sleep(0.1)

    async def _ask_abort(self, request_id: str, replica_id: str, address: str) -> bool:
        link = await self._link_to(replica_id, address)
        reply = next(self._reply_ids)
        answer = asyncio.get_running_loop().create_future()
        self._replies[reply] = link, answer
        try:
            link.send(Abort(request_id, reply=reply))
            async with asyncio.timeout(ABORT_REPLY_S):
                return await answer
        finally:
            del self._replies[reply]


# -- what goes through Serve

class LinkRouter(Protocol):
    """What the ingress asks of ``router.request_router.SlotAwareRequestRouter``."""

    def choose_for_link(self, request: EngineRequest, avoid: frozenset = frozenset()) -> "tuple[str, str] | None":
        """``(replica_id, link address)`` for ``request``, not one in ``avoid``; counted as sent."""

    def request_finished(self, request_id: str) -> None:
        """A request sent with ``choose_for_link`` ended: it takes no slot any more."""

    def replica_stats(self) -> list[RoutingStats]:
        """The routing stats of every running replica, as last polled (``healthy: False`` when none yet)."""


class HandleEngineClient:
    """What goes through Serve (``LinkEngineClient``'s ``serve``), and what the router
    Serve runs in this process knows, once Serve has built it (``router.registry``)."""

    def __init__(self, handle: DeploymentHandle, deployment: str) -> None:
        self._handle = handle
        self._deployment = deployment  # "<app>#<name>"
        self._first_call: asyncio.Future | None = None

    @property
    def _router(self) -> LinkRouter | None:
        return registry.find(self._deployment)

    async def model_info(self) -> dict:
        return await self._handle.model_info.remote()

    async def replica_loads(self) -> list[RoutingStats]:
        """Every replica's routing stats, as this process's router last polled them; none before
        Serve has made that router, which a handle's first call does (started here, not awaited:
        it waits for a replica, and a health check asking for loads must not)."""
        router = self._router
        if router is None:
            if self._first_call is None or self._first_call.done():
                self._first_call = asyncio.ensure_future(self.model_info())
                self._first_call.add_done_callback(lambda f: f.cancelled() or f.exception())  # no replica yet: retried
            return []
        return router.replica_stats()

    async def manage_lora(self, name: str, path: str | None) -> int:
        """Every replica loads (or unloads) the adapter: one call each, pinned to it by the slot-aware router."""
        # One at a time: handle calls made while serving one request share its internal request id,
        # and Serve's router (2.60) indexes pending calls by it, so a second concurrent call is
        # never matched to the replica chosen for it and hangs.
        done = 0
        for stats in await self.replica_loads():
            await self._handle.manage_lora.remote({"replica_id": stats.replica_id, "lora_name": name,
                                                   "lora_path": path})
            done += 1
        return done

    async def link_address(self, request: EngineRequest) -> tuple[str, str]:
        """A replica for ``request`` and its link address, routed (and queued) by Serve."""
        return await self._handle.link_address.remote(request)

    def choose(self, request: EngineRequest, avoid: frozenset) -> tuple[str, str] | None:
        router = self._router
        return router.choose_for_link(request, avoid) if router is not None else None

    def request_finished(self, request_id: str) -> None:
        router = self._router
        if router is not None:
            router.request_finished(request_id)
