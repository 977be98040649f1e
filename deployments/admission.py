"""Who gets in at the ingress: API keys, and no more streams than the engines can hold.

Without the second, an ingress takes every stream Serve hands it (up to
``ingress.max_ongoing_requests``) and the excess waits on its event loop, unbounded in
practice, while engine queues never fill: admitted latency then grows with the offered
load, and refusals come late. With it, a stream past the engines' capacity is refused
at the door (RESOURCE_EXHAUSTED / 429), at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Awaitable, Callable, Sequence

logger = logging.getLogger(__name__)


class Admission:
    """This ingress's share of the streams all healthy engine replicas can run or queue
    (``max_num_seqs + max_waiting`` each), refreshed from their load reports once a second.

    A refresh asks every replica (a GCS lookup and one call each, several ms): once a limit is
    known it runs in the background and the request goes on with the last one, so a request
    after a quiet second does not wait for it."""

    REFRESH_S = 1.0

    def __init__(self, loads: Callable[[], Awaitable[list[dict]]] | None, ingress_replicas: int = 1) -> None:
        self._loads = loads
        self._share = max(1, ingress_replicas)
        self._limit: int | None = None
        self._refreshed = float("-inf")
        self._refresh_task: asyncio.Task | None = None

    async def limit(self) -> int | None:
        """None: no capacity known (no healthy replica reported yet): nothing to refuse on."""
        now = time.monotonic()
        if self._loads is not None and now - self._refreshed >= self.REFRESH_S:
            self._refreshed = now  # before the await: concurrent callers keep the last limit
            if self._limit is None:
                await self._refresh()
            elif self._refresh_task is None or self._refresh_task.done():
                self._refresh_task = asyncio.ensure_future(self._refresh())
        return self._limit

    async def _refresh(self) -> None:
        try:
            loads = await self._loads()
        except Exception:  # noqa: BLE001 - no report this time: keep the last limit
            return
        capacity = sum(r.get("max_num_seqs", 0) + r.get("max_waiting", 0) for r in loads if r.get("healthy"))
        self._limit = -(-capacity // self._share) if capacity else None


class ApiKeys:
    """The accepted keys: the configured ones plus those in a file, re-read once it changes."""

    CHECK_PERIOD_S = 1.0
    MIN_KEY_CHARS = 8

    def __init__(self, keys: Sequence[str], path: str | None) -> None:
        self._fixed = tuple(keys)
        self._path = path
        self._from_file: tuple[str, ...] = ()
        self._stamp: tuple[int, int] | None = None
        self._checked = float("-inf")
        if path is not None:
            self._reload()  # a missing or bad file fails the replica at start, not the first request

    def current(self) -> tuple[str, ...]:
        if self._path is not None and time.monotonic() - self._checked >= self.CHECK_PERIOD_S:
            try:
                self._reload()
            except (OSError, ValueError) as exc:  # keep serving with the last good keys
                logger.error("api_keys_file %s not reloaded: %s", self._path, exc)
        return self._fixed + self._from_file

    @property
    def required(self) -> bool:
        """A configured keys file asks for a key even while it holds none (fail closed)."""
        return bool(self._fixed) or self._path is not None

    def _reload(self) -> None:
        self._checked = time.monotonic()
        st = os.stat(self._path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        with open(self._path, encoding="utf-8") as f:
            keys = tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
        short = sum(len(k) < self.MIN_KEY_CHARS for k in keys)
        if short:
            raise ValueError(f"{short} key(s) shorter than {self.MIN_KEY_CHARS} characters")
        self._from_file, self._stamp = keys, stamp
        logger.info("api_keys_file %s: %d keys", self._path, len(keys))


PUBLIC_LOAD_FIELDS = ("replica_id", "healthy", "running", "waiting", "max_num_seqs", "free_slots", "kv_blocks_used",
                      "kv_blocks_total", "slot_occupancy", "kv_usage", "num_finished", "prefix_cache_hits",
                      "prefix_cache_queries", "updated_at", "lora_loaded", "lora_loads", "lora_evictions")
"""What a load report (``/load``, gRPC ``GetLoad``: its ``ReplicaLoad`` fields) tells any caller of a
replica. The rest is for routers only: engine-link addresses, adapters' paths on disk, prefix hashes."""


def summarize_load(replicas: list[dict]) -> dict:
    replicas = [{**{k: r[k] for k in PUBLIC_LOAD_FIELDS if k in r},
                 "num_prefix_hashes": len(r.get("prefix_hashes") or ())} for r in replicas]
    total = sum(r.get("max_num_seqs", 0) for r in replicas)
    running = sum(r.get("running", 0) for r in replicas)
    kv_total = sum(r.get("kv_blocks_total", 0) for r in replicas)
    kv_used = sum(r.get("kv_blocks_used", 0) for r in replicas)
    return {"replicas": replicas, "total_slots": total, "free_slots": sum(r.get("free_slots", 0) for r in replicas),
            "running": running, "waiting": sum(r.get("waiting", 0) for r in replicas),
            "occupancy": running / total if total else 0.0, "kv_usage": kv_used / kv_total if kv_total else 0.0}
