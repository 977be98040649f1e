"""OpenAI's Responses API: the openai SDK against a real engine (one process, no Ray), its items
rendered as the same chat prompt, whole and streamed replies alike, tools, structured outputs,
stored conversations (``previous_response_id``) kept per tenant, and the store's bounds."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from deployments.errors import BadRequest
from deployments.responses_protocol import parse_responses_body, responses_input
from deployments.responses_store import ResponseNotFound, ResponseStore
from deployments.tenants import Tenant
from tests.serving_helpers import frontend_over, real_replica, run
from tests.test_serving_frontend import _clients
from tests.test_tool_calls import WEATHER

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API writes tools flat
USER = "weather in Paris?"


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    return real_replica(tiny_model_dir)


def _frontend(replica, tiny_model_dir, tokenizer, tenants=()):
    return frontend_over(replica, tiny_model_dir, tokenizer, tenants=tuple(tenants))


def _app(frontend):
    from deployments.openai_api import build_openai_app

    return build_openai_app(frontend)


def test_items_render_as_the_chat_prompt_they_mean(replica, tiny_model_dir, tokenizer):
    fe = _frontend(replica, tiny_model_dir, tokenizer)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather "},
                                          {"type": "input_text", "text": "in Oslo?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "4 C"},
             {"type": "function_call_output", "call_id": "call_2", "output": "9 C"},
             {"role": "developer", "content": "Answer in one line."}]
    req = parse_responses_body({"model": "tiny", "input": items, "instructions": "Be brief.", "tools": [TOOL],
                                "max_output_tokens": 7})
    parsed = responses_input(req, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}} for i, c in ((1, "Oslo"), (2, "Paris"))]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "9 C"},
            {"role": "system", "content": "Answer in one line."}]
    assert parsed.input.sampling == {"max_tokens": 7}
    assert parsed.conversation == chat[1:]  # what a follow-up continues from: no instructions
    assert fe.tokenize_messages(parsed.input.messages, parsed.input.tools) == fe.tokenize_messages(chat, [WEATHER])


@pytest.mark.parametrize("extra, param, needle", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type",
     "not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "required"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice", "not among the tools"),
    ({"background": True}, "background", "False"),
    ({"truncation": "auto"}, "truncation", "'disabled'"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "do not reason"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": 1.5}}}},
     "text.format.schema", "cannot be followed"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"seed": 1}, "seed", "unknown field"),
])
def test_bad_bodies_name_the_field(extra, param, needle):
    with pytest.raises(BadRequest) as err:
        parse_responses_body({"model": "tiny", "input": USER, **extra})
    assert err.value.param == param and needle in err.value.message, err.value


def test_sdk_whole_and_streamed_responses_agree(replica, tiny_model_dir, tokenizer):
    async def main():
        client, http = _clients(_app(_frontend(replica, tiny_model_dir, tokenizer)))
        whole = await client.responses.create(model="tiny", input=USER, instructions="Be brief.", max_output_tokens=12,
                                              temperature=0)
        assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert whole.usage.output_tokens == 12 and whole.output_text and whole.instructions == "Be brief."
        events = [e async for e in await client.responses.create(
            model="tiny", input=USER, instructions="Be brief.", max_output_tokens=12, temperature=0, stream=True)]
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.incomplete"]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
        streamed = events[-1].response
        assert streamed.output_text == whole.output_text and streamed.usage.output_tokens == 12
        assert streamed.usage.input_tokens == whole.usage.input_tokens
        assert streamed.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: read from the cache
        await http.aclose()
    run(main(), timeout_s=120)


def test_sdk_function_calls_and_structured_text(replica, tiny_model_dir, tokenizer):
    async def main():
        client, http = _clients(_app(_frontend(replica, tiny_model_dir, tokenizer)))
        named = {"type": "function", "name": "get_weather"}
        done = await client.responses.create(model="tiny", input=USER, tools=[TOOL], tool_choice=named,
                                             max_output_tokens=120, temperature=1.0)
        (call,) = done.output
        assert done.status == "completed" and call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
        async with client.responses.stream(model="tiny", input=USER, tools=[TOOL], tool_choice=named,
                                           max_output_tokens=120, temperature=0) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        (args,) = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert events[-1].type == "response.completed" and final.output[0].arguments == args
        jsonschema.validate(json.loads(args), TOOL["parameters"])
        answer = await client.responses.create(model="tiny", tools=[TOOL], tool_choice="none", max_output_tokens=6,
                                               input=[{"role": "user", "content": USER}, call.model_dump(),
                                                      {"type": "function_call_output", "call_id": call.call_id,
                                                       "output": '{"temp_c": 21}'}])
        assert all(item.type == "message" for item in answer.output)
        fmt = {"type": "json_schema", "name": "weather", "schema": TOOL["parameters"], "strict": True}
        shaped = await client.responses.create(model="tiny", input=USER, text={"format": fmt}, max_output_tokens=200,
                                               temperature=0)
        assert shaped.status == "completed" and shaped.text.format.type == "json_schema"
        jsonschema.validate(json.loads(shaped.output_text), TOOL["parameters"])
        await http.aclose()
    run(main(), timeout_s=120)


def test_stored_responses_continue_and_stay_with_their_tenant(replica, tiny_model_dir, tokenizer):
    async def main():
        tenants = [Tenant("a", ("key-a",)), Tenant("b", ("key-b",))]
        fe = _frontend(replica, tiny_model_dir, tokenizer, tenants)
        app = _app(fe)
        (a, http_a), (b, http_b) = _clients(app, "key-a"), _clients(app, "key-b")
        first = await a.responses.create(model="tiny", input="hi", instructions="Be brief.", max_output_tokens=5,
                                         temperature=0)
        follow = await a.responses.create(model="tiny", input="and then?", previous_response_id=first.id,
                                          max_output_tokens=5, temperature=0)
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "and then?"}]  # the earlier instructions are not carried over
        assert follow.usage.input_tokens == len(fe.tokenize_messages(chat))
        assert follow.previous_response_id == first.id
        assert (await a.responses.retrieve(first.id)).output_text == first.output_text
        for call in (b.responses.retrieve(first.id), b.responses.delete(first.id),
                     b.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)):
            with pytest.raises(openai.NotFoundError):  # another tenant's: as if it did not exist
                await call
        await a.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as err:
            await a.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)
        assert err.value.body["param"] == "previous_response_id"
        unstored = await a.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(unstored.id)
        await http_a.aclose()
        await http_b.aclose()
    run(main(), timeout_s=120)


def test_the_store_drops_its_oldest_past_its_bounds():
    def response(i: int, text: str = "") -> dict:
        return {"id": f"resp_{i}", "text": text}

    store = ResponseStore(max_responses=2, max_chars=400)
    for i in range(3):
        store.put(None, response(i), [])
    with pytest.raises(ResponseNotFound):
        store.get(None, "resp_0")
    store.get(None, "resp_1")  # used: now the newest
    store.put(None, response(3), [])
    with pytest.raises(ResponseNotFound):
        store.get(None, "resp_2")
    assert [store.get(None, f"resp_{i}").response["id"] for i in (1, 3)] == ["resp_1", "resp_3"]
    store.put(None, response(4, "x" * 300), [])  # leaves room for one other
    assert len(store) == 2 and store.get(None, "resp_4").response["text"] == "x" * 300
    store.put(None, response(5, "y" * 500), [])  # larger than the whole store: not kept, nothing dropped
    assert len(store) == 2
    with pytest.raises(ResponseNotFound):
        store.get("someone", "resp_4")
