"""Tool calling on the chat API: parsers, request checks, and the openai SDK against a real engine
(in one process, no Ray) whose forced calls always parse."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deployments.errors import BadRequest
from deployments.openai_protocol import parse_chat_body
from deployments.tools import ToolStream, parse_tool_calls
from tests.serving_helpers import frontend_over, real_replica, run

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "additionalProperties": False,
                                                            "required": ["city", "days"],
                                                            "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                                           "days": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "weather in Paris?"}]
DEEP = {"type": "object", "properties": {"a": {}}}
for _ in range(40):  # 120 levels: past the limit that keeps json.dumps and the template's tojson off
    DEEP = {"type": "object", "properties": {"a": DEEP}}  # the end of the Python stack
REFS = {"type": "function", "function": {"name": "book", "parameters": {  # as pydantic writes nested models
    "$defs": {"Day": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 28}},
                      "required": ["day"], "additionalProperties": False}},
    "type": "object", "properties": {"when": {"$ref": "#/$defs/Day"}}, "required": ["when"],
    "additionalProperties": False}}}


def test_hermes_and_llama3_replies_parse_into_calls():
    two = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
           '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    parsed = parse_tool_calls(two, "hermes")
    assert parsed.content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.calls)
    assert len(parse_tool_calls(two, "hermes", single=True).calls) == 1  # parallel_tool_calls: false
    for text in ("no call here", "<tool_call>{not json}</tool_call>", '<tool_call>{"name": 5}</tool_call>',
                 "<tool_call>" + " " * 100_000):  # never closed (a regex here took seconds on 2,000 spaces)
        assert parse_tool_calls(text, "hermes").calls == [] and parse_tool_calls(text, "hermes").content == text
    llama = parse_tool_calls('{"name": "get_time", "parameters": {"zone": "CET"}}', "llama3_json")
    assert llama.content is None and json.loads(llama.calls[0]["function"]["arguments"]) == {"zone": "CET"}
    assert parse_tool_calls("It is sunny.", "llama3_json").calls == []


def test_streamed_text_is_held_from_where_a_call_may_begin():
    stream = ToolStream("hermes")
    out = [stream.push(p) for p in ("Sure", ", one moment <to", "ol_call>\n{\"name\": \"get_time\", ",
                                    "\"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>")]
    assert out == ["Sure", ", one moment ", "", ""]
    parsed = stream.finish()
    assert parsed.content is None and parsed.calls[0]["function"]["name"] == "get_time"
    plain = ToolStream("hermes")
    assert [plain.push(p) for p in ("a <b", "> c <")] == ["a <b", "> c "] and plain.finish().content == "<"


@pytest.mark.parametrize("extra,param,needle", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "give one of them"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, "tools.0.function.parameters",
     "deeper than 64"),
    ({"tools": [WEATHER], "messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps(DEEP)}}]}]},
     "messages.1.tool_calls.0.function.arguments", "deeper than 64"),
])
def test_bad_tool_requests_name_the_field(extra, param, needle):
    with pytest.raises(BadRequest, match=needle) as info:
        parse_chat_body({"model": "m", "messages": USER, **extra})
    assert info.value.param == param or info.value.param.startswith(param)


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    return real_replica(tiny_model_dir)


def _frontend(replica, tiny_model_dir, tokenizer, parser: str = "hermes"):
    return frontend_over(replica, tiny_model_dir, tokenizer, tool_call_parser=parser)


@pytest.fixture(scope="module")
def frontend(replica, tiny_model_dir, tokenizer):
    return _frontend(replica, tiny_model_dir, tokenizer)


def _client(frontend):
    from deployments.openai_api import build_openai_app
    from tests.test_serving_frontend import _clients

    return _clients(build_openai_app(frontend))


def test_forced_calls_parse_stream_the_same_and_round_trip(frontend):
    async def main():
        client, http = _client(frontend)
        named = {"type": "function", "function": {"name": "get_weather"}}
        done = await client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                                    tool_choice=named, max_tokens=120, seed=5)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice=named, max_tokens=120, seed=5,
            stream=True)]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name,
                                                                               call.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        one = await client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                                   tool_choice="required", parallel_tool_calls=False,
                                                   max_tokens=120, seed=6)
        assert [c.function.name for c in one.choices[0].message.tool_calls] in (["get_weather"], ["get_time"])
        several = await client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                                       tool_choice="required", max_tokens=270, seed=7)
        calls = several.choices[0].message.tool_calls or []
        assert calls and {c.function.name for c in calls} <= {"get_weather", "get_time"}
        assert several.choices[0].finish_reason in ("tool_calls", "length")
        history = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
        answer = await client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, TIME],
                                                      tool_choice="none", max_tokens=6, temperature=0)
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"
        ref = await client.chat.completions.create(model="tiny", messages=USER, tools=[REFS], tool_choice="required",
                                                   max_tokens=100, seed=8)
        (booked,) = ref.choices[0].message.tool_calls
        jsonschema.validate(json.loads(booked.function.arguments), REFS["function"]["parameters"])
        auto = await client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=6)
        assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
        await http.aclose()
    run(main(), timeout_s=120)


def test_llama3_json_calls_are_forced_and_parsed(replica, tiny_model_dir, tokenizer):
    """The other parser: the whole reply is {"name", "parameters"}, streamed or not."""
    async def main():
        client, http = _client(_frontend(replica, tiny_model_dir, tokenizer, "llama3_json"))
        named = {"type": "function", "function": {"name": "get_time"}}
        done = await client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                                    tool_choice=named, max_tokens=60, seed=3)
        (call,) = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice=named, max_tokens=60, seed=3,
            stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        assert [d.function.arguments for c in chunks for d in c.choices[0].delta.tool_calls or ()] == [
            call.function.arguments]
        await http.aclose()
    run(main(), timeout_s=120)


def test_a_template_without_tools_gets_them_in_a_system_message(tokenizer):
    from engine.tokenizer import TOOL_PROMPT

    assert not tokenizer.renders_tools
    text = tokenizer.render_chat(USER, tools=[WEATHER])
    assert TOOL_PROMPT.split(":", 1)[0] in text and '"get_weather"' in text and text.index("<tools>") < text.index(
        USER[0]["content"])
    history = tokenizer.render_chat(USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}])
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in history
    answered = tokenizer.render_chat(USER + [{"role": "tool", "tool_call_id": "c1", "content": "12:00"}])
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>" in answered  # a user turn
