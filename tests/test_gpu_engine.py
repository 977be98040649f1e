"""The engine on CUDA (run where a GPU is present; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.factories import make_model_dir

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 9, 13, 200, 7], list(range(20, 300)), [300] * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("gpu"), "llama", seed=4, with_tokenizer=False,
                          hidden=128, heads=8, kv_heads=2)


def _engine_tokens(path, **options):
    llm = LLM(str(path), device="cuda", **options)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def test_cuda_fp32_torch_backend_matches_hf(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    want = []
    for p in PROMPTS:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    got = _engine_tokens(model_dir, dtype="float32", attention_backend="torch", block_size=16, num_kv_blocks=128)
    assert got == want


def test_flash_backend_agrees_with_torch_backend(model_dir):
    pytest.importorskip("flash_attn")
    flash = _engine_tokens(model_dir, dtype="bfloat16", attention_backend="flash", block_size=256, num_kv_blocks=16)
    ref = _engine_tokens(model_dir, dtype="bfloat16", attention_backend="torch", block_size=256, num_kv_blocks=16)
    # bf16 kernels round differently; the first tokens of each greedy path must agree.
    assert [t[:4] for t in flash] == [t[:4] for t in ref]
