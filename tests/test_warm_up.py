"""Ready means ready: the start-up warm-up (engine.warm_up) runs every path a step can take, so
real requests compile nothing and the first one costs about what the tenth does."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from engine.attention.metadata import order_chunks
from engine.warm_up import warm_up_steps
from tests.factories import make_model_dir

# The compiled model of tests/test_compiled_model.py: the same graphs, so inductor's disk cache serves both.
OPTIONS = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
               num_kv_blocks=96, enforce_eager=False)
REPEATS = 10
FIRST_OVER_STEADY = 3.0
"""How much longer a request of one shape may take the first time than later ones (a compile on a
real request takes seconds, a request of the tiny model milliseconds)."""


@pytest.mark.parametrize("limits", [(8, 4, 16, 1024, 96), (32, 16, 2048, 4096, 4096), (16, 1, 16, 64, 10),
                                    (16, 4, 2048, 6, 64), (16, 2, 4, 64, 3), (16, 4, 2048, 4096, 2)])
def test_warm_up_steps_fit_the_engine_and_read_only_what_an_earlier_step_wrote(limits):
    block_size, max_seqs, budget, max_len, num_blocks = limits
    steps = warm_up_steps(*limits)
    written: dict[int, int] = {}  # sequence (its first block) -> tokens it holds
    kinds = set()
    for step in steps:
        order, decodes, gathered = order_chunks(step.chunks)
        assert len(order) <= max_seqs and sum(c.num_tokens for c in order) <= budget, step.name
        # (many tokens, decode-only, decodes beside chunks after a prefix)
        kinds.add((sum(c.num_tokens for c in order) > 1, decodes == len(order), 0 < decodes < gathered))
        for c in order:
            assert c.start + c.num_tokens <= min(max_len, len(c.block_ids) * block_size), step.name
            assert max(c.block_ids) < max(num_blocks, 2) and c.samples
            assert written.get(c.block_ids[0], 0) == c.start, f"{step.name}: reads what nothing wrote"
            written[c.block_ids[0]] = c.start + c.num_tokens
    blocks = [b for s in steps for c in s.chunks for b in c.block_ids]
    assert {(True, False, False), (False, True, False)} <= kinds  # both graphs: many tokens, one
    if max_seqs >= 4 and budget >= 16 and num_blocks >= 8 and max_len >= 16:
        # and a decode-only step of several rows, a mixed one with decodes beside chunks of every kind
        assert (True, True, False) in kinds and any(k[2] for k in kinds), [s.name for s in steps]
        assert len(set(blocks)) == max(blocks) + 1  # the pool's first blocks


def _requests(rep: int) -> dict[str, tuple[list[list[int]], dict]]:
    """Each shape's prompts for repetition ``rep``: other tokens each time (no prefix-cache hits)."""
    def prompt(n: int, salt: int) -> list[int]:
        return [3 + (rep * 37 + salt * 11 + i) % 400 for i in range(n)]
    greedy = dict(temperature=0.0)
    return {
        "single decode": ([prompt(3, 0)], greedy),
        "batched decode": ([prompt(3, 1), prompt(5, 2), prompt(2, 3)], greedy),
        "long prompt": ([prompt(40, 4)], greedy),  # chunks of 16: chunks after a prefix
        "mixed, sampled": ([prompt(30, 5), prompt(2, 6), prompt(4, 7)],  # decodes beside chunks
                           dict(temperature=0.8, top_p=0.9, top_k=20, seed=rep)),
    }


def test_real_requests_compile_nothing_after_ready_and_the_first_costs_about_the_tenth(tmp_path, caplog):
    from torch._dynamo.utils import counters

    from engine import LLM, SamplingParams
    from engine.cpu_features import kernel_isa

    path = make_model_dir(tmp_path, "qwen3", seed=5, with_tokenizer=False)
    # Graphs other engines of this shape compiled in this process would serve requests the warm-up missed.
    torch._dynamo.reset()
    caplog.set_level(logging.INFO, logger="engine")
    llm = LLM(str(path), **OPTIONS)
    assert llm.engine.runner.compile_s > 0
    # The start says what it does: the host, each warm-up step (the two that compile), ready.
    said = [r.getMessage() for r in caplog.records]
    steps = len(warm_up_steps(8, 4, 16, llm.engine.max_model_len, llm.engine.runner.num_blocks))
    assert any(m.startswith("host: ") and f"C++ kernels: {kernel_isa()}" in m for m in said)
    assert sum(f" of {steps} (" in m for m in said) == steps and sum("compiling its graph" in m for m in said) == 2
    assert said[-1].startswith("engine ready in ")
    # The warm-up's throwaway sequences leave nothing in the pool.
    assert all(int(t.count_nonzero()) == 0 for kv in llm.engine.runner.kv_caches for t in kv)
    compiled = counters["stats"]["unique_graphs"]
    seconds: dict[str, list[float]] = {}
    for rep in range(REPEATS):
        for shape, (prompts, params) in _requests(rep).items():
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, **params))
            seconds.setdefault(shape, []).append(time.perf_counter() - t0)
    assert counters["stats"]["unique_graphs"] == compiled, "a real request compiled a graph"
    for shape, times in seconds.items():
        # Against the slowest of the later ones: other work on this host can slow a few requests
        # several-fold (two torch threads on two shared cores), a compile slows the first one only.
        assert times[0] <= FIRST_OVER_STEADY * max(times[1:]), (shape, [round(t, 3) for t in times])
