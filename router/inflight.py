"""Requests an ingress has submitted and seen finish, for the routers of its process; and
those routers, for the ingress's engine links (deployments.link), which route without a Serve call.

With deployments.mux a submit call ends as soon as its request starts, so the router cannot
tell from Serve's callbacks when the request stops taking a slot; the ingress says so here.
A module of its own on purpose: Serve ships the router class to each process pickled by
value (with a private copy of its module's globals), while this module is imported by
reference, so the ingress and the routers in its process share it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

KEPT = 4096
"""Newest ids kept: a router forgets a request once its replica's stats include it anyway."""

# Written by the ingress's event loop, read by the router's: single OrderedDict calls are atomic.
_finished: "OrderedDict[str, None]" = OrderedDict()


def request_finished(request_id: str) -> None:
    """A submitted request's stream ended here: it takes no slot any more."""
    _finished[request_id] = None
    while len(_finished) > KEPT:
        _finished.popitem(last=False)


def take_finished(request_id: str) -> bool:
    """Whether ``request_id`` finished (then forgotten here)."""
    return _finished.pop(request_id, False) is None


# The slot-aware router of each engine deployment in this process, for engine links
# (deployments.link): they route on the same loads and counts as Serve's calls do.
Chooser = Callable[[dict, frozenset], "tuple[str, str] | None"]
_choosers: dict[str, Chooser] = {}


def offer_chooser(deployment: str, choose: Chooser) -> None:
    """Called by the router of ``deployment`` ("<app>#<name>") once it knows its replicas."""
    _choosers[deployment] = choose


def choose(deployment: str, request: dict, avoid: frozenset = frozenset()) -> "tuple[str, str] | None":
    """``(replica_id, link address)`` for ``request``, not one of the replica ids in ``avoid``; None:
    no router here yet, or no such replica with a link (the caller goes through Serve)."""
    chooser = _choosers.get(deployment)
    return chooser(request, avoid) if chooser is not None else None
