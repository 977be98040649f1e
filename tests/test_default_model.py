"""The real default model (SmolLM2-135M-Instruct, converted from the bundled GGUF):
greedy tokens equal HF transformers', chat prompts give sensible text."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow
MAX_NEW = 16


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", max_num_seqs=4, block_size=16, num_kv_blocks=128)


def test_greedy_matches_hf(llm, default_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tok = llm.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("def fibonacci(n):"),
        tok.encode("The three primary colours are"),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW))  # as HF min_new_tokens
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                          do_sample=False, pad_token_id=2)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref


def test_chat_answer_is_sensible_and_stops(llm):
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_stop_string_cuts_the_text(llm):
    out = llm.generate("The three primary colours are red,",
                       SamplingParams(temperature=0, max_tokens=32, stop=["yellow", "blue"]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert "yellow" not in out.text and "blue" not in out.text


COPY = ("Repeat this paragraph exactly, then stop: The council met on Tuesday to discuss the new library. "
        "Members agreed that the building needs more light, more seats and longer opening hours.")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_drafts_leave_the_served_weights_greedy_text_unchanged(default_model_dir, method):
    """The default model as `slotserve serve` runs it (its GGUF blocks, in the host's default dtype):
    greedy tokens with n-gram drafts, and with its own GGUF file as draft model, equal the tokens
    without drafts, while drafts are really proposed. The draft equal to the target (one arithmetic
    per row in any step: batch invariance) has every draft accepted."""
    from engine.models_hub import DEFAULT_MODEL, resolve_gguf

    gguf = str(resolve_gguf(DEFAULT_MODEL, default_model_dir, None))
    base = dict(quantization="gguf", gguf_file=gguf, max_num_seqs=4, block_size=16, num_kv_blocks=128)
    spec = {"method": method, "num_speculative_tokens": 4, "cost_model": False}
    if method == "draft_model":  # the draft finds its GGUF file by the built-in model's name
        spec.update(model=DEFAULT_MODEL, quantization="gguf")
    plain = LLM(str(default_model_dir), **base)
    prompts = [{"prompt_token_ids": plain.tokenizer.apply_chat_template([{"role": "user", "content": text}])}
               for text in (COPY, "Write a short poem about the sea.")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(default_model_dir), **base, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    llm.engine.block_manager.check_invariants()
