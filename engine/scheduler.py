"""Continuous-batching scheduler: one token-budget loop per step.

Each step: running requests first (decodes, then the rest of chunked prefills), in
priority order; when the KV pool runs dry the lowest-priority, least-advanced request is
preempted (its blocks freed; it is recomputed when readmitted). Then, if nothing was
preempted, waiting requests are admitted in (priority, arrival) order while slots, blocks
and the token budget allow, reusing cached prefix blocks; between tenants, by their fair
shares of the tokens computed (``engine.fairness``). Requests join and leave at every
step. ``scheduling="static"`` keeps the same machinery but only forms a new batch once the
previous one has fully drained: the straw man continuous batching is measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig
from engine.kv.block_manager import BlockManager
from engine.errors import AdapterLoadError
from engine.fairness import WaitQueue
from engine.lora.manager import LoRAManager
from engine.outputs import FINISH_ABORT, PREEMPT_FAIR_SHARE, PREEMPT_KV_FULL
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.spec_decode import Speculator

MAX_SCORED_TOKENS = 512
"""Prompt tokens of requests that want prompt logprobs, per step (with chunked prefill): each is a
row of logits over the vocabulary, which the memory budget plans for (engine.runner)."""


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int
    """Position of the first token computed in this step (== tokens already computed)."""
    num_tokens: int
    cached_tokens: int = 0
    """On an admission's chunk: the tokens before ``start`` taken from the prefix cache."""
    speculative = False
    """A decode that verifies draft tokens (engine.spec_decode.DraftChunk)."""

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token, so it yields logits."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions whose logits this step must also return: each predicts the next prompt
        token, whose logprob the request asked for and does not have yet."""
        req = self.request
        if req.prompt_logprobs is None:
            return range(0)
        return range(max(self.start, len(req.prompt_logprobs) - 1),
                     min(self.start + self.num_tokens, req.num_prompt_tokens - 1))

    @property
    def lora_slot(self) -> int:
        return self.request.lora_slot

    @property
    def token_ids(self) -> list[int]:
        """The tokens computed in this step."""
        return self.request.token_ids[self.start:self.start + self.num_tokens]

    @property
    def block_ids(self) -> list[int]:
        """The request's block table. It only grows while the request runs; anything else
        (preemption, readmission, finishing) assigns a new list (engine.tp relies on it)."""
        return self.request.block_ids


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    """Those of ``preempted`` that gave their slot to a tenant under its share (``share_victim``)."""
    admitted: list[str] = field(default_factory=list)
    num_draft_tokens: int = 0
    """Draft tokens the step verifies (engine.spec_decode); 0: a step like any without speculation."""
    time: float = 0.0
    """time.monotonic() when the step was scheduled: the time of its audit events."""

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_total_tokens: int,
                 lora: LoRAManager | None = None, speculator: "Speculator | None" = None) -> None:
        self.config = config
        self.speculator = speculator
        """Speculative decoding's drafts for decodes (engine.spec_decode); None: off."""
        self.lora = lora
        self.blocks = block_manager
        self.max_total_tokens = max_total_tokens
        self.static = config.scheduling == "static"
        # Without chunked prefill a whole prompt must fit in one step's budget.
        self.token_budget = (config.max_num_batched_tokens if config.enable_chunked_prefill
                             else max(config.max_num_batched_tokens, max_total_tokens + config.max_num_seqs))
        self.waiting = WaitQueue()  # priority, then tenants' fair shares, then arrival
        self.running: list[Request] = []
        self.static_batch: list[Request] = []               # static mode: the batch being admitted
        self._first: Request | None = None                  # admitted first this step (engine.fairness)
        self.num_preemptions = 0
        self.unservable: list[tuple[Request, str]] = []
        """Requests taken out of the queue because their LoRA adapter could not be read (and why):
        the engine ends them (engine.engine.LLMEngine.step)."""

    # ------------------------------------------------------------------ queue
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.static_batch)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.push(req)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.static_batch)

    def remove(self, req: Request) -> None:
        """Take a request out wherever it is and free its blocks (finish or abort)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.static_batch:
            self.static_batch.remove(req)
        else:
            self.waiting.remove(req)
        if req.block_ids:
            self.blocks.free(req.block_ids)
            req.block_ids = []
        self._release_lora(req)
        req.status = RequestStatus.FINISHED

    def abort(self, req: Request) -> None:
        self.remove(req)
        req.finish_reason = FINISH_ABORT

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(time=time.monotonic())
        budget = self.token_budget
        self._scored_left = MAX_SCORED_TOKENS
        scheduled: dict[int, ScheduledChunk] = {}
        # Decodes before the rest of chunked prefills (a recomputed request keeps its old
        # seq_no and would otherwise take the whole budget ahead of decoding requests); prefills
        # by their tenant's counter, so one tenant's long prompts do not take every step's budget.
        served = self.waiting.service
        self.running.sort(key=lambda r: (prefill := len(r.token_ids) - r.num_computed_tokens > 1, r.priority,
                                         served.get(r.tenant, 0.0) if prefill else 0.0, r.seq_no))
        block_size = self.blocks.block_size
        spec = self.speculator
        if spec is not None and not spec.active(len(self.running)):
            spec = None
        self._first = share = None
        if self.waiting and not self.static and len(self.running) >= self.config.max_num_seqs:
            pair = self.waiting.share_victim(self.running, self.config.max_num_seqs)
            if pair is not None:  # the candidate, not the queue's head, takes the slot it was freed for
                self._preempt(pair[0], scheduled, out, PREEMPT_FAIR_SHARE)
                out.shared.append(pair[0].request_id)
                self._first = share = pair[1]
        ahead = not self.static
        for req in list(self.running):
            if ahead and len(req.token_ids) - req.num_computed_tokens > 1:
                ahead = False  # less-served tenants' requests start before this tenant's prompts go on
                self._first = self._first or self.waiting.head_except(req.tenant)
                budget = self._admit(budget, scheduled, out, before=req, share=share)
                # Kept while not admitted (no blocks yet, say): the slot was freed for it, not the queue's head.
                self._first = share if share is not None and share.status is not RequestStatus.RUNNING else None
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(len(req.token_ids) - req.num_computed_tokens, budget)
            if req.prompt_logprobs is not None:
                n = self._cap_scored(req, n)
            if n <= 0:
                continue
            held = len(req.block_ids) * block_size  # most decodes fit in the blocks held: nothing to reserve
            if req.num_computed_tokens + n > held and not self._reserve(req, n, scheduled, out):
                continue
            if spec is not None and n == 1:
                chunk = spec.draft_chunk(req, budget, len(self.running))
            else:
                chunk = ScheduledChunk(req, req.num_computed_tokens, n)
            scheduled[req.seq_no] = chunk
            budget -= chunk.num_tokens
        if len(out.preempted) > len(out.shared):  # the pool ran dry: refund the chunks of preempted requests
            budget = self.token_budget - sum(c.num_tokens for c in scheduled.values())
        else:
            budget = self._admit(budget, scheduled, out)
        # Decodes first: cheaper metadata and it keeps the contract stable for the runner.
        out.chunks = sorted(scheduled.values(), key=lambda c: c.num_tokens > 1)
        if spec is not None:  # counted now: a preemption may have dropped a drafting chunk
            out.num_draft_tokens = sum(c.num_tokens - 1 for c in out.chunks if c.speculative)
        out.num_batched_tokens = self.token_budget - budget
        return out

    def _cap_scored(self, req: Request, n: int) -> int:
        """``n`` tokens of ``req`` this step, fewer when they are prompt tokens to score past the
        step's ``MAX_SCORED_TOKENS`` (a whole prompt, without chunked prefill)."""
        if not req.needs_prompt_logprobs or not self.config.enable_chunked_prefill:
            return n
        n = min(n, self._scored_left)
        self._scored_left -= n
        return n

    def _reserve(self, req: Request, n: int, scheduled: dict[int, ScheduledChunk],
                 out: SchedulerOutput) -> bool:
        """Grow ``req``'s block table to cover ``n`` more tokens, preempting if the pool is dry."""
        need = self.blocks.blocks_needed(req.num_computed_tokens + n) - len(req.block_ids)
        while need > self.blocks.num_free:
            victim = max(self.running, key=self.waiting.victim_key)
            self._preempt(victim, scheduled, out)
            if victim is req:
                return False
        if need > 0:
            req.block_ids.extend(self.blocks.allocate(need))
        return True

    def _preempt(self, req: Request, scheduled: dict[int, ScheduledChunk], out: SchedulerOutput,
                 reason: str = PREEMPT_KV_FULL) -> None:
        scheduled.pop(req.seq_no, None)
        self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.record(out.time, "preempted", reason, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.num_hashed_blocks = 0
        req.last_block_hash = req.root_hash
        self._release_lora(req)
        req.status = RequestStatus.PREEMPTED
        req.timing.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        if self.static:
            self.static_batch.insert(0, req)
        else:
            self.waiting.push(req)

    def _next_candidate(self) -> Request | None:
        if self.static:
            if not self.running and not self.static_batch:
                take = min(self.config.max_num_seqs, len(self.waiting))
                self.static_batch = [self.waiting.pop() for _ in range(take)]
            return self.static_batch[0] if self.static_batch else None
        return self._first or self.waiting.peek()

    def _pop_candidate(self) -> Request:
        if self.static:
            return self.static_batch.pop(0)
        if self._first is not None:
            req, self._first = self._first, None
            self.waiting.remove(req)
            return req
        return self.waiting.pop()

    def _admit(self, budget: int, scheduled: dict[int, ScheduledChunk], out: SchedulerOutput,
               before: Request | None = None, share: Request | None = None) -> int:
        """Admit waiting requests while slots and ``budget`` allow. ``before``: a running request's
        prefill about to be scheduled: admit only requests of other tenants served no more than its,
        and ``share``, the request a slot was freed for this step, whatever its tenant."""
        passed_over: list[Request] = []  # their adapter has no slot this step; they keep their place
        try:
            return self._admit_waiting(budget, scheduled, out, passed_over, before, share)
        finally:
            for req in passed_over:
                self.waiting.push(req)

    def _admit_waiting(self, budget: int, scheduled: dict[int, ScheduledChunk], out: SchedulerOutput,
                       passed_over: list[Request], before: Request | None = None,
                       share: Request | None = None) -> int:
        served = self.waiting.service
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._next_candidate()
            if req is None:
                break
            if before is not None and req is not share and (req.tenant == before.tenant or req.priority > before.priority
                                       or served.get(req.tenant, 0.0) > served.get(before.tenant, 0.0)):
                break
            # Prompt logprobs (or a mean embedding) need every prompt position: nothing comes from the cache.
            cached, hashes = (([], []) if req.reads_whole_prompt
                              else self.blocks.match_prefix(req.token_ids, req.root_hash))
            num_cached = len(cached) * self.blocks.block_size
            n = req.num_tokens - num_cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            scored_left = self._scored_left
            n = self._cap_scored(req, n)
            if n <= 0:
                break
            need = self.blocks.blocks_needed(num_cached + n) - len(cached)
            if not self.blocks.can_allocate(need, reusing=cached):
                break  # head-of-line: keep FCFS order within a priority
            if req.lora_name is not None:
                try:
                    slot = self.lora.acquire(req.lora_name)
                except AdapterLoadError as exc:
                    self._pop_candidate()
                    self.unservable.append((req, str(exc)))
                    self._scored_left = scored_left  # it takes no step: its share goes to the next
                    continue
                if slot is None:  # every slot is held by running requests of other adapters
                    if self.static:
                        break
                    passed_over.append(self._pop_candidate())  # others may still run
                    self._scored_left = scored_left
                    continue
                req.lora_slot = slot
            self._pop_candidate()
            first_time = req.status is RequestStatus.WAITING
            if first_time:
                self.blocks.record_lookup(req.num_tokens, num_cached)
                req.num_cached_tokens = num_cached
                req.timing.first_scheduled_time = out.time
            req.record(out.time, "scheduled" if first_time else "resumed", num_cached)
            self.blocks.take_cached(cached)
            req.block_ids = cached + self.blocks.allocate(need)
            req.num_computed_tokens = num_cached
            req.num_hashed_blocks = len(cached)
            req.last_block_hash = hashes[-1] if hashes else req.root_hash
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.seq_no] = ScheduledChunk(req, num_cached, n, num_cached)
            out.admitted.append(req.request_id)
            budget -= n
        return budget

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1

    def after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts, publish blocks that became full to the prefix cache and
        note the prefill chunks that ran (a decode computes one token past the prompt)."""
        bs = self.blocks.block_size
        for chunk in out.chunks:
            req = chunk.request
            self.waiting.charge(req, chunk.num_tokens)
            if req.status is not RequestStatus.RUNNING:
                continue
            if (chunk.num_tokens > 1 and not chunk.speculative) or chunk.start < req.num_prompt_tokens:
                req.record(out.time, "prefill_chunk", chunk.start, chunk.num_tokens, chunk.cached_tokens)
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            while (req.num_hashed_blocks + 1) * bs <= req.num_computed_tokens:
                i = req.num_hashed_blocks
                req.last_block_hash = self.blocks.register_full_block(
                    req.block_ids[i], req.last_block_hash, req.token_ids[i * bs:(i + 1) * bs])
                req.num_hashed_blocks += 1
