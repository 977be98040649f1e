"""Bad input gets a clear error naming the field, before anything is scheduled;
requests already running are not disturbed."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from engine import (EngineOverloadedError, InvalidRequestError, LLM, LLMEngine, ModelLoadError, SamplingParams)
from tests.factories import make_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=16,
                                  max_model_len=512, max_waiting=3, max_num_seqs=2)


@pytest.mark.parametrize("prompt, match", [
    ([], "must not be empty"),
    ([1, 2, 10_000], r"integers in \[0, 512\)"),
    ([1, -1], r"integers in \[0, 512\)"),
    ([1, 2.0], "integers"),
    ("hello", "list of token ids"),
    ([3] * 200, "prompt has 200 tokens; at most 127 fit"),  # pool: 16 blocks x 8 tokens
])
def test_bad_prompts(engine, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, GREEDY)
    assert not engine.has_unfinished()


def test_bad_request_fields(engine):
    with pytest.raises(InvalidRequestError, match="params must be a SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0})
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        engine.add_request([1, 2], GREEDY, priority="high")
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request([1, 2], GREEDY, request_id="")


def test_bad_input_does_not_disturb_running_requests(engine, tiny_model_dir):
    want = LLM(str(tiny_model_dir), dtype="float32").generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0]
    engine.add_request([5, 6, 7], GREEDY, request_id="good")
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([8, 9], GREEDY, request_id="good")
    with pytest.raises(InvalidRequestError):
        engine.add_request([], GREEDY)
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == want.outputs[0].token_ids
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_overload_error_when_the_queue_is_full(engine):
    for i in range(7):  # 2 take the free slots at the next step, 3 may wait for one
        if i < 5:
            engine.add_request([1, 2, 3], GREEDY, request_id=f"q{i}")
        else:
            with pytest.raises(EngineOverloadedError, match=r"\(3 waiting, max_waiting 3\)"):
                engine.add_request([1, 2, 3], GREEDY, request_id=f"q{i}")
    for i in range(5):
        assert engine.abort(f"q{i}")
    outs = engine.step()
    assert sorted(o.request_id for o in outs if o.finish_reason == "abort") == [f"q{i}" for i in range(5)]
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_offline_generate_checks_each_request_once_and_all_before_any_runs(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64, max_waiting=1)
    checked = []
    check = llm.engine.check_request
    monkeypatch.setattr(llm.engine, "check_request", lambda ids, *args: checked.append(list(ids)) or check(ids, *args))
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]  # more than the queue holds at once
    outs = llm.generate(prompts, GREEDY)
    assert checked == [p["prompt_token_ids"] for p in prompts] and all(o.outputs[0].token_ids for o in outs)
    with pytest.raises(InvalidRequestError):  # the last one is bad: none of them ran
        llm.generate(prompts + [{"prompt_token_ids": [10**9]}], GREEDY)
    assert not llm.engine.has_unfinished() and llm.engine.stats().num_finished == 4


def test_abort_running_frees_blocks_before_next_step(engine):
    engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       request_id="long")
    engine.step()
    assert engine.block_manager.num_used > 0
    engine.abort("long")
    assert engine.block_manager.num_used == 0
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert not engine.has_unfinished()


def test_text_prompt_without_tokenizer_is_rejected(tmp_path):
    path = make_model_dir(tmp_path / "m", with_tokenizer=False)
    llm = LLM(str(path), dtype="float32")
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate("hello")


@pytest.fixture()
def model_copy(tiny_model_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, dst)
    return dst


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine.from_options(str(model_copy))


def test_corrupt_weights(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLMEngine.from_options(str(model_copy))


def test_corrupt_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine.from_options(str(model_copy))


def test_unsupported_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLMEngine.from_options(str(model_copy))


def test_weights_of_the_wrong_shape(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape"):
        LLMEngine.from_options(str(model_copy))


def test_unknown_model_name_lists_builtins():
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        LLMEngine.from_options("no-such-model-anywhere")


def test_max_model_len_beyond_the_model(tiny_model_dir):
    with pytest.raises(ValueError, match=r"max_model_len must be <= .*\(1024\)"):
        LLMEngine.from_options(str(tiny_model_dir), max_model_len=4096)


# ----------------------------------------------------------------------------- LLM beyond the queue bound
def _mixed_prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(2, 40))]} for _ in range(n)]


def _bounded_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64, max_waiting=2, max_num_seqs=2)


def test_llm_runs_more_prompts_than_the_queue_holds(tiny_model_dir, monkeypatch):
    prompts = _mixed_prompts(9, seed=1)
    alone = LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64)
    want = [alone.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    llm = _bounded_llm(tiny_model_dir)
    add, seen = llm.engine.add_request, {"overloaded": 0, "most": 0}

    def watched_add(*args, **kwargs):
        try:
            return add(*args, **kwargs)
        except EngineOverloadedError:
            seen["overloaded"] += 1
            raise
        finally:
            seen["most"] = max(seen["most"], len(llm.engine.requests))

    monkeypatch.setattr(llm.engine, "add_request", watched_add)
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert seen["overloaded"] > 0 and seen["most"] <= 2 + 2  # fed as room freed: max_waiting + slots
    assert not llm.engine.has_unfinished()
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used == 0


def test_llm_rejects_a_bad_prompt_before_scheduling_any(tiny_model_dir):
    llm = _bounded_llm(tiny_model_dir)
    with pytest.raises(InvalidRequestError):
        llm.generate(_mixed_prompts(6) + [{"prompt_token_ids": []}], GREEDY)
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_used == 0


@pytest.mark.parametrize("error", [RuntimeError("simulated model error"), KeyboardInterrupt()],
                         ids=["model-error", "keyboard-interrupt"])
def test_llm_leaves_no_request_behind_after_an_exception(tiny_model_dir, monkeypatch, error):
    llm = _bounded_llm(tiny_model_dir)
    prompts = _mixed_prompts(9, seed=2)
    execute, calls = llm.engine.runner.execute, []

    def failing_execute(*args, **kwargs):  # fails mid-step, after blocks were allocated
        calls.append(1)
        if len(calls) == 3:
            raise error
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", failing_execute)
    with pytest.raises(type(error)):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished()
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used == 0
    monkeypatch.undo()
    again = llm.generate(prompts[:3], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in again] == [GREEDY.max_tokens] * 3


def test_without_a_queue_a_request_is_taken_when_a_slot_is_free(tiny_model_dir):
    engine = LLMEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=16,
                                    max_model_len=512, max_waiting=0, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request([1, 2, 3], params, request_id="first")
    with pytest.raises(EngineOverloadedError, match="max_waiting 0"):  # the one slot is spoken for
        engine.add_request([1, 2, 3], params, request_id="second")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finish_reason for o in outs if o.finished] == ["length"]
    engine.add_request([4, 5], params, request_id="third")  # the slot is free again
    assert engine.has_unfinished()
