"""LLM: offline batched generation, shaped like vLLM's ``LLM`` so users know it."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError, ModelLoadError
from engine.outputs import FINISH_STOP, CompletionOutput, RequestOutput
from engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model, **engine_options))
        self.tokenizer = None
        try:
            from engine.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(self.engine.model_path)
        except ModelLoadError:
            logger.warning("no tokenizer in %s: token-id prompts only, no text output", self.engine.model_path)
        self._counter = 0

    def _encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise InvalidRequestError("a prompt must be a string or {'prompt_token_ids': [...]}, "
                                  f"got {type(prompt).__name__}")

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        prios = list(priority) if priority is not None else [0] * len(prompts)
        encoded = [self._encode(p) for p in prompts]
        for (_, ids), params, prio in zip(encoded, params_list, prios):  # reject before scheduling anything
            self.engine.check_request(ids, params, prio)
        ids_in_order = []
        trackers: dict[str, _TextTracker] = {}
        for (text, ids), params, prio in zip(encoded, params_list, prios):
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(ids, params, rid, prio)
            ids_in_order.append(rid)
            trackers[rid] = _TextTracker(rid, text, ids, params, self.tokenizer)
        self._run(trackers, use_tqdm)
        return [trackers[rid].result() for rid in ids_in_order]

    def _run(self, trackers: dict[str, "_TextTracker"], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(trackers), desc="generating", unit="req")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tracker = trackers.get(out.request_id)
                if tracker is None:
                    continue
                if tracker.push(out) and not out.finished:
                    self.engine.abort(out.request_id)  # a stop string matched
                if tracker.done and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()


class _TextTracker:
    """Accumulates one request's tokens, detokenizes incrementally and watches stop strings."""

    def __init__(self, rid, prompt, prompt_ids, params: SamplingParams, tokenizer) -> None:
        self.rid, self.prompt, self.prompt_ids, self.params = rid, prompt, prompt_ids, params
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.text = ""
        self.finish_reason: str | None = None
        self.done = False
        self.timing = None
        self.num_cached = 0
        self.detok = self.matcher = None
        if tokenizer is not None:
            from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher
            self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
            if params.stop:
                self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)

    def push(self, out) -> bool:
        """Returns True when a stop string ended the request."""
        if self.done:
            return False
        self.token_ids.extend(out.new_token_ids)
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        self.timing, self.num_cached = out.timing, out.num_cached_tokens
        stopped = False
        if self.detok is not None:
            piece = self.detok.push(out.new_token_ids)
            if out.finished:
                piece += self.detok.flush()
            if self.matcher is not None:
                piece, stopped = self.matcher.push(piece)
                if out.finished and not stopped:
                    piece += self.matcher.flush()
            self.text += piece
        if stopped:
            self.finish_reason, self.done = FINISH_STOP, True
        elif out.finished:
            self.finish_reason, self.done = out.finish_reason, True
        return stopped

    def result(self) -> RequestOutput:
        comp = CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)
        return RequestOutput(self.rid, self.prompt, self.prompt_ids, [comp], True, self.num_cached, self.timing)
