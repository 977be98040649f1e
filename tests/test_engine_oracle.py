"""Greedy tokens of the engine equal HF transformers' ``generate`` one prompt at a time.

Every supported architecture, a concurrent batch of prompts of very different lengths, under
each scheduling knob: prefix caching on/off, chunked prefill on/off, static vs continuous,
and a KV pool so small that preemption must happen.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.factories import make_model_dir

MAX_NEW = 10


@pytest.fixture(scope="module", params=["llama", "llama3", "mistral", "qwen2", "qwen3"])
def arch_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=1, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def _prompts(seed: int = 0, n: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 17, 40, 95, 130, 8][:n]
    shared = [rng.randrange(3, 500) for _ in range(24)]
    out = [[rng.randrange(3, 500) for _ in range(L)] for L in lengths]
    out.append(shared + [7, 8, 9])        # two prompts sharing a 24-token prefix:
    out.append(shared + [10, 11, 12, 13])  # exercises prefix-cache hits
    return out


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(arch_model):
    _, _, hf = arch_model
    return [_hf_greedy(hf, p, MAX_NEW) for p in _prompts()]


KNOBS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "no-chunked-prefill": {"enable_chunked_prefill": False},
    "static": {"scheduling": "static"},
    "small-budget": {"max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("knob", KNOBS)
def test_greedy_matches_hf(arch_model, expected, knob):
    _, path, _ = arch_model
    options = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 96, "max_num_seqs": 4,
               "max_num_batched_tokens": 64, **KNOBS[knob]}
    llm = LLM(str(path), **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free == bm.num_blocks
    if knob == "default":
        assert llm.engine.stats().prefix_cache_hits > 0


def test_greedy_matches_hf_under_preemption(arch_model, expected):
    _, path, _ = arch_model
    # 20 blocks of 8 tokens cannot hold four running requests of up to 140 tokens: preemption.
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=20, max_num_seqs=4,
              max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats().num_preemptions > 0
    assert any(o.timing.num_preemptions > 0 for o in outs)
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks


def test_tied_embeddings_match_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_model_dir(tmp_path / "tied", "llama", seed=3, with_tokenizer=False, tie=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(seed=5)[:4]
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 6) for p in prompts]
