"""Anthropic's Messages API: the anthropic SDK against a real engine (one process, no Ray), its
conversations rendered as the same chat prompt, whole and streamed replies alike, tools, stop
sequences, token counts and errors in Anthropic's shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deployments.anthropic_protocol import parse_messages_body
from deployments.errors import BadRequest
from tests.serving_helpers import frontend_over, real_replica, run

import anthropic

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                            "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
USER = [{"role": "user", "content": "weather in Paris?"}]
GREEDY = {"temperature": 0}  # older clients' field: the newest SDKs leave sampling to the server


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    return real_replica(tiny_model_dir)


def _frontend(replica, tiny_model_dir, tokenizer, api_keys=()):
    return frontend_over(replica, tiny_model_dir, tokenizer, api_keys=tuple(api_keys))


def _client(frontend, api_key="none"):
    import httpx2

    from deployments.openai_api import build_openai_app

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_openai_app(frontend)), base_url="http://test")
    return anthropic.AsyncAnthropic(base_url="http://test", api_key=api_key, http_client=http, max_retries=0), http


def test_a_conversation_renders_as_the_chat_prompt_it_means(replica, tiny_model_dir, tokenizer):
    """System text, an assistant's tool_use and the user's tool_result become the chat messages an
    OpenAI client would send for the same conversation: one prompt, token for token."""
    fe = _frontend(replica, tiny_model_dir, tokenizer)
    turns = [{"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "in Oslo?"}]},
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "days": 2}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C"},
                                          {"type": "text", "text": "And tomorrow?"}]}]
    parsed = parse_messages_body({"model": "tiny", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
                                  "messages": turns, "tools": [WEATHER]})
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "4 C"}, {"role": "user", "content": "And tomorrow?"}]
    tools = [{"type": "function", "function": {k if k != "input_schema" else "parameters": v
                                               for k, v in WEATHER.items()}}]
    assert parsed.input.sampling == {"max_tokens": 5}
    assert fe.tokenize_messages(parsed.input.messages, parsed.input.tools) == fe.tokenize_messages(chat, tools)


@pytest.mark.parametrize("extra, param, needle", [
    ({"max_tokens": None}, "max_tokens", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type",
     "read text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "messages.0.content", "assistant messages"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice", "not among the tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type", "disabled"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
      "tool_choice": {"type": "any"}, "tools": [WEATHER]}, "tool_choice", "output_config.format"),
    ({"n": 2}, "n", "unknown field"),
])
def test_bad_bodies_name_the_field(extra, param, needle):
    body = {"model": "tiny", "max_tokens": 8, "messages": USER, **extra}
    with pytest.raises(BadRequest) as err:
        parse_messages_body({k: v for k, v in body.items() if v is not None})
    assert err.value.param == param and needle in err.value.message, err.value


def test_sdk_whole_and_streamed_replies_agree(replica, tiny_model_dir, tokenizer):
    async def main():
        fe = _frontend(replica, tiny_model_dir, tokenizer)
        client, http = _client(fe)
        counted = await client.messages.count_tokens(model="tiny", messages=USER, system="Be brief.")
        whole = await client.messages.create(model="tiny", messages=USER, system="Be brief.", max_tokens=12,
                                             extra_body=GREEDY)
        assert whole.role == "assistant" and whole.stop_reason == "max_tokens" and whole.model == "tiny"
        assert whole.usage.output_tokens == 12
        assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == counted.input_tokens
        (block,) = whole.content
        events = [e async for e in await client.messages.create(model="tiny", messages=USER, system="Be brief.",
                                                                 max_tokens=12, extra_body=GREEDY, stream=True)]
        kinds = [e.type for e in events]
        assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
            "content_block_stop", "message_delta", "message_stop"]
        assert set(kinds[2:-3]) == {"content_block_delta"}
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
        assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
        async with client.messages.stream(model="tiny", messages=USER, system="Be brief.", max_tokens=12,
                                          extra_body=GREEDY) as stream:
            final = await stream.get_final_message()
        assert [b.text for b in final.content] == [block.text] and final.usage.output_tokens == 12
        # The same prompt a third time: its blocks are read from the cache, and counted apart.
        assert final.usage.cache_read_input_tokens > 0
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted.input_tokens
        # A stop sequence from the reply itself: the reply ends before it, and says which.
        stop = block.text[len(block.text) // 2:][:3]
        assert stop.strip(), block.text
        cut = await client.messages.create(model="tiny", messages=USER, system="Be brief.", max_tokens=12,
                                           extra_body=GREEDY, stop_sequences=["\x00never", stop])
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
        assert cut.content[0].text == block.text[:block.text.index(stop)] if block.text.index(stop) else not cut.content
        await http.aclose()
    run(main(), timeout_s=120)


def test_sdk_tool_use_round_trip(replica, tiny_model_dir, tokenizer):
    async def main():
        client, http = _client(_frontend(replica, tiny_model_dir, tokenizer))
        choice = {"type": "tool", "name": "get_weather"}
        done = await client.messages.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice=choice,
                                            max_tokens=120, extra_body={"temperature": 1.0, "top_k": 50})
        assert done.stop_reason == "tool_use"
        (call,) = [b for b in done.content if b.type == "tool_use"]
        assert call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, WEATHER["input_schema"])
        async with client.messages.stream(model="tiny", messages=USER, tools=[WEATHER], tool_choice=choice,
                                          max_tokens=120) as stream:
            partial = [e.partial_json async for e in stream if e.type == "input_json"]
            streamed = await stream.get_final_message()
        (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
        assert streamed.stop_reason == "tool_use" and json.loads("".join(partial)) == streamed_call.input
        jsonschema.validate(streamed_call.input, WEATHER["input_schema"])
        history = USER + [{"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in done.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": [{"type": "text", "text": '{"temp_c": 21}'}]}]}]
        answer = await client.messages.create(model="tiny", messages=history, tools=[WEATHER],
                                              tool_choice={"type": "none"}, max_tokens=6, extra_body=GREEDY)
        assert answer.stop_reason == "max_tokens" and all(b.type == "text" for b in answer.content)
        fmt = {"type": "json_schema", "schema": WEATHER["input_schema"]}
        shaped = await client.messages.create(model="tiny", messages=USER, output_config={"format": fmt},
                                              max_tokens=200, extra_body=GREEDY)
        assert shaped.stop_reason == "end_turn", shaped.content
        jsonschema.validate(json.loads(shaped.content[0].text), WEATHER["input_schema"])
        await http.aclose()
    run(main(), timeout_s=120)


def test_errors_come_in_anthropic_shape(replica, tiny_model_dir, tokenizer):
    async def main():
        fe = _frontend(replica, tiny_model_dir, tokenizer, api_keys=("k1",))
        good, http = _client(fe, api_key="k1")
        bad, bad_http = _client(fe, api_key="wrong")
        with pytest.raises(anthropic.AuthenticationError) as err:
            await bad.messages.create(model="tiny", messages=USER, max_tokens=4)
        assert err.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.NotFoundError) as err:
            await good.messages.create(model="other", messages=USER, max_tokens=4)
        assert err.value.body["type"] == "error" and "other" in err.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            await good.messages.count_tokens(model="other", messages=USER)
        with pytest.raises(anthropic.BadRequestError) as err:
            await good.messages.create(model="tiny", messages=USER, max_tokens=4, extra_body={"temperature": -1})
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert "temperature" in err.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError) as err:
            await good.messages.create(model="tiny", messages=USER, max_tokens=20_000)  # past the context
        assert "max_tokens" in err.value.body["error"]["message"]
        bearer = anthropic.AsyncAnthropic(base_url="http://test", auth_token="k1", http_client=http, max_retries=0)
        assert (await bearer.messages.count_tokens(model="tiny", messages=USER)).input_tokens > 0
        await http.aclose()
        await bad_http.aclose()
    run(main(), timeout_s=120)
