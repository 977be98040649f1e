"""Every validation error names its field, in both protocols, without Ray.

The hostile-input table (tests/hostile_cases.py) goes through the same parsing as the
served app, in process: OpenAI bodies through ``parse_*_body``, gRPC messages through
``generate_input``, then ``Frontend.prepare`` (tokenization, server limits, sampling).
The error's ``param`` (OpenAI's) is the field as pydantic locates it (``messages.0.role``),
and the message names that field and says what is allowed.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from google.protobuf.json_format import ParseDict

from deployments.errors import ServingError
from deployments.grpc_service import generate_input, proto_tools
from deployments.openai_protocol import parse_chat_body, parse_completion_body
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from engine.validation import field_errors
from tests.hostile_cases import CHAT, KINDS, Kind
from tests.hostile_service import ENGINE, MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS
from tests.serving_helpers import make_frontend, run

HTTP_KINDS = [k for k in KINDS if isinstance(k.http, tuple) and isinstance(k.http[1], dict)]
GRPC_KINDS = [k for k in KINDS if isinstance(k.grpc, dict)]


@pytest.fixture(scope="module")
def frontend(tokenizer):
    fe, _ = make_frontend(tokenizer, max_model_len=ENGINE["max_model_len"])
    fe.config = dataclasses.replace(fe.config, max_prompt_chars=MAX_PROMPT_CHARS, max_prompt_tokens=MAX_PROMPT_TOKENS)
    return fe


def _error(frontend, parse) -> ServingError:
    async def go():
        parsed = parse()
        await frontend.prepare(getattr(parsed, "input", parsed))

    with pytest.raises(ServingError) as info:
        run(go())
    return info.value


@pytest.mark.parametrize("kind", HTTP_KINDS, ids=[k.id for k in HTTP_KINDS])
def test_openai_errors_name_the_field(frontend, kind: Kind):
    path, body = kind.http
    body = json.loads(json.dumps(body))  # as the server reads it: NaN and lone surrogates survive JSON
    parse = parse_chat_body if path == CHAT else parse_completion_body
    err = _error(frontend, lambda: parse(body, kind.headers.get("x-request-id")))
    assert (err.http_status, err.param) == (kind.status, kind.param), err.message
    assert kind.param in err.message and kind.needles()[1] in err.message, err.message


@pytest.mark.parametrize("kind", GRPC_KINDS, ids=[k.id for k in GRPC_KINDS])
def test_grpc_errors_name_the_field(frontend, kind: Kind):
    msg = ParseDict(kind.grpc, pb.GenerateRequest())
    err = _error(frontend, lambda: generate_input(msg, proto_tools(msg, "hermes")))
    assert err.grpc_code == kind.code, err.message
    assert err.param is not None and err.param in err.message, err.message
    assert kind.needles()[0] in err.message, err.message


def test_nested_locations_become_dotted_params():
    with pytest.raises(ServingError) as info:
        parse_chat_body({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "robot"}],
                         "stream": True, "stream_options": {"include_usage": "yes"}})
    err = info.value
    # every problem is in the message; the first one is the param
    assert err.param == "stream_options.include_usage"
    assert "messages.1.role must be 'system', 'user'" in err.message and "got 'robot'" in err.message
    assert "stream_options.include_usage must be a valid boolean, got 'yes'" in err.message


def test_sampling_errors_keep_their_location():
    with pytest.raises(InvalidRequestError, match=r"^stop\.1 must not be empty"):
        SamplingParams(stop=["ok", ""])
    from pydantic import TypeAdapter, ValidationError

    with pytest.raises(ValidationError) as info:
        TypeAdapter(SamplingParams).validate_python({"top_p": 0, "stop_token_ids": [1, -2], "bogus": 1})
    params = [e.param for e in field_errors(info.value, SamplingParams)]
    assert params == ["top_p", "stop_token_ids.1", "bogus"]


def test_secret_values_are_never_shown():
    from deployments.app import AppConfig

    with pytest.raises(ValueError) as info:
        AppConfig.from_args({"api_keys": ["hunter2"]})
    assert "api_keys" in str(info.value) and "hunter2" not in str(info.value)
    with pytest.raises(ValueError) as info:
        AppConfig.from_args({"api_keys": "hunter2-is-long"})
    assert "api_keys must be a list" in str(info.value) and "hunter2" not in str(info.value)
