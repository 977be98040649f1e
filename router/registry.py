"""Where an ingress finds the slot-aware router Serve built in its own process.

Serve builds a handle's router itself (on the handle's first call) and ships the router class by
value, so nothing hands the ingress a reference to it. Each router registers here, a module both
import by name, under ``"<app>#<deployment>"``, and the ingress looks it up when it needs it.
"""

from __future__ import annotations

from typing import Any

_routers: dict[str, Any] = {}


def register(deployment: str, router: Any) -> None:
    """``router`` routes this process's calls to ``deployment``; the latest one built wins."""
    _routers[deployment] = router


def find(deployment: str) -> Any | None:
    """This process's router for ``deployment``, None until Serve has built one."""
    return _routers.get(deployment)
