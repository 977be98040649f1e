"""A small deterministic stand-in for ``engine.AsyncEngine``, for serving-logic tests.

Same interface (``from_options``, ``generate``, ``abort``, ``stats``, ``prefix_digest``,
``check_health``, ``shutdown``, ``config``, ``vocab_size``, ``max_model_len``,
``model_path``), no model: each step appends ``(last token * 31 + 7) % vocab_size`` to
every running request, so outputs depend only on the prompt. It keeps the real
engine's contract where the serving layer relies on it: bounded slots and waiting
queue (``EngineOverloadedError``), outputs of one or more tokens (all since the consumer last looked),
abort frees the slot before the next step, ``check_health`` fails once the loop is dead.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import OrderedDict
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, UnknownAdapterError
from engine.kv.hashing import prefix_routing_keys
from engine.outputs import EngineStats, RequestTiming, StreamOutput
from engine.sampling import SamplingParams


class _Req:
    def __init__(self, rid: str, prompt: list[int], params: SamplingParams, priority: int) -> None:
        self.rid, self.prompt, self.params, self.priority = rid, prompt, params, priority
        self.output: list[int] = []
        self.emitted = 0
        self.index = 0
        self.ended = False  # its last output was handed out
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None
        self.wake = asyncio.Event()
        self.timing = RequestTiming(arrival_time=time.monotonic())


class FakeAsyncEngine:
    def __init__(self, config: EngineConfig, *, vocab_size: int = 256, eos_token_id: int | None = None,
                 step_delay_s: float = 0.005, max_model_len: int = 2048) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = config.model.max_model_len or max_model_len
        self.model_path = config.model.model
        self.hidden_size = 8
        self.quantization = config.model.quantization or "none"
        self.eos_token_id = eos_token_id
        self.step_delay_s = step_delay_s
        self._running: "OrderedDict[str, _Req]" = OrderedDict()
        self._waiting: "OrderedDict[str, _Req]" = OrderedDict()
        self._digest: "OrderedDict[int, None]" = OrderedDict()
        self._groups: dict[str, list[str]] = {}  # request id -> its choices' ids
        self._stats = EngineStats(max_num_seqs=config.scheduler.max_num_seqs, block_size=config.cache.block_size,
                                  kv_blocks_total=config.cache.num_kv_blocks or 256)
        self._loop_task: asyncio.Task | None = None
        self._step_tokens: list[int] = []
        self._dead: str | None = None
        self._stopped = False

    @classmethod
    def from_options(cls, model: str, *, vocab_size: int = 256, eos_token_id: int | None = None,
                     step_delay_s: float = 0.005, **options) -> "FakeAsyncEngine":
        return cls(EngineConfig.from_options(model, **options), vocab_size=vocab_size,
                   eos_token_id=eos_token_id, step_delay_s=step_delay_s)

    # -- the AsyncEngine interface ---------------------------------------------------

    async def generate(self, prompt_token_ids, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, resume_token_ids=(), resume_choices=None,
                       lora: str | None = None, cache_salt: str | None = None, tenant: str | None = None,
                       tenant_weight: float = 1.0) -> AsyncIterator[StreamOutput]:
        if lora is not None:
            raise UnknownAdapterError(f"adapter {lora!r} is not loaded; this engine serves no LoRA adapters")
        rid = request_id or uuid.uuid4().hex
        plan = dict(resume_choices) if resume_choices is not None else {i: [] for i in range(params.n)}
        if resume_token_ids:
            plan[0] = list(resume_token_ids)
        if rid in self._groups:
            raise InvalidRequestError(f"request_id {rid!r} is already running")
        wake = asyncio.Event()
        choices = []
        self._groups[rid] = []
        try:
            for index, done in plan.items():  # choice i steps with an offset of i: each its own tokens
                req = self._submit(list(prompt_token_ids), params, rid if params.n == 1 else f"{rid}/{index}",
                                   priority)
                req.index, req.wake = index, wake
                req.output = list(done)  # already sent by another replica: not emitted again
                req.emitted = len(req.output)
                choices.append(req)
                self._groups[rid].append(req.rid)
        except BaseException:
            self.abort(rid)
            raise
        try:
            while True:
                await wake.wait()
                wake.clear()
                if self._dead is not None and any(c.finish_reason is None for c in choices):
                    raise EngineDeadError(self._dead)  # as the real engine fails its open streams
                for req in choices:
                    out = None if req.ended else self._drain(req)
                    if out is None:
                        continue
                    req.ended = out.finished
                    running = sum(not c.ended for c in choices)
                    out.choices_running, out.request_id = running, rid
                    yield out
                    if out.request_finished:
                        return
        finally:
            self.abort(rid)

    def abort(self, request_id: str, index: int | None = None) -> bool:
        found = False
        group = self._groups.get(request_id, [request_id])
        if index is None:
            self._groups.pop(request_id, None)
        for rid in group if index is None else [r for r in group if r.endswith(f"/{index}")]:
            req = self._running.pop(rid, None) or self._waiting.pop(rid, None)
            if req is None:
                continue
            found = True
            if req.finish_reason is None:
                req.finish_reason = "abort"
                self._stats.num_aborted += 1
            req.wake.set()
        return found

    def stats(self) -> EngineStats:
        s = self._stats
        s.running, s.waiting = len(self._running), len(self._waiting)
        s.kv_blocks_used = sum(math.ceil((len(r.prompt) + len(r.output)) / s.block_size) for r in self._running.values())
        return EngineStats(**{k: getattr(s, k) for k in s.__dataclass_fields__})

    def prefix_digest(self, max_entries: int) -> list[int]:
        return list(self._digest)[-max_entries:]

    def drain_step_tokens(self) -> list[int]:
        steps, self._step_tokens = self._step_tokens, []
        return steps

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def shutdown(self) -> None:
        self._stopped = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        for rid in list(self._running) + list(self._waiting):
            self.abort(rid)

    def kill(self, reason: str = "the engine loop died (killed by a test)") -> None:
        """Test hook: make the loop dead, as a crashed step would: open streams fail."""
        self._dead = reason
        self._stopped = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        for req in list(self._running.values()) + list(self._waiting.values()):
            req.wake.set()
        self._running.clear()
        self._waiting.clear()

    # -- internals -------------------------------------------------------------------

    def _submit(self, prompt: list[int], params: SamplingParams, rid: str, priority: int) -> _Req:
        if self._dead is not None or self._stopped:
            raise EngineDeadError(self._dead or "the engine is shut down")
        if not prompt or any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt_token_ids must be non-empty ids in [0, {self.vocab_size})")
        max_tokens = params.max_tokens or self.max_model_len - len(prompt)
        if len(prompt) + max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds "
                                      f"max_model_len ({self.max_model_len})")
        if rid in self._running or rid in self._waiting:
            raise InvalidRequestError(f"request_id {rid!r} is already running")
        if len(self._running) >= self.config.scheduler.max_num_seqs \
                and len(self._waiting) >= self.config.scheduler.max_waiting:
            raise EngineOverloadedError(f"waiting queue full ({self.config.scheduler.max_waiting} requests)")
        req = _Req(rid, prompt, params, priority)
        self._waiting[rid] = req
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        return req

    async def _loop(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.step_delay_s)
            self._step()

    def _step(self) -> None:
        max_seqs = self.config.scheduler.max_num_seqs
        while self._waiting and len(self._running) < max_seqs:
            rid, req = self._waiting.popitem(last=False)
            self._running[rid] = req
            req.timing.first_scheduled_time = req.timing.first_scheduled_time or time.monotonic()
            hashes = prefix_routing_keys(req.prompt, self.config.cache.block_size)
            self._stats.prefix_cache_queries += len(req.prompt)
            self._stats.prefix_cache_hits += self.config.cache.block_size * sum(h in self._digest for h in hashes)
            for h in hashes:
                self._digest[h] = None
                self._digest.move_to_end(h)
        generated = len(self._running)
        for rid, req in list(self._running.items()):
            last = (req.output or req.prompt)[-1]
            token = (last * 31 + 7 + req.index) % self.vocab_size
            req.output.append(token)
            req.timing.first_token_time = req.timing.first_token_time or time.monotonic()
            self._check_finished(req, token)
            if req.finish_reason is not None:
                req.timing.finished_time = time.monotonic()
                del self._running[rid]
                self._stats.num_finished += 1
            req.wake.set()
        self._stats.num_steps += 1
        self._stats.num_generated_tokens += generated
        if generated:
            self._step_tokens.append(generated)
        self._stats.last_step_time = time.monotonic()

    def _check_finished(self, req: _Req, token: int) -> None:
        p = req.params
        n = len(req.output)
        if n < p.min_tokens:
            return
        if (token == self.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            req.finish_reason, req.stop_token_id = "stop", token
        elif (p.max_tokens is not None and n >= p.max_tokens) or len(req.prompt) + n >= self.max_model_len:
            req.finish_reason = "length"

    def _drain(self, req: _Req) -> StreamOutput | None:
        new = req.output[req.emitted:]
        if not new and req.finish_reason is None:
            return None
        first = req.emitted == 0
        req.emitted = len(req.output)
        logprobs = prompt_logprobs = None
        if req.params.logprobs is not None:
            logprobs = [{t: -0.5, (t + 1) % self.vocab_size: -1.5} for t in new]
        if first and req.params.prompt_logprobs is not None:  # scored in the prefill: the first output has them
            prompt_logprobs = [None] + [{t: -0.25} for t in req.prompt[1:]]
        return StreamOutput(request_id=req.rid, new_token_ids=new, finished=req.finish_reason is not None,
                            finish_reason=req.finish_reason, stop_token_id=req.stop_token_id, new_logprobs=logprobs,
                            num_prompt_tokens=len(req.prompt), num_output_tokens=len(req.output),
                            timing=req.timing, index=req.index, prompt_logprobs=prompt_logprobs)
