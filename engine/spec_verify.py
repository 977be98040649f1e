"""Speculative decoding, the runner's and the engine's side: verify drafts, keep what the target says.

A request verifying k draft tokens gets k + 1 logits rows (engine.attention.metadata). Row j is
sampled exactly as the request's next token would be if the first j drafts were already its
tokens: same logits processing, and for sampled requests the same uniform, the hash of (seed,
output position) (engine.sampler). Draft j is accepted while the token sampled at row j equals it;
the first row that disagrees gives the correction token, or, all drafts accepted, the last row
gives a bonus token. Each kept token is then the one decoding without drafts would have produced
(given the same logits), so greedy output is unchanged token for token and seeded requests stay
reproducible. For a sampled request this is rejection sampling with a one-hot draft: draft x is
kept with probability p(x), and otherwise the token comes from p with x removed, renormalised.
"""

from __future__ import annotations

import time

from engine.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, StreamOutput
from engine.request import Request, RequestStatus
from engine.structured import grammar_step


def draft_rows(sampling: list) -> tuple[list[Request], list[int]]:
    """Per logits row of a step with drafts: its request, and how far past the request's next
    token the row samples."""
    reqs: list[Request] = []
    offsets: list[int] = []
    for c in sampling:
        n = c.num_tokens if c.speculative else 1
        reqs += [c.request] * n
        offsets += range(n)
    return reqs, offsets


def accepted_prefix(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions."""
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return m


class EngineSpeculation:
    """The step-end of a step with drafts. Mixed into ``engine.engine.LLMEngine``, whose
    ``scheduler``, ``_append_token``, ``finish`` and ``_output`` it uses."""

    def _verified_step(self, sched, reqs: list[Request], tokens: list[int], logprobs: list,
                       outputs: list[StreamOutput]) -> int:
        """Accept each verified draft's prefix, advance the requests and emit one output per
        request; returns the tokens generated."""
        speculator = self.scheduler.speculator
        drafting = {id(c.request): c for c in sched.chunks if c.speculative}
        plain, verified = [], []
        i = 0
        while i < len(reqs):
            req, chunk = reqs[i], drafting.get(id(reqs[i]))
            if chunk is None:
                plain.append((req, tokens[i], logprobs[i]))
                i += 1
                continue
            rows = slice(i, i + chunk.num_tokens)
            drafts, sampled, lps = chunk.draft_token_ids, tokens[rows], logprobs[rows]
            i += chunk.num_tokens
            m = accepted_prefix(sampled, drafts)
            speculator.record(req, len(drafts), m)
            kept, reason = _extend(req, sampled[:m + 1])
            # Computed now: the last token and the drafts kept (the rest's KV slots are rewritten later).
            chunk.num_tokens = 1 + min(kept, m)
            verified.append((req, kept, reason, lps[:kept] if req.params.logprobs is not None else None))
        # With the kept drafts in token_ids, the blocks they fill are published to the prefix cache.
        self.scheduler.after_step(sched)
        now = time.monotonic()
        for req, tok, lp in plain:
            outputs.append(self._append_token(req, tok, lp, now))
        generated = len(plain)
        for req, kept, reason, lps in verified:
            if reason is not None:
                self.finish(req, reason, now)
            elif req.status is RequestStatus.RUNNING:
                speculator.trim(req)
            outputs.append(self._output(req, req.token_ids[-kept:], lps))
            generated += kept
        return generated

    def _spec_stats(self, s) -> None:
        speculator = self.scheduler.speculator
        s.spec_decode_num_drafts = speculator.num_drafts
        s.spec_decode_num_draft_tokens = speculator.num_draft_tokens
        s.spec_decode_num_accepted_tokens = speculator.num_accepted_tokens
        s.spec_decode_num_accepted_tokens_per_pos = tuple(speculator.accepted_per_pos)


def _extend(req: Request, new: list[int]) -> tuple[int, str | None]:
    """Append tokens as ``LLMEngine._append_token`` would one at a time (its grammar advanced by each),
    stopping at the first that ends the request (tokens after it are dropped); returns (tokens
    kept, finish reason)."""
    token_ids, p = req.token_ids, req.params
    kept = 0
    for tok in new:
        token_ids.append(tok)
        kept += 1
        n_out = len(token_ids) - req.num_prompt_tokens
        grammar = grammar_step(req, tok) if req.matcher is not None else None
        if grammar == FINISH_ABORT:
            return kept, grammar
        if n_out >= p.min_tokens and (tok in req.eos_token_ids or tok in p.stop_token_ids):
            req.stop_token_id = tok
            return kept, FINISH_STOP
        if grammar is not None:
            return kept, grammar
        if (p.max_tokens is not None and n_out >= p.max_tokens) or len(token_ids) >= req.max_total_tokens:
            return kept, FINISH_LENGTH
    return kept, None
