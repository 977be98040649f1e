"""Speculative decoding, the scheduler's side: n-gram drafts, lookahead KV slots, back-off.

A decoding request that gets a draft of k tokens runs as one chunk of 1 + k tokens (its last
token, then the draft: ``DraftChunk``) in the same step as everyone else; the runner returns
logits for all 1 + k positions and engine.spec_verify keeps the longest prefix of the draft the
target model agrees with, plus the target's own next token. The proposer (``NgramProposer``, or
a draft model that fills the reserved draft after scheduling: engine.spec_draft) never changes
what the target would have said, only how many of its tokens one step yields.

KV: the scheduler reserves the draft's slots like any chunk's (``Speculator.draft_chunk``, from
free blocks only: a draft never preempts anyone); after the step the request's computed count
covers only accepted tokens, so only their full blocks reach the prefix cache, and blocks past
what the request holds in tokens go back to the pool (``Speculator.trim``).

Drafts of a request with a grammar are cut where the grammar would refuse them, and its
matcher gives each draft row the mask after the drafts before it, then rolls back
(engine.structured.mask_logits); penalties count a row's earlier drafts as output, and logprobs
come per row, as each position would have had them. Not speculated (a plain decode, exactly as
without speculation): requests still short of ``min_tokens``, and with a draft model, requests
with a grammar. Back-off: no drafts in a step with more than ``disable_by_batch_size`` running; with
``cost_model`` (the default) a request drafts only the positions its acceptance so far makes worth
the step time they add, by step times measured as the engine runs (engine.spec_cost); a request
whose draft is wholly rejected waits 2, 4, ... up to ``MAX_COOLDOWN`` decode steps before it
drafts again (any accepted token resets it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.config import SpeculativeConfig
from engine.kv.block_manager import BlockManager
from engine.request import Request
from engine.scheduler import ScheduledChunk
from engine.spec_cost import StepCosts

MAX_COOLDOWN = 32
"""Most decode steps a request whose drafts keep failing waits before it drafts again."""


@dataclass(slots=True)
class DraftChunk(ScheduledChunk):
    """A decode verifying a draft: the request's last token, then ``draft_token_ids``."""

    draft_token_ids: list[int] = field(default_factory=list)
    speculative = True

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return [self.request.token_ids[self.start], *self.draft_token_ids]


class NgramProposer:
    """Prompt lookup: the tokens that followed an earlier occurrence of the sequence's suffix."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens after the occurrence of the longest suffix n-gram (``min_n`` <= n <=
        ``max_n``) found earlier in ``tokens``; among equally long matches, the one followed by the
        most tokens (up to k), then the latest. Empty when no suffix of ``min_n`` tokens recurs."""
        length = len(tokens)
        n_max = min(self.max_n, length - 1)
        if n_max < self.min_n or k <= 0:
            return []
        # Candidates end where the last token occurs earlier; vectorised over them, no Python per position.
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
        if len(ends) == 0:
            return []
        back = np.arange(n_max)
        at = ends[:, None] - back
        same = (tokens[np.maximum(at, 0)] == tokens[length - 1 - back]) & (at >= 0)
        matched = np.cumprod(same, axis=1).sum(axis=1)  # suffix tokens matched, counted backwards
        follow = np.minimum(length - 1 - ends, k)       # tokens after the match (it never reaches the end)
        score = np.where(matched >= self.min_n, matched * (k + 1) + follow, -1)
        best = int(score.max())
        if best < 0:
            return []
        i = int(np.flatnonzero(score == best)[-1])
        start = int(ends[i]) + 1
        return tokens[start:start + int(follow[i])].tolist()


class _DraftState:
    """Per request: its tokens as an array (grown as it generates) and its back-off."""

    __slots__ = ("tokens", "filled", "eligible", "misses", "cooldown", "drafts", "draft_valid", "draft_preemptions",
                 "accepted", "rejections", "head_hidden", "head_at")

    def __init__(self, req: Request, model_drafts: bool) -> None:
        # A draft model's tokens are written after scheduling, too late to check them against a grammar.
        self.eligible = req.matcher is None or not model_drafts
        self.drafts: list[int] = []  # the draft being verified (the sampler's rows after it read it)
        self.tokens = np.empty(max(64, 2 * len(req.token_ids)), dtype=np.int64)
        self.filled = 0
        self.misses = 0
        self.cooldown = 0
        self.accepted = 0    # draft tokens accepted, and drafts cut short by a rejection (Speculator._worth)
        self.rejections = 0
        self.draft_valid = 0  # a draft model's KV holds this many of its tokens (engine.spec_draft)
        self.draft_preemptions = 0
        self.head_hidden = None  # an EAGLE-3 head's output at position head_at (engine.spec_eagle)
        self.head_at = (-1, -1)  # (position, preemptions) it is for

    def head_ready(self, req: Request, hidden) -> None:
        """An EAGLE-3 head has read the request up to its last token; ``hidden``: its output there."""
        self.head_hidden = hidden
        self.head_at = (req.num_tokens - 1, req.timing.num_preemptions)

    def head_has_draft(self, req: Request) -> bool:
        return self.head_at == (req.num_computed_tokens, req.timing.num_preemptions)

    def array(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n > len(self.tokens):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:self.filled] = self.tokens[:self.filled]
            self.tokens = grown
        if n > self.filled:  # token_ids only grows: only the new tail is copied
            self.tokens[self.filled:n] = token_ids[self.filled:n]
            self.filled = n
        return self.tokens[:n]


def draft_state(req: Request, model_drafts: bool) -> _DraftState:
    """The request's drafting state, made when first asked for (``model_drafts``: drafts come from a
    model, after scheduling, so a grammar request does not draft)."""
    if req.spec is None:
        req.spec = _DraftState(req, model_drafts)
    return req.spec


class Speculator:
    """What the scheduler asks each step: which decodes verify a draft, and with which KV slots."""

    def __init__(self, config: SpeculativeConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        """None: a draft model or an EAGLE-3 head proposes, after scheduling (engine.spec_draft, spec_eagle)."""
        self.needs_head = config.method == "eagle3"
        """A request drafts once the head has read it up to its last token (after its prefill, a preemption)."""
        self.costs = StepCosts() if config.cost_model else None
        """Step times, which the engine and the draft model feed (engine.spec_cost); None: no cost model."""
        self._price: tuple[int, float] | None = None  # (running, the acceptance a position needs) this step
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_rejections = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def active(self, num_running: int) -> bool:
        """Whether this step drafts at all (back-off on batch size)."""
        self._price = None  # a new step: the cost model's lines have moved
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def draft_chunk(self, req: Request, budget: int, num_running: int) -> ScheduledChunk:
        """The decode chunk of ``req`` (whose block for its last token is reserved): with a draft
        when one is found and fits the budget, the request's limits and the free blocks."""
        start = req.num_computed_tokens
        k = self._room(req, budget)
        if k > 0 and self.costs is not None:
            k = self._worth(req, k, num_running)
        drafts = self._propose(req, k) if k > 0 else []
        if drafts and req.matcher is not None:  # only what the grammar allows (it rolls back after)
            drafts = drafts[:req.matcher.validate_tokens(drafts)]
        if drafts:
            drafts = drafts[:self._reserve(req, start, len(drafts), num_running)]
        if not drafts:
            return ScheduledChunk(req, start, 1)
        req.spec.drafts = drafts
        return DraftChunk(req, start, 1 + len(drafts), 0, drafts)

    def _room(self, req: Request, budget: int) -> int:
        """Most draft tokens worth verifying: all but the one the target adds must fit its limits."""
        state = draft_state(req, self.proposer is None)
        if (not state.eligible or req.num_output_tokens < max(1, req.params.min_tokens)
                or req.num_tokens - req.num_computed_tokens != 1  # only a decode: its last token alone
                or (self.needs_head and not state.head_has_draft(req))):
            return 0
        if state.cooldown > 0:
            state.cooldown -= 1
            return 0
        k = min(self.config.num_speculative_tokens, budget - 1, req.max_total_tokens - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        return k

    def _worth(self, req: Request, k: int, num_running: int) -> int:
        """Draft positions (of up to ``k``) whose expected tokens pay for the step time they add
        (engine.spec_cost), asked afresh each step: the batch decides the price. A request's
        acceptance starts from everyone's so far, worth two drafts of its own."""
        state = req.spec
        shared = (self.num_accepted_tokens + 1) / (self.num_accepted_tokens + self.num_rejections + 2)
        p = (state.accepted + 2 * shared) / (state.accepted + state.rejections + 2)
        if self._price is None or self._price[0] != num_running:  # once a step, not once a request
            self._price = (num_running, self.costs.threshold(num_running))
        need = self._price[1]
        n, value = 0, p
        while n < k and value >= need:
            n += 1
            value *= p
        return n

    def _propose(self, req: Request, k: int) -> list[int]:
        if self.proposer is None:  # placeholders: the draft model writes them before the step runs
            return [0] * k
        return self.proposer.propose(req.spec.array(req.token_ids), k)

    def _reserve(self, req: Request, start: int, k: int, num_running: int) -> int:
        """Draft tokens ``req`` has KV slots for, taking free blocks while a block per running
        request stays free (their next tokens come first); returns how many fit."""
        bs = self.blocks.block_size
        need = self.blocks.blocks_needed(start + 1 + k) - len(req.block_ids)
        if need > 0:
            if need <= self.blocks.num_free - num_running:
                req.block_ids.extend(self.blocks.allocate(need))
            else:
                k = len(req.block_ids) * bs - start - 1
        return max(k, 0)

    def record(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Count a verified draft (engine stats, the request's timing) and update its back-off."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        timing = req.timing
        timing.num_drafts += 1
        timing.num_draft_tokens += num_drafted
        timing.num_accepted_tokens += num_accepted
        state = req.spec
        state.accepted += num_accepted
        if num_accepted < num_drafted:
            state.rejections += 1
            self.num_rejections += 1
        if num_accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.cooldown = min(1 << state.misses, MAX_COOLDOWN)

    def trim(self, req: Request) -> None:
        """Give back blocks past the request's tokens (held for rejected draft tokens). The block
        table gets a new list (engine.scheduler.ScheduledChunk.block_ids)."""
        keep = self.blocks.blocks_needed(req.num_tokens)
        if len(req.block_ids) > keep:
            self.blocks.free(req.block_ids[keep:])
            req.block_ids = req.block_ids[:keep]
