"""One engine stream per (ingress, engine replica) instead of one per request.

An ingress submits each request to the replica the router picks and reads the outputs of
all its requests on that replica from one subscription, one batch per engine step: a
replica with 64 running requests sends one message per step, not 64.

``ReplicaHub`` is the replica's side (plain asyncio, no Ray: tested in-process); the
ingress's side is ``MuxEngineClient`` over a ``MuxTransport`` (engine links,
``deployments.link.LinkTransport``; in-process replicas in tests). A stream looks to the
frontend like a single request's stream: messages, the last one finished, errors raised
where they happened (a replica that dies raises in every stream it was serving, which the
frontend resumes elsewhere).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, Protocol

from deployments.engine_client import ends_request
from deployments.errors import Unavailable

logger = logging.getLogger(__name__)

ORPHAN_S = 10.0
"""Requests whose ingress has not subscribed for this long are aborted (the ingress went away)."""

Item = tuple  # (wire id, message dict or None, exception or None)


def wire_id(request: dict) -> str:
    """A request's key on the wire: one per attempt, so an error left over from a first attempt
    never reaches the resumed one (``PreparedRequest.engine_request``'s ``attempt``)."""
    attempt = request.get("attempt", 0)
    return request["request_id"] if not attempt else f"{request['request_id']}~{attempt}"


class _Channel:
    """One ingress's outputs on this replica, buffered until its subscription reads them."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.ready = asyncio.Event()
        self.pumps: dict[str, asyncio.Task] = {}
        self.subscriber: object | None = None  # the open subscription, if any
        self.last_seen = time.monotonic()  # last time a subscription read or a request arrived

    def push(self, item: Item) -> None:
        self.items.append(item)
        self.ready.set()


class ReplicaHub:
    """The engine replica's side: runs submitted requests, batches their outputs per ingress.

    ``start(request)`` is the replica's per-request stream (``EngineReplica.generate``):
    an async iterator of wire messages whose closing aborts the request; each submitted
    request is pumped from it into its ingress's channel.
    """

    def __init__(self, start: Callable[[dict], AsyncIterator[dict]]) -> None:
        self._start = start
        self._channels: dict[str, _Channel] = {}
        self._unstarted: dict[str, tuple[_Channel, dict]] = {}  # submitted, pump not run yet
        self._reaper: asyncio.Task | None = None

    def submit(self, request: dict) -> None:
        channel = self._channel(request["ingress_id"])
        channel.last_seen = time.monotonic()
        key = wire_id(request)
        self._unstarted[key] = channel, request
        channel.pumps[key] = asyncio.get_running_loop().create_task(self._pump(channel, key, request))
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_orphans())

    def abort_unstarted(self, request_id: str) -> bool:
        """Abort a request submitted but not yet handed to the engine (its submit and abort came in
        one read): it ends with finish_reason "abort" and never runs. False: not waiting here."""
        key = next((k for k, (_, r) in self._unstarted.items() if r["request_id"] == request_id), None)
        if key is None:
            return False
        channel, request = self._unstarted.pop(key)
        task = channel.pumps.pop(key, None)
        if task is not None:
            task.cancel()
        channel.push((key, aborted_message(request), None))
        return True

    def _channel(self, ingress_id: str) -> _Channel:
        channel = self._channels.get(ingress_id)
        if channel is None:
            channel = self._channels[ingress_id] = _Channel()
        return channel

    async def _pump(self, channel: _Channel, key: str, request: dict) -> None:
        self._unstarted.pop(key, None)
        stream = self._start(request)
        try:
            async for message in stream:
                channel.push((key, message, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the request's own error, raised in its stream
            channel.push((key, None, exc))
        finally:
            channel.pumps.pop(key, None)
            await stream.aclose()  # a cancelled pump aborts its engine request here

    async def subscribe(self, ingress_id: str) -> AsyncIterator[list[Item]]:
        """Batches of ``(wire id, message, error)``: everything since the previous batch, until
        the subscriber goes away. A new subscription of the same ingress takes over from an
        older one still open (its connection dropped and the ingress connected again)."""
        channel = self._channel(ingress_id)
        me = object()
        channel.subscriber = me
        channel.ready.set()  # an older subscription wakes up and sees it is replaced
        try:
            while channel.subscriber is me:
                if not channel.items:
                    await channel.ready.wait()
                channel.ready.clear()
                if channel.items and channel.subscriber is me:
                    batch, channel.items = channel.items, []
                    channel.last_seen = time.monotonic()
                    yield batch
        except (GeneratorExit, asyncio.CancelledError):
            if channel.subscriber is me:  # the ingress went away: its requests here have no reader
                self._cut(channel, f"the stream of ingress {ingress_id} to this engine replica was cut")
            raise
        finally:
            if channel.subscriber is me:
                channel.subscriber = None
                channel.last_seen = time.monotonic()
                if not channel.pumps and not channel.items and self._channels.get(ingress_id) is channel:
                    del self._channels[ingress_id]

    def _cut(self, channel: _Channel, reason: str) -> None:
        """Abort every request of ``channel``, each leaving an error in it: a request whose submit was
        still under way when the stream broke is waited for by the ingress's next subscription."""
        for key, task in list(channel.pumps.items()):
            task.cancel()
            self._unstarted.pop(key, None)
            channel.pumps.pop(key, None)
            channel.push((key, None, Unavailable(f"{reason}; request {key} aborted")))

    async def _reap_orphans(self) -> None:
        while True:
            await asyncio.sleep(ORPHAN_S / 4)
            now = time.monotonic()
            for ingress, channel in list(self._channels.items()):
                if channel.subscriber is not None or now - channel.last_seen < ORPHAN_S:
                    continue
                if channel.pumps:
                    logger.warning("ingress %s has not read its %d streams for %.0f s: aborting them",
                                   ingress, len(channel.pumps), ORPHAN_S)
                self._cut(channel, f"no ingress read these streams for {ORPHAN_S:.0f} s")
                del self._channels[ingress]

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()


class MuxTransport(Protocol):
    """How an ingress reaches engine replicas (engine links, or in-process replicas), with the
    rest of ``engine_client.EngineClient`` (``model_info``, ``replica_loads``)."""

    async def submit(self, request: dict) -> str:
        """Start ``request`` on the replica the router picks; that replica's id."""

    def subscribe(self, replica_id: str, ingress_id: str) -> AsyncIterator[list[Item]]: ...

    async def abort_on(self, request_id: str, replica_id: str, index: int | None = None) -> bool:
        """Abort a request (or its choice ``index``) on the replica running it."""

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it runs (every replica is asked)."""


class _MuxStream:
    """One request's messages, fed by its replica's subscription (``EngineStream`` contract)."""

    def __init__(self, client: "MuxEngineClient", request: dict) -> None:
        self._client = client
        self._request = request
        self.request_id = request["request_id"]
        self.wire_id = wire_id(request)
        self.replica_id: str | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self._started = False
        self._done = False
        self.abort_wanted = False
        self._pending_error: BaseException | None = None
        self._held: list[dict] = []  # caught up with, handed out one per call

    def __aiter__(self) -> "_MuxStream":
        return self

    async def __anext__(self) -> dict:
        if self._done:
            raise StopAsyncIteration
        if not self._started:
            self._started = True
            self._client._start(self)
        if self._held:
            message, error = self._held.pop(0), None
        elif self._pending_error is not None:
            message, error = None, self._pending_error
        else:
            message, error = await self.queue.get()
            if error is None and not self.queue.empty():
                message = self._catch_up(message)
        if error is not None or ends_request(message):
            self._done = True
            self._client._forget(self)
        if error is not None:
            raise error
        return message

    def _catch_up(self, message: dict) -> dict:
        """Behind: everything queued as one message per choice (one hop less per step missed), the
        one that ends the request last; an error that came is raised after them."""
        by_choice = {message.get("index", 0): message}
        while not self.queue.empty():
            later, error = self.queue.get_nowait()
            if error is not None:
                self._pending_error = error
                break
            i = later.get("index", 0)
            by_choice[i] = merge_messages(by_choice[i], later) if i in by_choice else later
        first, *self._held = sorted(by_choice.values(), key=ends_request)
        return first

    def abort(self, index: int | None = None) -> None:
        if index is not None:  # one choice: it ended at the ingress, so its replica is known
            if self.replica_id is not None and not self._done:
                self._client._spawn(self._client.transport.abort_on(self.request_id, self.replica_id, index))
            return
        self.abort_wanted = True
        if self.replica_id is not None and not self._done:
            self._client._spawn(self._client.transport.abort_on(self.request_id, self.replica_id))
        # else: still submitting; the abort goes out once the replica is known (MuxEngineClient._submit)

    async def aclose(self) -> None:
        if not self._done:
            self.abort()
            self._done = True
            self._client._forget(self)


def aborted_message(request: dict) -> dict:
    """The last message of a request aborted before the engine saw it (``replica.stream_message``'s form)."""
    return {"token_ids": [], "finish_reason": "abort", "logprobs": None,
            "num_prompt_tokens": len(request.get("prompt_token_ids", ())), "num_output_tokens": 0,
            "num_cached_tokens": 0}


def merge_messages(first: dict, later: dict) -> dict:
    """Two consecutive engine messages of one request as one: tokens (and logprobs) joined,
    everything else (counts, finish reason) as of the later one."""
    merged = {**later, "token_ids": list(first["token_ids"]) + list(later["token_ids"])}
    if first.get("prompt_logprobs") is not None:  # on a choice's first message only
        merged["prompt_logprobs"] = first["prompt_logprobs"]
    if first.get("logprobs") is not None or later.get("logprobs") is not None:
        merged["logprobs"] = list(first.get("logprobs") or ()) + list(later.get("logprobs") or ())
    return merged


class MuxEngineClient:
    """``generate`` over per-replica subscriptions; the other ``EngineClient`` calls pass through."""

    def __init__(self, transport: MuxTransport, on_done: Callable[[str], None] | None = None) -> None:
        """``transport`` also serves ``model_info``, ``replica_loads`` and ``abort`` (an EngineClient);
        ``on_done(request_id)``: a stream ended (the router stops counting it as load)."""
        self.transport = transport
        self._on_done = on_done
        self.ingress_id = uuid.uuid4().hex
        self._streams: dict[str, _MuxStream] = {}
        self._subscriptions: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()

    def generate(self, request: dict) -> _MuxStream:
        return _MuxStream(self, {**request, "ingress_id": self.ingress_id})

    def _start(self, stream: _MuxStream) -> None:
        # Registered before submitting, and not waiting for the submit's reply: the first token
        # often comes on an open subscription before the reply does.
        self._streams[stream.wire_id] = stream
        self._spawn(self._submit(stream))

    async def _submit(self, stream: _MuxStream) -> None:
        try:
            replica_id = await self.transport.submit(stream._request)
        except Exception as exc:  # noqa: BLE001 - refused or no replica: the stream raises it
            stream.queue.put_nowait((None, exc))
            return
        stream.replica_id = replica_id
        if stream.abort_wanted:  # aborted or closed while submitting
            await self.transport.abort_on(stream.request_id, replica_id)
            return
        if replica_id not in self._subscriptions:
            self._subscriptions[replica_id] = self._spawn(self._read(replica_id))

    async def _read(self, replica_id: str) -> None:
        error: BaseException | None = None
        try:
            async for batch in self.transport.subscribe(replica_id, self.ingress_id):
                for key, message, exc in batch:
                    stream = self._streams.get(key)
                    if stream is not None:
                        stream.queue.put_nowait((message, exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the replica went away: every stream it served hears it
            error = exc
        finally:
            self._subscriptions.pop(replica_id, None)
        orphans = [s for s in self._streams.values() if s.replica_id == replica_id and not s._done]
        for stream in orphans:
            stream.queue.put_nowait((None, error or Unavailable(f"engine replica {replica_id} has no stream "
                                                                "for this request any more")))

    def _forget(self, stream: _MuxStream) -> None:
        if self._streams.get(stream.wire_id) is stream:
            del self._streams[stream.wire_id]
            if self._on_done is not None:
                self._on_done(stream.request_id)

    def _spawn(self, coro: Awaitable) -> asyncio.Task:
        # A fresh context: Serve's request context would tie this call to the request that
        # happened to start it (Serve indexes in-flight calls by the request they serve).
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def model_info(self) -> dict:
        return await self.transport.model_info()

    async def replica_loads(self) -> list[dict]:
        return await self.transport.replica_loads()

    async def manage_lora(self, name: str, path: str | None) -> int:
        return await self.transport.manage_lora(name, path)

    async def abort(self, request_id: str) -> bool:
        return await self.transport.abort(request_id)
