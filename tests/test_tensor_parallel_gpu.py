"""Tensor parallelism over NCCL: the same checks as the CPU (gloo) tests, on two GPUs.

Marked ``gpu``: skipped without CUDA, and here also with fewer than two devices.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.factories import make_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# float32 so that TP=2 (a different all-reduce order) still matches TP=1 token for token.
POOL = dict(dtype="float32", device="cuda", block_size=16, num_kv_blocks=24, max_num_seqs=4)
PROMPTS = [[5, 9, 13, 200, 7], list(range(20, 53)), [300] * 3, list(range(100, 117)), [42] * 25]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(autouse=True)
def _two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


@pytest.mark.parametrize("arch,kw", [("llama", dict(tie=True)), ("qwen2", dict())], ids=["llama", "qwen2-gqa"])
def test_nccl_tp2_matches_tp1_under_preemption(tmp_path, arch, kw):
    path = str(make_model_dir(tmp_path / arch, arch, seed=3, with_tokenizer=False, **kw))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    one = LLM(path, **POOL)
    want = [list(o.outputs[0].token_ids) for o in one.generate(prompts, GREEDY)]
    one.shutdown()
    two = LLM(path, tensor_parallel_size=2, **POOL)
    try:
        got = [list(o.outputs[0].token_ids) for o in two.generate(prompts, GREEDY)]
        assert two.engine.stats().num_preemptions > 0  # the small pool forced recomputes
    finally:
        two.shutdown()
    assert got == want
