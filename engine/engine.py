"""LLMEngine: the synchronous core. ``step()`` = schedule -> run model -> sample -> emit.

It is single-threaded by design: AsyncEngine drives it from one loop thread, LLM from the
caller's thread. Request validation (``check_request``) is pure, so frontends can reject
bad input before anything is queued.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import time
import uuid
import weakref
from pathlib import Path
from typing import Mapping, Sequence

from engine.config import EngineConfig
from engine.cpu_features import describe_host
from engine.eos import model_eos_token_ids
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.kv.block_manager import BlockManager
from engine.kv.hashing import PREFIX_DIGEST_ENTRIES, ROOT_HASH, salted_root
from engine.lora import LoRAManager
from engine.lora.engine_api import EngineAdapters
from engine.model import ModelArch
from engine.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineStats, StreamOutput
from engine.pooling import embedding
from engine.request import Request, RequestStatus
from engine.request_checks import RequestChecks
from engine.runner import ModelRunner
from engine.sampling import MAX_SEED, SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import Speculator
from engine.spec_draft import DraftModel, drafter_footprint, load_draft_arch
from engine.spec_eagle import Eagle3Drafter, load_head_arch
from engine.spec_verify import EngineSpeculation
from engine.structured import GrammarBook, grammar_step

logger = logging.getLogger(__name__)
MAX_REQUEST_ID_CHARS = 128
"""A request id, the server's or a client's own (``deployments.requests``): logged and echoed, so bounded."""
STEP_TOKENS_KEPT = 4096


class LLMEngine(RequestChecks, EngineAdapters, EngineSpeculation):
    def __init__(self, config: EngineConfig, launcher=None) -> None:
        """``launcher``: how tensor-parallel rank workers start (engine.tp.launcher.RankLauncher;
        default: local processes). Unused at tensor_parallel_size 1."""
        from engine.models_hub import resolve_model

        started = time.monotonic()
        logger.info("host: %s", describe_host())
        self.config = config
        if config.num_threads is not None:
            import torch
            torch.set_num_threads(config.num_threads)
        self.model_path = Path(resolve_model(config.model.model))
        self.arch = ModelArch.from_dir(self.model_path)
        self.max_model_len = self._max_model_len()
        self._timings: dict[str, float] | None = {} if config.profile else None
        self.tp = None  # rank 0's handle on the other tensor-parallel ranks (engine.tp)
        self.drafter: DraftModel | Eagle3Drafter | None = None
        """What fills the drafts a step verifies: engine.spec_draft's model, engine.spec_eagle's head."""
        self.runner = self._start_runners(launcher)
        bs = config.cache.block_size
        self.block_manager = BlockManager(self.runner.num_blocks, bs, config.cache.enable_prefix_caching)
        # A request can never hold more tokens than the pool, or it would preempt itself forever.
        self.max_total_tokens = min(self.max_model_len, self.runner.num_blocks * bs)
        self.lora = LoRAManager(config.lora, self.arch, self._activate_lora) if config.lora is not None else None
        spec = config.speculative_config
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_total_tokens, self.lora,
                                   Speculator(spec, self.block_manager) if spec is not None else None)
        self.eos_token_ids = model_eos_token_ids(self.model_path)
        self.grammars = GrammarBook(self.model_path, self.arch.vocab_size, self.eos_token_ids)
        self.requests: dict[str, list[Request]] = {}
        """Each request's unfinished choices (one unless ``n`` > 1), by request id."""
        self._num_held = 0  # siblings waiting for their lead's prefill (engine.request.Request.held)
        self._lora_version = -1  # the adapter set stats.lora_roots describes
        self._seq = itertools.count()
        self._rng = random.Random(config.model.seed)
        self._pending: list[StreamOutput] = []
        # Tokens computed per step, for the serving layer's metrics to pop (bounded: nobody may read).
        self.step_tokens: collections.deque[int] = collections.deque(maxlen=STEP_TOKENS_KEPT)
        self._stats = EngineStats(max_num_seqs=config.scheduler.max_num_seqs,
                                  kv_blocks_total=self.runner.num_blocks, block_size=bs,
                                  weights_bytes=self.runner.param_bytes,
                                  weights_format=(str(self.runner.dtype).removeprefix("torch."),
                                                  self.runner.quantization or "none"),
                                  kv_cache_bytes=self._kv_bytes)
        logger.info("engine ready in %.1f s: %s (%s), max_model_len %d, %d KV blocks x %d tokens, %s on %s",
                    time.monotonic() - started, self.model_path.name, self.arch.architecture, self.max_model_len,
                    self.runner.num_blocks, bs, self.runner.dtype, self.runner.device)

    def _start_runners(self, launcher) -> ModelRunner:
        """The target's runner (rank 0's under tensor parallelism), and what drafts beside it
        (``self.drafter``): a draft model or an EAGLE-3 head."""
        spec = self.config.speculative_config
        method = None if spec is None else spec.method
        aux, draft, head, footprint = (), None, None, None
        if method == "eagle3":
            head = load_head_arch(self.config, self.arch)
            aux = head[1].aux_layers
            footprint = drafter_footprint(self.config, head[0], head[1].layer, self.max_model_len, graphs=False)
        elif method == "draft_model":
            draft = load_draft_arch(self.config, self.arch)
            footprint = drafter_footprint(self.config, *draft, self.max_model_len, graphs=not self.config.enforce_eager)
        if self.config.parallel.tensor_parallel_size == 1:
            runner = ModelRunner(self.config, self.model_path, self.arch, self.max_model_len, aux_layers=aux,
                                 draft=footprint)
        else:
            from engine.tp.driver import start_tensor_parallel
            self.tp, runner = start_tensor_parallel(self.config, self.model_path, self.arch, self.max_model_len,
                                                    launcher, self._timings, aux_layers=aux, draft=footprint)
            weakref.finalize(self, self.tp.shutdown)  # no orphan workers if shutdown() is never called
        try:
            if head is not None:
                self.drafter = Eagle3Drafter(self.config, runner, *head)
            elif draft is not None:
                self.drafter = DraftModel(self.config, *draft, self.max_model_len, runner.num_blocks, runner.dtype)
        except BaseException:
            if self.tp is not None:
                self.tp.shutdown()
            raise
        return runner

    @property
    def _kv_bytes(self) -> int:
        caches = [t for kv in self.runner.kv_caches for t in kv] + (self.drafter.kv_tensors if self.drafter else [])
        return sum(t.numel() * t.element_size() for t in caches)

    @classmethod
    def from_options(cls, model: str, **options) -> "LLMEngine":
        return cls(EngineConfig.from_options(model, **options))

    def _max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        asked = self.config.model.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len must be <= the model's max_position_embeddings ({limit}), got {asked}")
        length = asked or limit
        window = self.arch.sliding_window
        if window and window < length:
            logger.warning("model uses sliding-window attention (%d); capping max_model_len there", window)
            length = window
        return length

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None,
                    resume_token_ids: Sequence[int] = (),
                    resume_choices: Mapping[int, Sequence[int]] | None = None, lora: str | None = None,
                    cache_salt: str | None = None, tenant: str | None = None, tenant_weight: float = 1.0,
                    checked: bool = False) -> str:
        """Queue a request. ``resume_token_ids``: output tokens it already produced elsewhere (a
        replica died mid-stream); they are recomputed like a preempted request's, counted in
        ``max_tokens`` and in the seeded sampler's positions, and not emitted again.
        ``resume_choices``: the same for ``n`` > 1, by choice index: only the choices named run.
        ``lora``: the name of a served LoRA adapter to run with (None: the base model).
        ``cache_salt``: its prompt's cached blocks are shared only with requests of the same salt.
        ``tenant``, ``tenant_weight``: whose it is, and that tenant's share (engine.fairness).
        ``checked``: ``prompt_token_ids`` is the list ``check_request`` returned for these params
        (AsyncEngine checks in its caller's thread, so the error raises there): not checked again."""
        params = params or SamplingParams()
        prompt = prompt_token_ids if checked else self.check_request(prompt_token_ids, params, priority)
        adapter = self.adapter(lora) if lora is not None else None
        root = adapter.root_hash if adapter is not None else ROOT_HASH
        root = salted_root(root, cache_salt) if cache_salt is not None else root
        plan = self._choices(prompt, params, resume_token_ids, resume_choices)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} chars")
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        # The bound is on sequences that must wait for a slot: with max_waiting 0 (no queue) a
        # request that a free slot takes at the next step is still admitted.
        free_slots = max(0, self.config.scheduler.max_num_seqs - len(self.scheduler.running))
        queued = self.scheduler.num_waiting + self._num_held + len(plan) - 1
        if queued - free_slots >= self.config.scheduler.max_waiting:
            waiting = max(0, self.scheduler.num_waiting + self._num_held - free_slots)
            raise EngineOverloadedError(
                f"engine queue is full ({waiting} waiting, max_waiting "
                f"{self.config.scheduler.max_waiting}); retry later or on another replica")
        matchers = {i: self.grammars.matcher(params.structured_outputs, done) for i, done in plan.items()
                    } if params.structured_outputs is not None else {}
        choices = []
        for index, done in plan.items():
            seed = (params.seed + index) % (MAX_SEED + 1) if params.seed is not None else self._rng.getrandbits(63)
            req = Request(request_id, prompt, params, priority, next(self._seq), self.max_total_tokens, seed,
                          self.eos_token_ids, arrival_time, index)
            req.token_ids.extend(done)
            req.matcher = matchers.get(index)
            req.lora_name = adapter.name if adapter is not None else None
            req.root_hash = req.last_block_hash = root
            req.tenant, req.weight = tenant, tenant_weight
            req.record(req.timing.arrival_time, "queued", self.scheduler.num_waiting, len(self.scheduler.running))
            choices.append(req)
        self.requests[request_id] = choices
        lead, rest = choices[0], choices[1:]
        # Queued at the lead's first token: its prompt blocks are cached then, and its first output
        # (which carries the prompt logprobs) comes before any sibling's.
        if (self.block_manager.enable_prefix_caching and len(prompt) > self.block_manager.block_size
                or lead.prompt_logprobs is not None):
            lead.held = rest
            self._num_held += len(rest)
            rest = []
        for req in (lead, *rest):
            self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Drop a request (or one of its choices); its slots and blocks are free before the next step."""
        choices = self.requests.get(request_id)
        if choices is None:
            return False
        doomed = [r for r in choices if index is None or r.index == index]
        if not doomed:
            return False
        now = time.monotonic()
        for req in doomed:
            choices.remove(req)
            if index is not None:  # its siblings were waiting for its prompt: they compute it themselves
                for sibling in req.held:
                    self.scheduler.add(sibling)
            self._num_held -= len(req.held)
            req.held = []
            for lead in choices:  # a held choice is never queued
                if req in lead.held:
                    lead.held.remove(req)
                    self._num_held -= 1
            self.scheduler.abort(req)
            req.timing.finished_time = now
            req.record(now, "finished", req.finish_reason, req.num_output_tokens)
            self._pending.append(self._output(req, [], None, len(choices)))
        if not choices:
            del self.requests[request_id]
            self._stats.num_aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StreamOutput]:
        outputs, self._pending = self._pending, []
        timings = self._timings
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if self.scheduler.unservable:
            self._end_unservable(outputs)
        if timings is not None:
            timings["schedule"] = timings.get("schedule", 0.0) + time.perf_counter() - t0
        if sched.empty:
            self._refresh_stats()
            return outputs
        costs = self.scheduler.speculator.costs if self.scheduler.speculator is not None else None
        if sched.num_draft_tokens and self.drafter is not None:
            td = time.perf_counter()
            self.drafter.propose([c for c in sched.chunks if c.speculative], costs)
            if timings is not None:
                timings["draft"] = timings.get("draft", 0.0) + time.perf_counter() - td
        tx = time.perf_counter()
        try:
            reqs, tokens, logprobs, prompt = self.runner.execute(sched.chunks, timings, sched.num_draft_tokens > 0)
        except Exception as exc:
            if self.tp is not None:  # a lost rank or a failed collective: the ranks are out of step
                raise self.tp.fail(exc) from exc
            raise
        t1 = time.perf_counter()
        if costs is not None:
            costs.target.observe(sched.num_batched_tokens, t1 - tx)
        for req, entries in prompt:
            req.prompt_logprobs.extend(entries)
        if sched.num_draft_tokens:
            generated = self._verified_step(sched, reqs, tokens, logprobs, outputs)
        else:
            self.scheduler.after_step(sched)
            now = time.monotonic()
            for req, tok, lp in zip(reqs, tokens, logprobs):
                outputs.append(self._append_token(req, tok, lp, now))
            generated = sum(req.params.pooling is None for req in reqs)  # an embedding keeps no token
        if self.drafter is not None and self.drafter.follows_target:  # with the tokens this step kept
            td = time.perf_counter()
            self.drafter.catch_up(sched.chunks, self.runner.aux_rows)
            if timings is not None:
                timings["draft"] = timings.get("draft", 0.0) + time.perf_counter() - td
        self._stats.num_steps += 1
        self._stats.num_generated_tokens += generated
        self.step_tokens.append(sched.num_batched_tokens)
        self._refresh_stats()
        if timings is not None:
            timings["output"] = timings.get("output", 0.0) + time.perf_counter() - t1
        return outputs

    def _append_token(self, req: Request, tok: int, lp: dict | None, now: float) -> StreamOutput:
        if req.params.pooling is not None:  # its prompt has run: it ends with its embedding, no token
            req.timing.first_token_time = now
            self.finish(req, FINISH_STOP, now)
            out = self._output(req, [], None)
            out.embedding = embedding(req)
            return out
        token_ids = req.token_ids
        token_ids.append(tok)
        first = req.timing.first_token_time is None
        if first:
            req.timing.first_token_time = now
            req.record(now, "first_token")
        if req.held:  # its prompt blocks are in the prefix cache now: the siblings start from them
            for sibling in req.held:
                self.scheduler.add(sibling)
            self._num_held -= len(req.held)
            req.held = []
        n_out = len(token_ids) - req.num_prompt_tokens
        p = req.params
        reason = None
        if req.matcher is not None:
            reason = grammar_step(req, tok)
        if reason != FINISH_ABORT and n_out >= p.min_tokens and (tok in req.eos_token_ids or tok in p.stop_token_ids):
            reason, req.stop_token_id = FINISH_STOP, tok
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens)
                               or len(token_ids) >= req.max_total_tokens):
            reason = FINISH_LENGTH
        if reason is not None:
            self.finish(req, reason, now)
        out = self._output(req, [tok], None if lp is None else [lp])
        if first:
            out.prompt_logprobs = req.prompt_logprobs
        return out

    def finish(self, req: Request, reason: str, now: float | None = None) -> None:
        choices = self.requests.get(req.request_id, [])
        if req in choices:
            choices.remove(req)
        if not choices:
            self.requests.pop(req.request_id, None)
            self._stats.num_finished += 1
        self.scheduler.remove(req)
        req.finish_reason = reason
        timing = req.timing
        timing.finished_time = now or time.monotonic()
        if timing.num_drafts:
            req.record(timing.finished_time, "speculated", timing.num_drafts, timing.num_draft_tokens,
                       timing.num_accepted_tokens)
        req.record(timing.finished_time, "finished", reason, req.num_output_tokens)

    def _output(self, req: Request, new_ids: list[int], lps: list | None,
                choices_running: int | None = None) -> StreamOutput:
        done = req.status is RequestStatus.FINISHED
        if choices_running is None:
            choices_running = len(self.requests.get(req.request_id, ()))
        # Positional, in field order: half the cost of keywords, once per request per step.
        return StreamOutput(
            req.request_id, new_ids, done, req.finish_reason if done else None, req.stop_token_id, lps,
            req.num_prompt_tokens, len(req.token_ids) - req.num_prompt_tokens, req.num_cached_tokens, req.timing,
            req.index, choices_running)

    # ------------------------------------------------------------------ tensor-parallel ranks
    def check_health(self) -> None:
        """Raise EngineDeadError when a tensor-parallel rank is gone (nothing to check alone)."""
        if self.tp is not None:
            self.tp.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank workers (nothing to do alone); no steps after this."""
        if self.tp is not None:
            self.tp.shutdown()

    # ------------------------------------------------------------------ observability
    def _refresh_stats(self) -> None:
        s = self._stats
        running = self.scheduler.running
        s.running = len(running)
        s.kv_tokens = sum(r.num_computed_tokens for r in running)
        s.waiting = self.scheduler.num_waiting + self._num_held
        s.kv_blocks_used = self.block_manager.num_used
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        s.num_preemptions = self.scheduler.num_preemptions
        if self.lora is not None:
            self._lora_stats(s)
        if self.scheduler.speculator is not None:
            self._spec_stats(s)
        s.last_step_time = time.monotonic()

    def stats(self) -> EngineStats:
        self._refresh_stats()
        snap = EngineStats(**{k: getattr(self._stats, k) for k in self._stats.__dataclass_fields__})
        snap.step_time_s = dict(self._timings or {})
        return snap

    def prefix_digest(self, max_entries: int = PREFIX_DIGEST_ENTRIES) -> list[int]:
        """Routing keys (engine.kv.hashing.routing_key) of recently used cached blocks, newest last."""
        return self.block_manager.recent_routing_keys(max_entries)
