"""Batched sampling: logit bias, penalties, temperature, top-k, top-p, min-p, greedy, logprobs.

Everything is a tensor op over the batch; per-request Python happens only to build the
parameter tensors. Random draws are batch-invariant: request ``r`` drawing its ``p``-th output
token inverts its distribution's CDF at one uniform that is a pure hash of (seed_r, p), so a
seeded request gets the same tokens alone, in any batch, and after being preempted and
recomputed. One draw per row, not per vocabulary entry: Gumbel noise over the vocabulary cost
~4 ms a step at 16 x 49k on CPU, a softmax and a scan ~1 ms.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch

from engine.host_tensors import host_tensor
from engine.request import Request
from engine.structured import mask_logits



def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed value torch.int64 stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


PROMPT_ROWS_AT_ONCE = 128
SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy: dividing by them overflows float32 logits (as in vLLM)."""

_GOLDEN, _MUL1, _MUL2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)
_POS_MUL = _i64(0xD1B54A32D192ED03)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of tied maxima, as ``argmax``): ``max``'s indices cost 30-40 % less
    than ``argmax`` on CPU (16 x 49,152 float32: ~0.6 ms against ~0.9 on 2 threads)."""
    return logits.max(dim=-1).indices


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[N]`` float64 uniforms in (0, 1), a splitmix64 hash of (seed, position)."""
    x = seeds * _GOLDEN + positions * _POS_MUL
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).double() + 0.5) * (1.0 / (1 << 53))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, built once per step from the requests that sample."""

    requests: list[Request]
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    all_greedy: bool
    all_random: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    any_min_tokens: bool
    any_logit_bias: bool
    any_structured: bool
    max_logprobs: int | None
    offsets: list[int] | None = None
    """Per row, the draft tokens before it (engine.spec_verify); None: one row per request."""

    @classmethod
    def build(cls, requests: list[Request], device: torch.device, offsets: list[int] | None = None) -> "SamplingBatch":
        """``offsets``: per row, how many tokens past the request's next one it samples (draft
        verification gives a request several rows: engine.spec_verify); default none."""
        # Each request's parameters are read once and cached on it: a step only zips the rows.
        rows = [r.sampling_row or _sampling_row(r) for r in requests]
        temps, top_p, min_p, top_k, seeds, logprobs, kinds = (list(c) for c in zip(*rows))
        some, every = functools.reduce(operator.or_, kinds), functools.reduce(operator.and_, kinds)
        # Two host-to-device copies that do not wait for the GPU (the step syncs once, on its tokens).
        floats = host_tensor(torch.float32, temps, top_p, min_p).view(3, -1)
        positions = [len(r.token_ids) - r.num_prompt_tokens for r in requests]
        if offsets is not None:
            positions = [p + o for p, o in zip(positions, offsets)]
        ints = host_tensor(torch.int64, top_k, seeds, positions).view(3, -1)
        if torch.device(device).type != "cpu":
            # Pinned (torch's host allocator caches the pages): a copy from pageable memory would block.
            floats, ints = (t.pin_memory().to(device, non_blocking=True) for t in (floats, ints))
        temperature, top_p_t, min_p_t = floats.unbind()
        top_k_t, seeds_t, positions = ints.unbind()
        most_logprobs = max(logprobs)
        return cls(
            requests=requests, temperature=temperature, top_k=top_k_t, top_p=top_p_t, min_p=min_p_t,
            seeds=seeds_t, positions=positions,
            all_greedy=bool(every & _GREEDY), all_random=not (some & _GREEDY),
            any_top_k=bool(some & _TOP_K), any_top_p=bool(some & _TOP_P), any_min_p=bool(some & _MIN_P),
            any_penalty=bool(some & _PENALTY), any_logit_bias=bool(some & _LOGIT_BIAS),
            any_min_tokens=bool(some & _MIN_TOKENS) and any(r.num_output_tokens < r.params.min_tokens
                                                            for r in requests),
            any_structured=any(r.matcher is not None for r in requests),
            max_logprobs=most_logprobs if most_logprobs >= 0 else None, offsets=offsets,
        )


_GREEDY, _TOP_K, _TOP_P, _MIN_P, _PENALTY, _LOGIT_BIAS, _MIN_TOKENS = (1 << i for i in range(7))


def _sampling_row(r: Request) -> tuple:
    """(temperature, top_p, min_p, top_k, seed, logprobs or -1, feature bits) of a request, cached on it."""
    p = r.params
    kinds = ((_GREEDY if p.temperature < SAMPLING_EPS else 0) | (_TOP_K if p.top_k > 0 else 0)
             | (_TOP_P if p.top_p < 1.0 else 0) | (_MIN_P if p.min_p > 0.0 else 0)
             | (_PENALTY if p.uses_penalties else 0) | (_LOGIT_BIAS if p.logit_bias else 0)
             | (_MIN_TOKENS if p.min_tokens > 0 else 0))
    r.sampling_row = (p.temperature, p.top_p, p.min_p, max(p.top_k, 0), r.seed,
                      -1 if p.logprobs is None else p.logprobs, kinds)
    return r.sampling_row


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[dict[int, float] | None]]:
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs is not None else None
        if batch.any_structured:
            # First: on a GPU nothing before it waits for the forward, so the host fills the
            # grammar masks while the device still computes the logits.
            logits = mask_logits(logits, batch.requests, batch.offsets)
        if batch.any_logit_bias:
            logits = apply_logit_bias(logits, batch.requests)
        if batch.any_penalty:
            logits = apply_penalties(logits, batch.requests, batch.offsets)
        if batch.any_min_tokens:
            logits = suppress_stop_tokens(logits, batch.requests)
        if batch.all_greedy:
            tokens = greedy_tokens(logits)
        else:
            tokens = self._sample(logits, batch)
        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(token_list)
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, tokens, token_list, batch)
        return token_list, logprobs

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        greedy = None if b.all_random else greedy_tokens(logits)
        hot = b.temperature >= SAMPLING_EPS
        scaled = logits / torch.where(hot, b.temperature, torch.ones_like(b.temperature)).unsqueeze(1)
        if b.any_top_k or b.any_top_p:
            scaled = _top_k_top_p(scaled, b)
        # Unnormalised weights, in place (each new batch-sized tensor costs its page faults on CPU):
        # the row's best token weighs 1, so min_p's floor is min_p itself.
        weights = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
        if b.any_min_p:
            weights.masked_fill_(weights < b.min_p.unsqueeze(1), 0.0)
        # A row of NaN (a broken model's logits) finds no token: the last id, never one past it.
        sampled = inverse_cdf(weights, hashed_uniform(b.seeds, b.positions)).clamp_(max=logits.shape[1] - 1)
        return sampled if greedy is None else torch.where(hot, sampled, greedy)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative mass exceeds ``u`` of the row's total.

    ``probs`` (float32, overwritten by its running sum) need not be normalised: filtered tokens
    carry 0 and are never chosen, since the token found always adds mass."""
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # u < 1, but u * total may round to total; capped one step below, the search stays in the row.
    target = torch.minimum(u.to(cdf.dtype).unsqueeze(1) * total, total * (1 - 2.0 ** -24))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _top_k_top_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    if b.any_top_k:
        k = torch.where(b.top_k > 0, b.top_k, torch.full_like(b.top_k, logits.shape[1]))
        sorted_logits = sorted_logits.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
    if b.any_top_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # keep tokens while the mass before them is below top_p (always keeps the first)
        sorted_logits = sorted_logits.masked_fill(mass_before >= b.top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, requests: list[Request], offsets: list[int] | None = None) -> torch.Tensor:
    """vLLM semantics: repetition over prompt + output, presence / frequency over output only.
    ``offsets``: a row after j draft tokens counts them as output (engine.spec_verify)."""
    n, vocab = logits.shape
    dev = logits.device
    out_counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    rep = torch.ones(n, dtype=torch.float32, device=dev)
    pres = torch.zeros(n, dtype=torch.float32, device=dev)
    freq = torch.zeros(n, dtype=torch.float32, device=dev)
    for i, r in enumerate(requests):
        p = r.params
        if not p.uses_penalties:
            continue
        rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        drafted = r.spec.drafts[:offsets[i]] if offsets is not None and offsets[i] else []
        out = r.output_token_ids + drafted
        if out:
            ids = torch.tensor(out, dtype=torch.int64, device=dev)
            out_counts[i].index_add_(0, ids, torch.ones(len(out), device=dev))
        seen[i, torch.tensor(r.token_ids + drafted, dtype=torch.int64, device=dev)] = True
    logits = logits.clone()
    penalised = torch.where(logits > 0, logits / rep.unsqueeze(1), logits * rep.unsqueeze(1))
    logits = torch.where(seen, penalised, logits)
    logits -= freq.unsqueeze(1) * out_counts + pres.unsqueeze(1) * (out_counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Each request's ``logit_bias`` added to its row (ids were checked against the vocabulary)."""
    rows, cols, values = [], [], []
    for i, r in enumerate(requests):
        for token_id, bias in (r.params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    dev = logits.device
    logits = logits.clone()
    logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                      torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def suppress_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Forbid EOS and stop token ids for requests that have not reached min_tokens yet."""
    rows, cols = [], []
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        if r.num_output_tokens < r.params.min_tokens and r.matcher is None:  # a grammar says when it ends
            ids = [t for t in (*r.eos_token_ids, *r.params.stop_token_ids) if t < vocab]
            rows.extend([i] * len(ids))
            cols.extend(ids)
    if not rows:
        return logits
    logits = logits.clone()
    logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits


def prompt_logprobs(logits: torch.Tensor, scored: list[tuple[Request, range]]) -> list[tuple[Request, list[dict]]]:
    """Per (request, positions): the logprob of the prompt token after each position and the
    request's ``prompt_logprobs`` alternatives, from those positions' logits rows (in order)."""
    nexts = torch.tensor([r.token_ids[q + 1] for r, positions in scored for q in positions], device=logits.device)
    k = max(r.params.prompt_logprobs for r, _ in scored)
    chosen, tv, ti = [], [], []
    for i in range(0, logits.shape[0], PROMPT_ROWS_AT_ONCE):  # a vocabulary-wide float32 copy per slice only
        raw = torch.log_softmax(logits[i:i + PROMPT_ROWS_AT_ONCE].float(), dim=-1)
        chosen += raw.gather(1, nexts[i:i + PROMPT_ROWS_AT_ONCE].unsqueeze(1)).squeeze(1).tolist()
        if k > 0:
            top_vals, top_ids = raw.topk(k, dim=-1)
            tv, ti = tv + top_vals.tolist(), ti + top_ids.tolist()
    out, row = [], 0
    for req, positions in scored:
        n = req.params.prompt_logprobs
        entries = []
        for q in positions:
            entry = {req.token_ids[q + 1]: chosen[row]}
            if n:
                for tid, val in zip(ti[row][:n], tv[row][:n]):
                    entry.setdefault(tid, val)
            entries.append(entry)
            row += 1
        out.append((req, entries))
    return out


def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
                     b: SamplingBatch) -> list[dict[int, float] | None]:
    chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    k = b.max_logprobs or 0
    top_vals, top_ids = (raw.topk(k, dim=-1) if k > 0 else (None, None))
    tv = top_vals.tolist() if top_vals is not None else None
    ti = top_ids.tolist() if top_ids is not None else None
    out: list[dict[int, float] | None] = []
    for i, r in enumerate(b.requests):
        n = r.params.logprobs
        if n is None:
            out.append(None)
            continue
        entry = {token_list[i]: chosen[i]}
        if n and ti is not None:
            for tid, val in zip(ti[i][:n], tv[i][:n]):
                entry.setdefault(tid, val)
        out.append(entry)
    return out
