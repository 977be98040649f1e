"""How an ingress finds the slot-aware router Serve runs in its own process.

The ingress routes each request itself and sends it over an engine link (deployments.link): a
Serve call per request would cost milliseconds of time to first token. It routes with the
router Serve keeps up to date in the same process (replicas, their polled routing stats), which
registers itself here once it knows its replicas. A module of its own because Serve ships the
router class pickled by value, with a private copy of its own module; this one is imported by
reference, so the router and the ingress of a process meet in it. It holds that one table.
"""

from __future__ import annotations

from typing import Protocol


class LinkRouter(Protocol):
    """What the ingress asks of ``router.request_router.SlotAwareRequestRouter``."""

    def choose_for_link(self, request: dict, avoid: frozenset = frozenset()) -> "tuple[str, str] | None":
        """``(replica_id, link address)`` for ``request``, not one in ``avoid``; counted as sent."""

    def request_finished(self, request_id: str) -> None:
        """A request sent with ``choose_for_link`` ended: it takes no slot any more."""

    def replica_stats(self) -> list[dict]:
        """The routing stats of every running replica, as last polled (``healthy: False`` when none yet)."""


_routers: dict[str, LinkRouter] = {}


def offer(deployment: str, router: LinkRouter) -> None:
    """Called by the router of ``deployment`` ("<app>#<name>") whenever Serve updates its replicas."""
    _routers[deployment] = router


def find(deployment: str) -> LinkRouter | None:
    """This process's router of ``deployment``; None until Serve made one (a first handle call does)."""
    return _routers.get(deployment)
