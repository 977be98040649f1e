"""Which LoRA adapters the ingress serves, loading them at run time, and the body of vLLM's load and
unload routes (docs/LORA.md).

The engines are the authority: an adapter is served when the app's config names it (every
replica reads those at start) or when a replica reports it in its routing stats (loaded at run
time through ``load``). A request for one that only some replicas hold carries its directory,
and a replica lacking it reads it from there first, so replicas that start later serve it too.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.errors import BadRequest, ModelNotFound, Unavailable
from deployments.http_common import validate_body
from engine.config import ADAPTER_NAME
from engine.validation import Str


class Adapters:
    def __init__(self, configured: tuple[str, ...], load_dir: str | None, engine) -> None:
        """``configured``: the names of the config's adapters. ``load_dir``: runtime loads must lie
        inside it (None: runtime loading is off). ``engine``: the ingress's ``EngineClient``."""
        self.configured = configured
        self.load_dir = load_dir
        self._engine = engine

    async def served(self) -> dict[str, str | None]:
        """Adapter -> the directory a replica lacking it loads it from (None: every replica has it)."""
        adapters: dict[str, str | None] = dict.fromkeys(self.configured)
        if self._engine is not None:
            for load in await self._engine.replica_loads():
                for name, path in load.lora_paths.items():
                    adapters.setdefault(name, path)
        return adapters

    async def resolve(self, model: str, served_names: tuple[str, ...]) -> tuple[str | None, str | None]:
        """(adapter, its directory if replicas may lack it) for a requested ``model``; (None, None) for
        the base model; NOT_FOUND naming what is served for anything else."""
        if not model or model in served_names:
            return None, None
        served = await self.served() if model not in self.configured else {model: None}
        if model in served:
            return model, served[model]
        names = ", ".join(repr(m) for m in (*served_names[:1], *served))
        raise ModelNotFound(f"model {model!r} is not served here; this server serves {names} (see /v1/models)",
                            param="model")

    async def load(self, name: str, path: str, base_names: tuple[str, ...]) -> int:
        """Load ``name`` on every engine replica (vLLM's ``/v1/load_lora_adapter``); the count loaded on."""
        if self.load_dir is None:
            raise BadRequest("loading LoRA adapters at run time is off: set lora_load_dir in the app config",
                             param="lora_path")
        if not isinstance(name, str) or re.fullmatch(ADAPTER_NAME, name) is None:
            raise BadRequest(f"lora_name must match {ADAPTER_NAME}, got {name!r:.80}", param="lora_name")
        if name in base_names or name in await self.served():
            raise BadRequest(f"the LoRA adapter {name!r} has already been loaded", param="lora_name")
        count = await self._engine.manage_lora(name, self._inside_load_dir(path))
        if not count:
            raise Unavailable("no engine replica is running to load the adapter on; retry once one is up")
        return count

    async def unload(self, name: str) -> int:
        """Unload a run-time adapter from every engine replica (vLLM's ``/v1/unload_lora_adapter``)."""
        if name in self.configured:
            raise BadRequest(f"the LoRA adapter {name!r} comes from the app's config; remove it there",
                             param="lora_name")
        if name not in await self.served():
            raise ModelNotFound(f"the LoRA adapter {name!r} is not loaded", param="lora_name")
        return await self._engine.manage_lora(name, None)

    def _inside_load_dir(self, path: str) -> str:
        """``path`` normalized, refused unless it names something inside ``load_dir``. Checked as text:
        the ingress may not mount the volume; a replica follows links when it reads."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise BadRequest("lora_path must be a non-empty path", param="lora_path")
        root = posixpath.normpath(self.load_dir)
        full = posixpath.normpath(posixpath.join(root, path))
        if posixpath.commonpath([root, full]) != root or full == root:
            raise BadRequest(f"lora_path must lie inside lora_load_dir ({root}), got {path!r:.200}",
                             param="lora_path")
        return full


class LoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: Str = Field(min_length=1, max_length=128)
    lora_path: Str | None = Field(None, min_length=1, max_length=4096)
    load_inplace: Literal[False] = False
    """vLLM's in-place reload is not served: unload, then load."""

    @classmethod
    def parse(cls, body: Any) -> "LoRAAdapterRequest":
        return validate_body(cls, body)
