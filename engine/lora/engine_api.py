"""The LoRA part of ``LLMEngine``'s API: serving, loading and unloading adapters, and their stats.

Mixed into ``engine.engine.LLMEngine``, whose ``lora`` (``engine.lora.LoRAManager``, None without
LoRA), ``requests``, ``scheduler``, ``runner`` and ``tp`` it reads.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path

from engine.errors import AdapterInUseError, AdapterLoadError, UnknownAdapterError
from engine.lora.adapter import AdapterInfo
from engine.outputs import FINISH_ABORT, EngineStats

logger = logging.getLogger(__name__)


class EngineAdapters:
    def adapter(self, name: str) -> AdapterInfo:
        """A served adapter by name; UnknownAdapterError names the ones there are."""
        if self.lora is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded; this engine serves no LoRA adapters")
        return self.lora.info(name)

    def load_lora(self, name: str, path: str | Path) -> AdapterInfo:
        """Serve the PEFT adapter at ``path`` as ``name``: a no-op when ``name`` already serves that
        directory, else it replaces an idle adapter of that name."""
        if self.lora is None:
            raise AdapterLoadError("this engine was built without LoRA (configure lora to load adapters)")
        known = self.lora.adapters.get(name)
        if known is not None and known.path == Path(path).expanduser().resolve():
            return known
        self._check_idle(name)
        return self.lora.register(name, path)

    def unload_lora(self, name: str) -> None:
        self.adapter(name)
        self._check_idle(name)
        self.lora.unregister(name)

    def _check_idle(self, name: str) -> None:
        users = sum(r.lora_name == name for choices in self.requests.values() for r in choices)
        if users:
            raise AdapterInUseError(f"adapter {name!r} has {users} unfinished requests; retry once they end")

    def _activate_lora(self, slot: int, info: AdapterInfo) -> None:
        self.runner.lora.activate(slot, info)  # first: a file that fails its check reaches no other rank
        if self.tp is not None:
            self.tp.send_lora(slot, info)

    def _end_unservable(self, outputs: list) -> None:
        """End the requests whose adapter could not be read when a slot was filled for them."""
        for req, why in self.scheduler.unservable:
            logger.error("request %s: ending it, its LoRA adapter cannot be served: %s", req.request_id, why)
            self.finish(req, FINISH_ABORT)
            outputs.append(self._output(req, [], None))
        self.scheduler.unservable.clear()

    def _lora_stats(self, s: EngineStats) -> None:
        lora = self.lora
        s.lora_loaded, s.lora_running, s.max_loras = tuple(lora.slot_of), lora.running, lora.config.max_loras
        s.lora_loads, s.lora_evictions = lora.num_loads, lora.num_evictions
        held = [h for choices in self.requests.values() for r in choices for h in r.held]
        waiting = list(self.scheduler.waiting) + self.scheduler.static_batch + held
        s.lora_waiting = dict(collections.Counter(r.lora_name for r in waiting if r.lora_name is not None))
        if self._lora_version != lora.version:
            self._lora_version = lora.version
            s.lora_roots = {name: info.root_hash.hex() for name, info in lora.adapters.items()}
            s.lora_paths = {name: str(info.path) for name, info in lora.adapters.items()}
