"""How the frontend talks to engine replicas, whatever carries the calls.

``EngineClient`` is the contract; the ingress implements it over a Ray Serve
``DeploymentHandle`` (``ingress.HandleEngineClient``) and ``LocalEngineClient`` over
in-process ``EngineReplica`` objects, which is how the frontend, the gRPC service and
the OpenAI API are tested without Ray.
"""

from __future__ import annotations

import itertools
from typing import AsyncIterator, Protocol, Sequence


class EngineStream(Protocol):
    """One request's engine messages (``replica.stream_message`` dicts), last one finished."""

    def __aiter__(self) -> AsyncIterator[dict]: ...

    async def __anext__(self) -> dict: ...

    def abort(self) -> None:
        """Ask the engine to stop this request; the stream then ends (or raises) soon after."""

    async def aclose(self) -> None:
        """Stop consuming; a request still running is aborted in its engine."""


class EngineClient(Protocol):
    def generate(self, request: dict) -> EngineStream: ...

    async def model_info(self) -> dict:
        """``EngineReplica.model_info()`` of any replica (they all serve the same model)."""

    async def replica_loads(self) -> list[dict]:
        """``EngineReplica.record_routing_stats()`` of every replica."""

    async def abort(self, request_id: str) -> bool:
        """Abort the request on whichever replica runs it; False if none does."""


class _LocalStream:
    def __init__(self, replica, request: dict) -> None:
        self._replica = replica
        self._request_id = request["request_id"]
        self._gen = replica.generate(request)

    def __aiter__(self) -> "_LocalStream":
        return self

    async def __anext__(self) -> dict:
        return await self._gen.__anext__()

    def abort(self) -> None:
        self._replica.abort(self._request_id)

    async def aclose(self) -> None:
        await self._gen.aclose()


class LocalEngineClient:
    """Round-robin over in-process replicas: no Ray, for tests and single-process use."""

    def __init__(self, replicas: Sequence) -> None:
        if not replicas:
            raise ValueError("replicas must hold at least one EngineReplica")
        self._replicas = list(replicas)
        self._next = itertools.cycle(self._replicas)

    def generate(self, request: dict) -> EngineStream:
        # Serve stops routing to a replica whose health check fails; so does this.
        for _ in range(len(self._replicas)):
            replica = next(self._next)
            if replica.healthy():
                return _LocalStream(replica, request)
        return _LocalStream(replica, request)  # none healthy: its error reaches the caller

    async def abort(self, request_id: str) -> bool:
        return any([replica.abort(request_id) for replica in self._replicas])

    async def model_info(self) -> dict:
        return self._replicas[0].model_info()

    async def replica_loads(self) -> list[dict]:
        return [replica.record_routing_stats() for replica in self._replicas]
