"""SamplingParams: what one request asks of the sampler, validated before anything is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_INT64 = 2**63 - 1
MAX_SEED = MAX_INT64


def _err(name: str, allowed: str, value: Any) -> ValueError:
    from engine.errors import InvalidRequestError
    return InvalidRequestError(f"{name} must be {allowed}, got {value!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # excludes NaN


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Field names and defaults follow vLLM so users know them.

    ``temperature=0`` is greedy. ``top_k`` 0 or -1 disables top-k. A ``seed`` makes the
    request's draws depend on (seed, output position) only, so its tokens are the same
    whatever batch it runs in and across preemptions.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise _err("stop", "a string or a list of strings", stop)
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise _err("stop_token_ids", "a list of token ids", ids)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(ids or ()))
        self._validate()

    def _validate(self) -> None:
        if self.n != 1:
            raise _err("n", "1 (one completion per request)", self.n)
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise _err("temperature", "a number in [0, 100]", self.temperature)
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _err("top_p", "a number in (0, 1]", self.top_p)
        # The bound keeps it an int64 (the sampler's tensor): a bigger one killed the engine loop.
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT64:
            raise _err("top_k", f"an integer in [1, {MAX_INT64}], or 0 / -1 to disable", self.top_k)
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _err("min_p", "a number in [0, 1]", self.min_p)
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise _err("repetition_penalty", "a number in (0, 10]", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not -2.0 <= value <= 2.0:
                raise _err(name, "a number in [-2, 2]", value)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _err("max_tokens", "a positive integer (or None for 'up to the context length')",
                       self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _err("min_tokens", "a non-negative integer", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _err("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _err("stop", f"at most {MAX_STOP_STRINGS} strings", f"{len(self.stop)} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise _err("stop", f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters", s)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _err("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", f"{len(self.stop_token_ids)} ids")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise _err("stop_token_ids", "non-negative integers", t)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _err("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None", self.logprobs)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise _err("seed", f"an integer in [0, {MAX_SEED}] or None", self.seed)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, "a bool", getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
