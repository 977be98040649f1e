"""A fake engine around the real Scheduler and BlockManager, for scheduler tests without a model.

``Sim.step`` mirrors LLMEngine.step: schedule -> (fake) model -> after_step -> append the
sampled token -> finish. The fake model keeps a fake KV cache (the token id written at every
slot), so a step that attends to a block someone else overwrote, or writes into a shared
block, fails loudly. Every step also checks the scheduler output against its contract and
the block tables against the pool's ref counts.
"""

from __future__ import annotations

import itertools

from engine.config import SchedulerConfig
from engine.kv.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput


class Sim:
    """The real scheduler plus a fake engine around it (mirrors LLMEngine.step)."""

    def __init__(self, *, num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                 chunked=True, scheduling="continuous", prefix=True, max_total_tokens=None):
        self.bm = BlockManager(num_blocks, block_size, prefix)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 enable_chunked_prefill=chunked, scheduling=scheduling)
        self.max_total_tokens = max_total_tokens or num_blocks * block_size
        self.sched = Scheduler(config, self.bm, self.max_total_tokens)
        self.config = config
        self._seq = itertools.count()
        self.requests: dict[str, Request] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.steps: list[SchedulerOutput] = []
        self.sampled: list[str] = []  # requests that got a token in the last step

    # ------------------------------------------------------------------ engine side
    def add(self, prompt, max_tokens=4, priority=0, rid=None, tenant=None, weight=1.0) -> Request:
        seq = next(self._seq)
        if isinstance(prompt, int):  # distinct tokens per request: no accidental prefix hits
            prompt = list(range(10_000 * (seq + 1), 10_000 * (seq + 1) + prompt))
        assert len(prompt) < self.max_total_tokens  # what LLMEngine.check_request enforces
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(rid or f"r{seq}", prompt, params, priority, seq, self.max_total_tokens, 0, frozenset())
        req.tenant, req.weight = tenant, weight
        self.requests[req.request_id] = req
        self.sched.add(req)
        return req

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self._check_output(out)
        self._run_fake_model(out)
        sampling = [c.request for c in out.chunks if c.samples]
        self.sampled = [r.request_id for r in sampling]
        self.sched.after_step(out)
        for req in sampling:
            req.token_ids.append(7_000 + req.num_output_tokens)
            if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= req.max_total_tokens:
                self.sched.remove(req)
                req.finish_reason = "length"
        self.check()
        self.steps.append(out)
        return out

    def abort(self, req: Request) -> None:
        self.sched.abort(req)
        self.check()

    def drain(self, max_steps: int = 1_000) -> list[SchedulerOutput]:
        outs = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return outs
            out = self.step()
            assert not out.empty, "unfinished requests but nothing scheduled: the scheduler is stuck"
            outs.append(out)
        raise AssertionError("requests did not finish")

    # ------------------------------------------------------------------ checks
    def _check_output(self, out: SchedulerOutput) -> None:
        ids = [c.request.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        total = sum(c.num_tokens for c in out.chunks)
        assert total == out.num_batched_tokens <= self.sched.token_budget
        if self.config.enable_chunked_prefill:
            assert total <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        bs = self.bm.block_size
        for c in out.chunks:
            req = c.request
            assert req.status is RequestStatus.RUNNING and c.start == req.num_computed_tokens
            assert 1 <= c.num_tokens and c.start + c.num_tokens <= req.num_tokens
            assert len(req.block_ids) * bs >= c.start + c.num_tokens
        sizes = [c.num_tokens for c in out.chunks]
        assert sizes == sorted(sizes, key=lambda n: n > 1), "decodes must come first"
        assert set(out.admitted) <= set(ids)
        if set(out.preempted) - set(out.shared):  # but a request a slot was freed for may come first
            assert len(out.admitted) <= len(out.shared), "a step whose KV pool ran dry must not admit"
        assert len(out.shared) <= 1, "a slot changes hands at most once a step"
        for rid in out.preempted:
            assert rid not in ids and self.requests[rid].block_ids == []

    def _run_fake_model(self, out: SchedulerOutput) -> None:
        """Attend to every earlier position, then write this chunk's positions.

        A slot's fake KV is the whole prefix up to it (as real KV depends on every earlier
        token), so serving a block computed after another prefix is caught as well.
        """
        bs = self.bm.block_size
        for c in out.chunks:
            req = c.request
            for pos in range(c.start):
                seen = self.kv.get(req.block_ids[pos // bs], [None] * bs)[pos % bs]
                assert seen == tuple(req.token_ids[:pos + 1]), f"{req.request_id} reads wrong KV at position {pos}"
            for pos in range(c.start, c.start + c.num_tokens):
                block = req.block_ids[pos // bs]
                assert self.bm.ref_counts[block] == 1, f"{req.request_id} writes into shared block {block}"
                self.kv.setdefault(block, [None] * bs)[pos % bs] = tuple(req.token_ids[:pos + 1])

    def check(self) -> None:
        self.bm.check_invariants()
        refs = [0] * self.bm.num_blocks
        for req in self.requests.values():
            if req.status is not RequestStatus.RUNNING:
                assert req.block_ids == [], f"{req!r} holds blocks while not running"
            for b in req.block_ids:
                refs[b] += 1
        assert refs == self.bm.ref_counts, "ref counts differ from the block tables"

    def scheduled(self, out: SchedulerOutput) -> dict[str, tuple[int, int]]:
        return {c.request.request_id: (c.start, c.num_tokens) for c in out.chunks}
