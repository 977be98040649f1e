"""LLM: offline batched generation, shaped like vLLM's ``LLM`` so users know it."""

from __future__ import annotations

import collections
import logging
from typing import Any, Iterable, Sequence

from engine.config import EngineConfig
from engine.detokenizer import TextStream
from engine.engine import LLMEngine
from engine.errors import EngineOverloadedError, InvalidRequestError, ModelLoadError
from engine.outputs import FINISH_STOP, CompletionOutput, RequestOutput
from engine.pooling import pooling_of
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

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank workers, if any (they also stop at interpreter exit)."""
        self.engine.shutdown()

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
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order. ``lora``: a served adapter's
        name for every prompt, or one per prompt (None: the base model)."""
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
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise InvalidRequestError(f"lora has {len(adapters)} entries for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        checked = []  # every request is checked before any is scheduled, and only then
        for (_, ids), params, prio, name in zip(encoded, params_list, prios, adapters):
            checked.append(self.engine.check_request(ids, params, prio))
            if name is not None:
                self.engine.adapter(name)
        trackers: dict[str, list[_TextTracker]] = {}
        todo = []
        for ids, params, prio, name in zip(checked, params_list, prios, adapters):
            rid = f"offline-{self._counter}"
            self._counter += 1
            trackers[rid] = [_TextTracker(i, params, self.tokenizer) for i in range(params.n)]
            todo.append((rid, ids, params, prio, name))
        # Fed in the scheduler's own order, so priorities hold even beyond the queue bound.
        self._run(collections.deque(sorted(todo, key=lambda item: item[3])), trackers, use_tqdm)
        return [_result(rid, text, ids, choices)  # in prompt order
                for (rid, choices), (text, ids) in zip(trackers.items(), encoded)]

    def embed(self, prompts: Any, pooling: str | None = None, use_tqdm: bool = False) -> list[list[float]]:
        """Each prompt's embedding (``engine.pooling``), L2-normalised, in prompt order; ``pooling``:
        ``last`` or ``mean`` (default: as the model directory declares, ``pooling_of``)."""
        params = SamplingParams(pooling=pooling or pooling_of(self.engine.model_path), max_tokens=1)
        return [out.embedding for out in self.generate(prompts, params, use_tqdm)]

    def _run(self, todo: collections.deque, trackers: dict[str, list["_TextTracker"]], use_tqdm: bool) -> None:
        """Step until all is done, adding requests as the engine's bounded queue has room.

        On any exception (a model error, KeyboardInterrupt) what this call added is aborted,
        so the engine is left holding nothing.
        """
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(trackers), desc="generating", unit="req")
        try:
            while todo or self.engine.has_unfinished():
                self._feed(todo)
                for out in self.engine.step():
                    choices = trackers.get(out.request_id)
                    if choices is None or choices[out.index].done:
                        continue
                    if choices[out.index].push(out) and not out.finished:
                        self.engine.abort(out.request_id, out.index)  # a stop string matched
                    if bar is not None and all(c.done for c in choices):
                        bar.update(1)
        except BaseException:
            self._abort_all(trackers)  # aborting one never added or already done is a no-op
            raise
        finally:
            if bar is not None:
                bar.close()

    def _feed(self, todo: collections.deque) -> None:
        """Add requests until the engine's waiting queue is full (``max_waiting``)."""
        while todo:
            rid, ids, params, prio, name = todo[0]
            try:
                self.engine.add_request(ids, params, rid, prio, lora=name, checked=True)
            except EngineOverloadedError:
                if not self.engine.has_unfinished():
                    raise  # max_waiting=0: no finishing request will ever make room
                return
            todo.popleft()

    def _abort_all(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)
        if not self.engine.requests:
            self.engine.step()  # nothing left to run: only hands back the abort messages


def _result(rid: str, prompt: str | None, prompt_ids: list[int], choices: list["_TextTracker"]) -> RequestOutput:
    last = max(choices, key=lambda c: (c.timing and c.timing.finished_time) or 0.0)  # the request's end
    outputs = [CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs) for c in choices]
    return RequestOutput(rid, prompt, prompt_ids, outputs, True, choices[0].num_cached, last.timing,
                         choices[0].prompt_logprobs, choices[0].embedding)


class _TextTracker:
    """Accumulates one choice's tokens and text (``engine.detokenizer.TextStream``, as serving does)."""

    def __init__(self, index: int, params: SamplingParams, tokenizer) -> None:
        self.index, self.params = index, params
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.text = ""
        self.finish_reason: str | None = None
        self.done = False
        self.timing = None
        self.num_cached = 0
        self.prompt_logprobs = None
        self.embedding = None
        self.stream = TextStream.for_params(tokenizer, params) if tokenizer is not None else None

    def push(self, out) -> bool:
        """Returns True when a stop string ended the request (its tokens end at the one completing it)."""
        if self.done:
            return False
        ids, used = out.new_token_ids, len(out.new_token_ids)
        if self.stream is not None:
            text, used = self.stream.push(ids)
            if out.finished and not self.stream.stopped:
                text += self.stream.finish()
            self.text += text
        self.token_ids.extend(ids[:used])
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs.extend(out.new_logprobs[:used])
        self.timing, self.num_cached = out.timing, out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.embedding = out.embedding if out.embedding is not None else self.embedding
        stopped = self.stream is not None and self.stream.stopped
        if stopped:
            self.finish_reason, self.done = FINISH_STOP, True
        elif out.finished:
            self.finish_reason, self.done = out.finish_reason, True
        return stopped
