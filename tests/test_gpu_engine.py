"""The engine on CUDA (run where a GPU is present; skipped elsewhere): fp32 equals HF greedy
with the torch backend and the Triton kernel, compiled and captured in CUDA graphs, captured
uncompiled, and eager, and with a KV pool small enough that preemption must happen; the
auto-chosen kernel agrees with the torch backend in bf16 up to the reference's near-ties."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.factories import make_model_dir

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 9, 13, 200, 7], list(range(20, 300)), [300] * 3, list(range(40, 140)), [17] * 60, [8, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("gpu"), "llama", seed=4, with_tokenizer=False,
                          hidden=128, heads=8, kv_heads=2)


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    want = []
    for p in PROMPTS:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    return want


def _engine(path, **options) -> LLM:
    return LLM(str(path), device="cuda", **options)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


MODES = {"compiled": {"enforce_eager": False}, "graphs": {"enforce_eager": False, "compile_model": False},
         "eager": {"enforce_eager": True}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_fp32_matches_hf(model_dir, hf_greedy, backend, mode):
    llm = _engine(model_dir, dtype="float32", attention_backend=backend, block_size=16, num_kv_blocks=128,
                  **MODES[mode])
    runner = llm.engine.runner
    assert (runner.graphs is not None, runner.compiled is not None) == (mode != "eager", mode == "compiled")
    assert _tokens(llm) == hf_greedy


def test_cuda_fp32_matches_hf_with_preemption_forced(model_dir, hf_greedy):
    # 21 blocks of 16 tokens: the first three prompts are admitted together and end needing 2 + 19 + 2.
    llm = _engine(model_dir, dtype="float32", attention_backend="torch", block_size=16, num_kv_blocks=21,
                  max_num_seqs=4)
    assert _tokens(llm) == hf_greedy
    assert llm.engine.stats().num_preemptions > 0


# Two bf16 kernels that sum in another order give logprobs up to ~0.07 nats apart on this model
# (bf16's step is 1/32 nats at these logit sizes; the CPU kernel against the torch backend, measured).
# So each may pick either of two tokens whose logprobs are within twice that.
BF16_NOISE = 0.15


def greedy_logprobs(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_bf16_paths_agree(got: list, want: list) -> None:
    """Greedy paths of two bf16 backends (from ``greedy_logprobs``) agree up to the first near-tie of
    the reference, with the same logprobs along the way."""
    agreed = 0
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
        agreed += same
        for i in range(same):
            assert lps[i][tokens[i]] == pytest.approx(ref_lps[i][ref_tokens[i]], abs=BF16_NOISE)
        if same < len(ref_tokens):
            top = sorted(ref_lps[same].values(), reverse=True)
            assert top[0] - top[1] <= BF16_NOISE, f"paths split at token {same} where the reference is sure"
    assert agreed >= len(want) * 4  # ties are rare: the paths are compared over many tokens


@pytest.mark.parametrize("block_size", [16, 256])
def test_auto_backend_agrees_with_torch_backend_in_bf16(model_dir, block_size):
    auto = _engine(model_dir, dtype="bfloat16", block_size=block_size, num_kv_blocks=4096 // block_size)
    assert auto.engine.runner.backend.name != "torch"
    ref = _engine(model_dir, dtype="bfloat16", attention_backend="torch", block_size=block_size,
                  num_kv_blocks=4096 // block_size)
    assert_bf16_paths_agree(greedy_logprobs(auto), greedy_logprobs(ref))


def test_flash_backend_agrees_with_torch_backend(model_dir):
    pytest.importorskip("flash_attn")
    flash = _engine(model_dir, dtype="bfloat16", attention_backend="flash", block_size=256, num_kv_blocks=16)
    ref = _engine(model_dir, dtype="bfloat16", attention_backend="torch", block_size=256, num_kv_blocks=16)
    assert_bf16_paths_agree(greedy_logprobs(flash), greedy_logprobs(ref))
