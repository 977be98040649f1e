"""Which adapters the engine serves, which sit in device slots, and which requests hold them.

The scheduler asks for a request's slot when it admits the request and gives it back when the
request leaves the running set (finished, aborted or preempted). A slot no running request
holds keeps its adapter until another adapter needs the room: least recently used first.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Callable

from engine.config import ADAPTER_NAME, LoRAConfig
from engine.errors import AdapterInUseError, AdapterLoadError, UnknownAdapterError
from engine.lora.adapter import AdapterInfo, read_adapter
from engine.model.arch import ModelArch


class LoRAManager:
    def __init__(self, config: LoRAConfig, arch: ModelArch, activate: Callable[[int, AdapterInfo], None]) -> None:
        """``activate(slot, info)`` puts an adapter's weights in a device slot (on every rank)."""
        self.config, self.arch, self._activate = config, arch, activate
        self.adapters: dict[str, AdapterInfo] = {}
        self.slot_of: dict[str, int] = {}
        self._slots: list[str | None] = [None] * config.max_loras
        self._users = [0] * config.max_loras
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # unused slots, LRU first
        self.num_loads = 0
        self.num_evictions = 0
        self.version = 0
        """Bumped whenever the set of served adapters changes."""
        for name, path in config.adapters.items():
            self.register(name, path)

    def register(self, name: str, path: str | Path) -> AdapterInfo:
        """Serve the adapter at ``path`` as ``name``; replaces an unused adapter of that name."""
        if not isinstance(name, str) or re.fullmatch(ADAPTER_NAME, name) is None:
            raise AdapterLoadError(f"adapter name {name!r} must match {ADAPTER_NAME}")
        info = read_adapter(name, path, self.arch, self.config.max_lora_rank)
        slot = self.slot_of.get(name)
        if slot is not None:
            if self._users[slot]:
                raise AdapterInUseError(f"adapter {name!r} is in use by {self._users[slot]} running requests")
            self._vacate(slot)
        self.adapters[name] = info
        self.version += 1
        return info

    def unregister(self, name: str) -> None:
        self.info(name)
        slot = self.slot_of.get(name)
        if slot is not None:
            if self._users[slot]:
                raise AdapterInUseError(f"adapter {name!r} is in use by {self._users[slot]} running requests")
            self._vacate(slot)
        del self.adapters[name]
        self.version += 1

    def info(self, name: str) -> AdapterInfo:
        info = self.adapters.get(name)
        if info is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise UnknownAdapterError(f"adapter {name!r} is not loaded; loaded: {loaded}")
        return info

    def acquire(self, name: str) -> int | None:
        """A slot holding ``name`` for one more running request; None while every slot is held by
        running requests of other adapters."""
        slot = self.slot_of.get(name)
        if slot is None:
            info = self.info(name)
            free = [s for s, held in enumerate(self._slots) if held is None]
            if free:
                slot = free[0]
            elif self._idle:
                slot = next(iter(self._idle))
                self._vacate(slot)
                self.num_evictions += 1
            else:
                return None
            try:
                self._activate(slot, info)
            except AdapterLoadError:  # its file changed or went away since it was checked: not served
                del self.adapters[name]
                self.version += 1
                raise
            self._slots[slot], self.slot_of[name] = name, slot
            self.num_loads += 1
        self._idle.pop(slot, None)
        self._users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._idle[slot] = None

    def _vacate(self, slot: int) -> None:
        del self.slot_of[self._slots[slot]]
        self._slots[slot] = None
        self._idle.pop(slot, None)

    @property
    def running(self) -> dict[str, int]:
        """Adapter -> running requests using it."""
        return {name: self._users[slot] for name, slot in self.slot_of.items() if self._users[slot]}
