"""Tenants: who sends a request, told by its API key at the ingress (app config ``tenants``).

A tenant has its own keys, its own range of ``priority`` values, its own limits (requests in flight,
requests waiting for their first token, tokens per minute: ``deployments.admission``), and its own
prefix cache: its requests' block hashes are salted with its name, so no tenant's ``cached_tokens``
reveal anything of another's prompts unless it is configured to share (``share_cache``). Keys of the flat ``api_keys`` /
``api_keys_file`` list keep working as requests of no tenant, under the app's own limits.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Annotated, Iterable, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from deployments.errors import BadRequest
from deployments.requests import PRIORITY_RANGE
from engine.validation import Bool, Float, Int, Str

logger = logging.getLogger(__name__)


def check_bounds(bounds: tuple[int, int]) -> tuple[int, int]:
    if bounds[0] > bounds[1]:
        raise ValueError(f"must be [lowest, highest], got {list(bounds)}")
    return bounds


MIN_KEY_CHARS = 8


def check_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    if any(len(k) < MIN_KEY_CHARS for k in keys):
        raise ValueError(f"must be strings of at least {MIN_KEY_CHARS} characters")
    return keys


Priority = Annotated[Int, Field(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])]
PriorityRange = Annotated[tuple[Priority, Priority], AfterValidator(check_bounds)]
"""[lowest, highest] ``priority`` a client may send."""
ApiKeys = Annotated[tuple[Str, ...], AfterValidator(check_keys)]
"""Strings of at least 8 characters; never shown in errors or logs (give their fields repr=False)."""


class KeyList:
    """The accepted keys: the configured ones plus those in a file, re-read once it changes."""

    CHECK_PERIOD_S = 1.0

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
        short = sum(len(k) < MIN_KEY_CHARS for k in keys)
        if short:
            raise ValueError(f"{short} key(s) shorter than {MIN_KEY_CHARS} characters")
        self._from_file, self._stamp = keys, stamp
        logger.info("api_keys_file %s: %d keys", self._path, len(keys))


class TenantConfig(BaseModel):
    """One entry of the app config's ``tenants``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    api_keys: ApiKeys = Field((), repr=False)
    api_keys_file: Str | None = Field(None, min_length=1)
    """One key per line (``#`` comments), re-read when it changes, as the app's ``api_keys_file``: a
    mounted Kubernetes Secret rotates without a restart. At least one of the two is given."""
    allowed_priority: PriorityRange = (0, 0)
    share_cache: Bool = False
    """True: its prompts share cached blocks with every request of no tenant or another sharing one."""
    max_concurrent_requests: Int | None = Field(None, ge=1)
    """Requests in flight at once, over the whole deployment (``deployments.admission``); None: no limit."""
    max_tokens_per_minute: Int | None = Field(None, ge=1)
    """Prompt and output tokens a minute, over the whole deployment; None: no limit."""
    max_waiting: Int | None = Field(None, ge=1)
    """Requests admitted but without their first token yet, at once, over the whole deployment: what
    it may queue ahead of the others (``deployments.admission``); None: no limit."""
    weight: Float = Field(1.0, gt=0, le=1000)
    """Its share of the engines' service when tenants contend, relative to the others' (requests of
    no tenant weigh 1): token-fair scheduling (``engine.fairness``), and its share of an ingress's
    streams once the engines are nearly full (``deployments.admission.FairShares``)."""

    @model_validator(mode="after")
    def _has_keys(self) -> "TenantConfig":
        if not self.api_keys and self.api_keys_file is None:
            raise ValueError(f"tenant {self.name!r} needs api_keys or an api_keys_file")
        return self


def check_unique(tenants: Iterable[TenantConfig], flat_keys: Iterable[str]) -> None:
    """Each name once, and each key names one tenant (or none): else a key's tenant is a guess."""
    names, keys = set(), set(flat_keys)
    for tenant in tenants:
        if tenant.name in names:
            raise ValueError(f"tenant {tenant.name!r} is named twice")
        names.add(tenant.name)
        if keys & set(tenant.api_keys) or len(set(tenant.api_keys)) < len(tenant.api_keys):
            raise ValueError(f"tenant {tenant.name!r} has an API key that is given twice (keys are not shown)")
        keys |= set(tenant.api_keys)


@dataclass(frozen=True)
class Tenant:
    name: str
    api_keys: tuple[str, ...] = field(repr=False)
    allowed_priority: tuple[int, int] = (0, 0)
    share_cache: bool = False
    max_concurrent_requests: int | None = None
    max_tokens_per_minute: int | None = None
    api_keys_file: str | None = None
    weight: float = 1.0
    max_waiting: int | None = None

    @functools.cached_property
    def keys(self) -> KeyList:
        """``api_keys`` and those of ``api_keys_file``, as they are now: made (and the file first
        read) in the process that checks keys, never carried over from the one that built the app,
        whose clock and files are not this one's."""
        return KeyList(self.api_keys, self.api_keys_file)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "keys"}

    @classmethod
    def of(cls, config: TenantConfig) -> "Tenant":
        return cls(config.name, config.api_keys, config.allowed_priority, config.share_cache,
                   config.max_concurrent_requests, config.max_tokens_per_minute, config.api_keys_file, config.weight,
                   config.max_waiting)

    def cache_salt(self, client_salt: str | None) -> str | None:
        """The salt its requests' blocks are hashed under: its own (and the client's, within it)."""
        if self.share_cache:
            return client_salt
        return hashlib.sha256(f"tenant\0{self.name}\0{client_salt or ''}".encode()).hexdigest()


_reported_clashes: dict[tuple[str, ...], int] = {}
"""Per set of tenants holding one key: a hash of their keys when the clash was last logged."""


def tenant_of(key: str, tenants: tuple[Tenant, ...]) -> Tenant | None:
    """The tenant holding ``key``; every key is compared, so the time taken says nothing of which.
    A key two tenants' files hold names neither: which one it is would be a guess."""
    found, state = [], []
    for tenant in tenants:
        current = tenant.keys.current()
        for candidate in current:
            if hmac.compare_digest(key.encode(), candidate.encode()):
                found.append(tenant)
                state.append(current)
    names = tuple(sorted({t.name for t in found}))
    if len(names) > 1:
        # Once per change of their keys: every request with the key would otherwise log it again.
        seen = hash(tuple(state))
        if _reported_clashes.get(names) != seen:
            _reported_clashes[names] = seen
            logger.error("an API key is held by tenants %s: refused until one of their files drops it",
                         ", ".join(names))
        return None
    return found[0] if found else None


def check_priority(priority: int, tenant: Tenant | None, app_allowed: tuple[int, int]) -> None:
    low, high = tenant.allowed_priority if tenant is not None else app_allowed
    if not low <= priority <= high:
        whose = f"tenant {tenant.name!r}" if tenant is not None else "this deployment"
        setting = "tenants.allowed_priority" if tenant is not None else "allowed_priority"
        raise BadRequest(f"priority {priority} is not allowed here: {whose} takes [{low}, {high}] ({setting})",
                         param="priority")
