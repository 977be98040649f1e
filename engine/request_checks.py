"""What ``LLMEngine`` checks of a request before anything is queued: pure functions of the request
and the engine's limits, so frontends can reject bad input early (``check_request``)."""

from __future__ import annotations

from typing import Mapping, Sequence

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams


class RequestChecks:
    """Mixed into ``LLMEngine``: reads its ``vocab_size``, ``max_total_tokens``, ``max_model_len``,
    ``runner`` and ``block_manager``."""

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, priority: int = 0) -> list[int]:
        """Validate without touching engine state; returns the prompt as a list of ints."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
            raise InvalidRequestError("prompt_token_ids must be a list of token ids")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InvalidRequestError("prompt_token_ids must not be empty")
        self._check_ids("prompt_token_ids", prompt)
        if params.logit_bias:
            self._check_ids("logit_bias keys", list(params.logit_bias))
        if len(prompt) >= self.max_total_tokens:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; at most {self.max_total_tokens - 1} fit "
                f"(max_model_len {self.max_model_len}, KV pool {self.runner.num_blocks * self.block_manager.block_size}"
                f" tokens)")
        return prompt

    def _choices(self, prompt: list[int], params: SamplingParams, resume_token_ids: Sequence[int],
                 resume_choices: Mapping[int, Sequence[int]] | None) -> dict[int, list[int]]:
        """Index -> output tokens already produced, for each choice to run."""
        if resume_choices is None:
            plan = {i: [] for i in range(params.n)}
            if resume_token_ids:
                if params.n > 1:
                    raise InvalidRequestError("resume_token_ids is for n = 1; give resume_choices for n > 1")
                plan[0] = self._check_resume(prompt, params, resume_token_ids)
            return plan
        if resume_token_ids:
            raise InvalidRequestError("give resume_token_ids or resume_choices, not both")
        if not isinstance(resume_choices, Mapping) or not resume_choices:
            raise InvalidRequestError("resume_choices must map choice indices to output token ids")
        for i in resume_choices:  # checked before sorting: keys of mixed types do not sort
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < params.n:
                raise InvalidRequestError(f"resume_choices keys must be choice indices in [0, {params.n}), got {i!r}")
        return {i: self._check_resume(prompt, params, resume_choices[i]) for i in sorted(resume_choices)}

    def _check_ids(self, name: str, ids: list) -> None:
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"{name} must be integers in [0, {vocab}), got {t!r}")

    def _check_resume(self, prompt: list[int], params: SamplingParams, resume: Sequence[int]) -> list[int]:
        resumed = list(resume)
        if not resumed:
            return resumed
        self._check_ids("resume_token_ids", resumed)
        if params.max_tokens is not None and len(resumed) >= params.max_tokens:
            raise InvalidRequestError(f"resume_token_ids has {len(resumed)} tokens; max_tokens "
                                      f"({params.max_tokens}) leaves nothing to generate")
        if len(prompt) + len(resumed) >= self.max_total_tokens:
            raise InvalidRequestError(f"prompt and resumed tokens ({len(prompt) + len(resumed)}) leave no room "
                                      f"within {self.max_total_tokens} tokens")
        return resumed
