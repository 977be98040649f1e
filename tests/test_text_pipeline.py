"""The offline LLM and serving turn token ids into text with one pipeline (engine.detokenizer)."""

from __future__ import annotations

import pytest

from deployments.contract import EngineMessage
from deployments.textstream import TextAssembler
from engine import LLM, SamplingParams

PROMPT = "héllo wörld 日本語 🙂"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=128, max_num_seqs=4)


def _served(tokenizer, params, token_ids, per_message):
    """TextAssembler over the same tokens, ``per_message`` ids per engine message."""
    asm = TextAssembler(tokenizer, "r", params, prompt_token_ids=[5, 6, 7])
    text, ids, finish = "", [], None
    for i in range(0, len(token_ids), per_message):
        last = i + per_message >= len(token_ids)
        chunk = token_ids[i:i + per_message]
        delta = asm.push(EngineMessage(chunk, "length" if last else None, None, 3, i + len(chunk), 0))
        text, ids, finish = text + delta.text, ids + list(delta.token_ids), delta.finish_reason
        if finish:
            break
    return text, ids, finish


def test_offline_and_served_text_agree(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert free.text == llm.tokenizer.decode(free.token_ids)
    for per_message in (1, 3):
        assert _served(llm.tokenizer, SamplingParams(max_tokens=40), free.token_ids, per_message) == (
            free.text, free.token_ids, "length")


def test_a_stop_string_ends_both_at_the_same_token(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    tok = llm.tokenizer
    # a stop string of the output that spans tokens: the text of tokens 10..12, from mid-token 10
    stop = tok.decode(free.token_ids[:13])[len(tok.decode(free.token_ids[:10])) + 1:]
    assert len(stop) >= 2 and "\ufffd" not in stop
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    out = llm.generate(PROMPT, params)[0].outputs[0]
    end = free.text.index(stop)
    assert out.finish_reason == "stop" and out.text == free.text[:end]
    # its tokens end at the one that completed the stop string
    completing = next(k for k in range(1, len(free.token_ids) + 1) if stop in tok.decode(free.token_ids[:k]))
    assert out.token_ids == free.token_ids[:completing]
    for per_message in (1, 4):
        assert _served(tok, params, free.token_ids, per_message) == (out.text, out.token_ids, "stop")
