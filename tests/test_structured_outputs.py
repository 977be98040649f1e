"""Structured outputs in the engine: outputs follow their schema, regex, choice or grammar, in any
batch, across preemption and resume; requests without one are untouched; bad specs are refused."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=512, max_num_seqs=8)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects, arrays, enums, strings, bounded numbers, booleans; every one can end in a few tokens."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": 3}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "plum"], rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    return {"type": "boolean"}


def _text(llm, out) -> str:
    return llm.tokenizer.decode(out.token_ids)


def test_twenty_random_schemas_are_followed(llm):
    rng = random.Random(7)
    schemas = [{"type": "object", "properties": {"v": random_schema(rng)}, "required": ["v"],
                "additionalProperties": False} for _ in range(20)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs={"json": s})
              for i, s in enumerate(schemas)]
    outs = llm.generate([{"prompt_token_ids": [5 + i, 9, 11]} for i in range(20)], params)
    for schema, out in zip(schemas, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, _text(llm, o))
        jsonschema.validate(json.loads(_text(llm, o)), schema)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [({"regex": r"[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
             ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
             ({"grammar": 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'},
              lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t))]
    for seed in range(3):
        for spec, ok in cases:
            o = llm.generate({"prompt_token_ids": [7, 8, seed]},
                             SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured_outputs=spec))
            o = o[0].outputs[0]
            assert o.finish_reason == "stop" and ok(_text(llm, o)), (spec, _text(llm, o))
    # Any JSON object: a random model's strings have no end in sight, so a short budget and a prefix check
    # (an unconstrained output of this model starts with "{" about once in 500 draws).
    for seed in range(3):
        o = llm.generate({"prompt_token_ids": [7, 8, seed]}, SamplingParams(
            temperature=1.0, seed=seed, max_tokens=8, structured_outputs={"json_object": True}))[0].outputs[0]
        text = _text(llm, o)
        assert text.lstrip().startswith("{"), text
        assert o.finish_reason == "length" or isinstance(json.loads(text), dict)


def test_unconstrained_neighbours_are_untouched_and_preemption_keeps_the_grammar(llm, tiny_model_dir):
    free = [{"prompt_token_ids": [3 + i, 4, 5, 6]} for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy)]
    # A bounded length (at most 26 characters), so each request fits the small pool below alone.
    spec = SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                          structured_outputs={"regex": r'\{"a": \[([0-9]{1,2}, ){0,3}[0-9]{1,2}\]\}'})
    constrained = [{"prompt_token_ids": [20 + i, 21, 22]} for i in range(4)]
    mixed = llm.generate(free + constrained, [greedy] * 4 + [spec] * 4)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    # The same constrained requests in a pool too small for all of them: preempted, recomputed, still valid.
    small = LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=10, max_num_seqs=8)
    again = small.generate(constrained, [spec] * 4)
    assert small.engine.stats().num_preemptions > 0
    for o in mixed[4:] + again:
        assert o.outputs[0].finish_reason == "stop"
        assert set(json.loads(_text(llm, o.outputs[0]))) == {"a"}
    # Preemption changes nothing a seeded request draws.
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in mixed[4:]]


def test_resumed_tokens_go_through_the_grammar(llm):
    spec = {"choice": ["alpha", "beta"]}
    full = llm.generate({"prompt_token_ids": [9, 9]}, SamplingParams(temperature=0, max_tokens=50,
                                                                       structured_outputs=spec))[0].outputs[0]
    assert _text(llm, full) in ("alpha", "beta") and len(full.token_ids) > 1
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, structured_outputs=spec)
    rid = engine.add_request([9, 9], params, resume_token_ids=full.token_ids[:1])
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    assert full.token_ids[:1] + tokens == full.token_ids
    wrong = llm.tokenizer.encode("zzz", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="resume_token_ids do not follow"):
        engine.add_request([9, 9], params, resume_token_ids=wrong)
    assert not engine.has_unfinished()


def test_bad_specs_are_refused_by_name_and_the_engine_keeps_serving(llm):
    for spec, needle in [({"regex": "[a-"}, "structured_outputs.regex cannot be followed"),
                         ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "Unsatisfiable"),
                         ({"grammar": "start: nothing_here"}, "structured_outputs.grammar"),
                         ({"regex": "a", "choice": ["a"]}, "exactly one"),
                         ({"json": "[1, 2]"}, "JSON schema")]:
        with pytest.raises(InvalidRequestError, match=re.escape(needle)):
            llm.engine.add_request([1, 2], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished()
    out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    out = llm.generate({"prompt_token_ids": [4, 4]}, SamplingParams(
        temperature=1.0, seed=1, max_tokens=3, structured_outputs={"regex": "a{20}"}))[0].outputs[0]
    assert out.finish_reason == "length" and _text(llm, out) == "a" * len(_text(llm, out))


def test_mask_bias_unpacks_llguidance_bitmasks():
    """Both unpackings (numpy on the host, torch ops on a device, run here on the CPU) against the
    bitmask's definition, on random words and a vocabulary off a word boundary."""
    import torch

    from engine.structured import mask_bias

    words = torch.randint(-2**31, 2**31 - 1, (5, 40), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(5, 1270)
    want = logits.clone()
    for r, row in enumerate(words.tolist()):
        for t in range(1270):
            if not (row[t // 32] >> (t % 32)) & 1:  # bit t % 32 of word t // 32 (Python's >> keeps the sign)
                want[r, t] = float("-inf")
    for numpy in (True, False):
        assert torch.equal(logits + mask_bias(words, 1270, numpy=numpy), want)


def test_a_schema_object_keeps_its_key_order(llm):
    """The order a schema declares its properties in is the order they are generated in (models
    are asked for reasoning before answers): an object schema is not re-serialized sorted."""
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    for seed in range(2):
        o = llm.generate({"prompt_token_ids": [3, 1, seed]}, SamplingParams(
            temperature=1.0, seed=seed, max_tokens=200, structured_outputs={"json": schema}))[0].outputs[0]
        text = _text(llm, o)
        assert o.finish_reason == "stop" and list(json.loads(text)) == ["zeta", "alpha"], text


def test_without_a_usable_tokenizer_constrained_requests_are_refused(tmp_path):
    from tests.factories import make_model_dir

    bare = LLM(str(make_model_dir(tmp_path, "llama", seed=1, with_tokenizer=False)), dtype="float32",
               block_size=8, num_kv_blocks=64)
    for _ in range(2):  # the second is refused from the remembered reason
        with pytest.raises(InvalidRequestError, match="need the model's tokenizer"):
            bare.engine.add_request([1, 2], SamplingParams(structured_outputs={"regex": "a+"}))
    assert len(bare.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_schema_text_nested_past_the_parser_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="JSON schema"):
        SamplingParams(structured_outputs={"json": "[" * 100_000 + "]" * 100_000})
