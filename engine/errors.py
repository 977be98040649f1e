"""Errors the engine raises to its callers.

Frontends map them to protocol codes: InvalidRequestError -> INVALID_ARGUMENT / HTTP 400,
EngineOverloadedError -> RESOURCE_EXHAUSTED / HTTP 429, EngineDeadError -> UNAVAILABLE / 503.
"""


class InvalidRequestError(ValueError):
    """A request (prompt, sampling params, options) that can never be served as given."""


class EngineOverloadedError(RuntimeError):
    """The bounded waiting queue is full; retry later or elsewhere."""


class EngineDeadError(RuntimeError):
    """The engine loop has died or is stuck; the replica should be replaced."""


class ModelLoadError(ValueError):
    """A model directory is missing files, holds corrupt ones, or an unsupported architecture."""


class UnknownAdapterError(InvalidRequestError):
    """A request names a LoRA adapter this engine does not serve (HTTP 404 / NOT_FOUND)."""


class AdapterLoadError(ValueError):
    """A LoRA adapter directory that cannot serve on this base model: missing files, an
    unsupported PEFT option, a rank above ``max_lora_rank``, tensors of another model's shapes."""


class AdapterInUseError(AdapterLoadError):
    """An adapter cannot be unloaded or replaced while requests of it are unfinished."""
