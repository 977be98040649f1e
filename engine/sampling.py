"""SamplingParams: what one request asks of the sampler, validated before anything is scheduled."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputs
from engine.validation import Bool, Float, Int, Text, validated

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_INT64 = 2**63 - 1
MAX_SEED = MAX_INT64


@validated(InvalidRequestError)
class SamplingParams:
    """Per-request sampling. Field names and defaults follow vLLM so users know them.

    ``temperature=0`` is greedy. ``top_k`` 0 or -1 disables top-k. A ``seed`` makes the
    request's draws depend on (seed, output position) only, so its tokens are the same
    whatever batch it runs in and across preemptions.
    """

    n: Int = Field(1, ge=1, le=MAX_N)
    """Choices to generate from the prompt, each its own sequence: they share the prompt's KV
    blocks, and a seeded request's choice ``i`` draws with ``seed + i``."""
    temperature: Float = Field(1.0, ge=0, le=100)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=-1, le=MAX_INT64)
    """The bound keeps it an int64 (the sampler's tensor): a bigger one killed the engine loop."""
    min_p: Float = Field(0.0, ge=0, le=1)
    repetition_penalty: Float = Field(1.0, gt=0, le=10)
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    max_tokens: Int | None = Field(16, ge=1)
    """None: up to the context length."""
    min_tokens: Int = Field(0, ge=0)
    stop: tuple[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)], ...] = Field(
        (), max_length=MAX_STOP_STRINGS)
    """A string or a list of strings."""
    stop_token_ids: tuple[Annotated[Int, Field(ge=0)], ...] = Field((), max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: Bool = False
    ignore_eos: Bool = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Log-probabilities of the prompt's tokens (and this many alternatives each), computed in its
    prefill: the request skips the prefix cache until they are."""
    seed: Int | None = Field(None, ge=0, le=MAX_SEED)
    skip_special_tokens: Bool = True
    logit_bias: dict[Annotated[Int, Field(ge=0, le=MAX_INT64)],
                     Annotated[Float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)
    """Token id -> a bias added to its logit before sampling, -100 to 100 as OpenAI's (-100 bans the
    token, 100 all but forces it). The engine checks the ids against the model's vocabulary."""
    structured_outputs: StructuredOutputs | None = None
    """Hold the output to a JSON schema, a regex, a choice or a grammar (``engine.structured``)."""
    pooling: Literal["last", "mean"] | None = None
    """An embedding of the prompt instead of text (``engine.pooling``): the request ends when its
    prompt has run, with no output token."""

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        # JSON object keys are strings: OpenAI clients send {"50256": -100}.
        if isinstance(value, dict):
            return {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 18 else k: v
                    for k, v in value.items()}
        return value

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _as_tuple(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return ()
        if isinstance(value, str) and info.field_name == "stop":
            return (value,)
        if isinstance(value, (list, tuple)):
            return tuple(value)
        what = "a string or a list of strings" if info.field_name == "stop" else "a list of token ids"
        raise ValueError(f"must be {what}")

    @field_validator("pooling")
    @classmethod
    def _prompt_only(cls, pooling: str | None, info: ValidationInfo) -> str | None:
        data = info.data
        if pooling is not None and (data.get("n", 1) != 1 or data.get("logprobs") is not None
                                    or data.get("prompt_logprobs") is not None
                                    or data.get("structured_outputs") is not None):
            raise ValueError("makes an embedding: it takes no n, logprobs, prompt_logprobs or structured_outputs")
        return pooling

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, min_tokens: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"must be <= max_tokens ({max_tokens})")
        return min_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
