"""Bounded waits on a condition: tests wait for the event itself, never a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

POLL_S = 0.01


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 30.0, poll_s: float = POLL_S):
    """The first truthy value of ``condition()``; AssertionError naming ``what`` after ``timeout_s``.

    A condition that makes a call to the service should poll slower (``poll_s``): the
    waiting must not become the load."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)


async def async_wait_until(condition: Callable[[], object], what: str, timeout_s: float = 30.0):
    """``wait_until`` for a coroutine: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(POLL_S)


def fresh_replicas(get_load: Callable[[], list], timeout_s: float = 10.0) -> list:
    """The replicas ``get_load()`` lists, once every one reported after this call: the ingress
    answers GetLoad from the routing stats its router polls (``routing_stats_period_s``)."""
    since = time.time()

    def fresh():
        replicas = list(get_load())
        return replicas if replicas and all(r.updated_at > since for r in replicas) else None

    return wait_until(fresh, "a load report from every replica", timeout_s, poll_s=0.1)
