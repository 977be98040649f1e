"""How the frontend talks to engine replicas, whatever carries the calls.

``EngineClient`` is the contract; the ingress implements it with
``link_client.LinkEngineClient`` over engine links, and ``LocalEngineClient`` over in-process
``EngineReplica`` objects, which is how the frontend, the gRPC service and the OpenAI API are
tested without Ray (alone, or as the ``LinkEngineClient``'s way to its replicas' links).
"""

from __future__ import annotations

import itertools
import time
from typing import AsyncIterator, Protocol, Sequence

from deployments.contract import EngineMessage, EngineRequest
from router.policy import RoutingStats


class EngineStream(Protocol):
    """One request's ``EngineMessage``s, the last one ``ends_request``."""

    def __aiter__(self) -> AsyncIterator[EngineMessage]: ...

    async def __anext__(self) -> EngineMessage: ...

    def abort(self, index: int | None = None) -> None:
        """Ask the engine to stop this request; the stream then ends (or raises) soon after.
        ``index``: stop only that choice; the stream goes on with the others."""

    async def aclose(self) -> None:
        """Stop consuming; a request still running is aborted in its engine."""


class EngineClient(Protocol):
    def generate(self, request: EngineRequest) -> EngineStream: ...

    async def model_info(self) -> dict:
        """``EngineReplica.model_info()`` of any replica (they all serve the same model)."""

    async def replica_loads(self) -> list[RoutingStats]:
        """``EngineReplica.routing_stats()`` of every replica."""

    async def abort(self, request_id: str) -> bool:
        """Abort the request on whichever replica runs it; False if none does."""

    async def manage_lora(self, name: str, path: str | None) -> int:
        """Load LoRA adapter ``name`` from ``path`` on every replica (unload it: ``path`` None); how many."""


class _LocalStream:
    def __init__(self, replica, request: EngineRequest) -> None:
        self._replica = replica
        self._request_id = request.request_id
        self._gen = replica.generate(request)

    def __aiter__(self) -> "_LocalStream":
        return self

    async def __anext__(self) -> EngineMessage:
        return await self._gen.__anext__()

    def abort(self, index: int | None = None) -> None:
        self._replica.abort(self._request_id, index)

    async def aclose(self) -> None:
        await self._gen.aclose()


class LocalEngineClient:
    """Round-robin over in-process replicas: no Ray, for tests and single-process use."""

    def __init__(self, replicas: Sequence) -> None:
        if not replicas:
            raise ValueError("replicas must hold at least one EngineReplica")
        self._replicas = list(replicas)
        self._next = itertools.cycle(self._replicas)

    def _pick(self, request: EngineRequest):
        request.noted("round_robin", time.time_ns())  # as the slot-aware router notes
        # Serve stops routing to a replica whose health check fails; so does this.
        for _ in range(len(self._replicas)):
            replica = next(self._next)
            if replica.healthy():
                return replica
        return replica  # none healthy: its error reaches the caller

    def generate(self, request: EngineRequest) -> EngineStream:
        return _LocalStream(self._pick(request), request)

    async def link_address(self, request: EngineRequest) -> tuple[str, str]:
        """The id and engine link address (deployments.link) of the replica picked for ``request``."""
        return await self._pick(request).link_address(request)

    async def abort(self, request_id: str) -> bool:
        return any([replica.abort(request_id) for replica in self._replicas])

    async def model_info(self) -> dict:
        return self._replicas[0].model_info()

    async def manage_lora(self, name: str, path: str | None) -> int:
        for replica in self._replicas:
            await replica.manage_lora({"lora_name": name, "lora_path": path})
        return len(self._replicas)

    async def replica_loads(self) -> list[RoutingStats]:
        return [replica.routing_stats() for replica in self._replicas]
