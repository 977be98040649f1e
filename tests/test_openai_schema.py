"""The OpenAPI document (deployments.openai_schema) describes what the OpenAI API reads and writes.

Over the in-process serving path (fake engines, no Ray): live responses, whole, streamed and
errors, validate against the documented schemas; a bounded schemathesis run draws requests from
the document, valid and not, and checks that none gets a server error, that every status, media
type and body is the documented one, and that every request the document calls invalid is
refused. (That every request it calls valid is served cannot hold: the vocabulary, the context
length and min_tokens <= max_tokens are per model or across fields, checked per request with a
400 naming the field.)
"""

from __future__ import annotations

import collections
import dataclasses
import json

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import checks
from schemathesis.core.result import Err
from schemathesis.generation.drivers import CoverageGenerator
from schemathesis.generation.feedback import FeedbackSources
from schemathesis.generation.overrides import Override

from deployments.openai_api import build_openai_app
from tests.serving_helpers import make_frontend, run

SERVED = "tiny"  # tests.serving_helpers' served model name


@pytest.fixture(scope="module")
def app(tokenizer):
    frontend, _ = make_frontend(tokenizer)
    return build_openai_app(frontend)


def _validator(doc: dict, component: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{component}",
                                            "components": doc["components"]})


def test_every_body_is_described(app):
    doc = app.openapi()
    for path, request, whole in (("/v1/completions", "CompletionRequest", "Completion"),
                                 ("/v1/chat/completions", "ChatRequest", "ChatCompletion")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{request}"}
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert {"400", "401", "404", "413", "429", "503"} <= set(op["responses"])
        props = doc["components"]["schemas"][request]["properties"]
        assert props["model"]["enum"] == [SERVED, "fake-model"]  # the served name, and what engines load
        # types and bounds come from SamplingParams: the same source as the check
        assert props["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 100}
        assert props["n"]["anyOf"] == [{"type": "integer", "minimum": 1, "maximum": 64}, {"type": "null"}]
        _validator(doc, request).check_schema(doc["components"]["schemas"][request])
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # FastAPI's 422: never sent


def _answers(tokenizer, requests: list[tuple[str, dict]]) -> list:
    """Each (path, body) POSTed in turn to a fresh app, in one event loop (the fake engines' own)."""
    import httpx2

    async def main():
        app = build_openai_app(make_frontend(tokenizer)[0])
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test") as http:
            return [await http.post(path, json=body) for path, body in requests]
    return run(main())


def _events(text: str) -> list:
    data = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_live_responses_are_the_documented_ones(app, tokenizer, chat):
    doc = app.openapi()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": SERVED, "max_tokens": 6, **({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                  "top_logprobs": 2} if chat else {"prompt": "hi", "logprobs": 2})}
    whole, stream, bad, unknown = _answers(tokenizer, [
        (path, body), (path, {**body, "stream": True, "stream_options": {"include_usage": True}}),
        (path, {**body, "temperature": -1}), (path, {**body, "model": "other"})])
    assert whole.status_code == 200
    _validator(doc, "ChatCompletion" if chat else "Completion").validate(whole.json())
    chunks = _events(stream.text)
    assert len(chunks) >= 3 and chunks[-1]["usage"]["completion_tokens"] == 6
    chunk = _validator(doc, "ChatCompletionChunk" if chat else "Completion")
    for c in chunks:
        chunk.validate(c)
    for answer, status in ((bad, 400), (unknown, 404)):
        assert answer.status_code == status and str(status) in doc["paths"][path]["post"]["responses"]
        _validator(doc, "ErrorBody").validate(answer.json())


@pytest.mark.parametrize("body,param", [
    ({"echo": 0}, "echo"),  # 0 == False in Python, but not a boolean
    ({"n": True}, "n"),
    ({"max_tokens": "many", "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 4}, "max_completion_tokens"),
])
def test_what_the_fuzzer_found_is_refused_by_name(tokenizer, body, param):
    chat = "max_completion_tokens" in body
    base = {"model": SERVED, **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    [answer] = _answers(tokenizer, [("/v1/chat/completions" if chat else "/v1/completions", {**base, **body})])
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_null_priority_is_the_default(tokenizer):
    [answer] = _answers(tokenizer, [("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 2,
                                                          "priority": None})])
    assert answer.status_code == 200


# ---------------------------------------------------------------- schemathesis, bounded
# Driven without schemathesis' pytest integration, which reads pytest internals (item._nodeid) that
# pytest 9.2 removed. Per operation, as that integration does: the coverage phase's cases (boundary
# values, wrong types, missing fields, other methods: most of the requests), then hypothesis draws
# from the operation's strategy in both generation modes. Every answer goes through CHECKS.
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.negative_data_rejection]
FUZZ_SETTINGS = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(HealthCheck),
                         phases=[p for p in Phase if p is not Phase.explain])  # as schemathesis sets it


@dataclasses.dataclass
class FuzzRun:
    statuses: collections.Counter  # (operation label, status code) -> answers
    failures: list  # the first failure of each operation and phase, with the operation in a note


def _coverage_cases(schema, operation):
    # CoverageGenerator: what schemathesis' pytest integration and its CLI engine both run
    generation = schema.config.generation_for(operation=operation, phase="coverage")
    return CoverageGenerator(operation=operation, generation_modes=generation.modes, generation_config=generation,
                             auth_storage=None, override=Override(), feedback=FeedbackSources())


def _phases(schema, operation, check) -> dict:
    """The coverage phase's cases as they come, then hypothesis' draws: one callable each."""
    def coverage():
        for case in _coverage_cases(schema, operation):
            check(case)
    modes = schema.config.generation_for(operation=operation, phase="fuzzing").modes
    fuzzing = FUZZ_SETTINGS(given(case=st.one_of([operation.as_strategy(generation_mode=m) for m in modes]))(check))
    return {"coverage": coverage, "fuzzing": fuzzing}


@pytest.fixture(scope="module")
def fuzz_run(tokenizer) -> FuzzRun:
    # No pause between fake engine steps: a valid request may ask for thousands of tokens.
    app = build_openai_app(make_frontend(tokenizer, step_delay_s=0)[0])
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    schema.config.generation.update(modes=list(schemathesis.GenerationMode))  # valid and invalid requests
    run_ = FuzzRun(collections.Counter(), [])

    def check(case):
        response = case.call_and_validate(checks=CHECKS)
        run_.statuses[case.operation.label, response.status_code] += 1

    for result in schema.get_all_operations():
        if isinstance(result, Err):  # an operation the document cannot describe
            run_.failures.append(result.err())
            continue
        operation = result.ok()
        for phase, run_phase in _phases(schema, operation, check).items():
            try:
                run_phase()
            # schemathesis' FailureGroup is a BaseExceptionGroup; each operation and phase is reported
            except (Exception, BaseExceptionGroup) as exc:
                exc.add_note(f"schemathesis {phase} phase of {operation.label}")
                run_.failures.append(exc)
    return run_


def test_fuzzed_requests_get_documented_answers(fuzz_run):
    if fuzz_run.failures:
        raise BaseExceptionGroup(f"{len(fuzz_run.failures)} operation phase(s) answered against the document",
                                 fuzz_run.failures)
    assert sum(fuzz_run.statuses.values()) > 100, fuzz_run.statuses  # the coverage phase ran


def test_the_fuzzer_reached_the_engine(fuzz_run):
    """Valid requests were served, not only refused."""
    statuses = fuzz_run.statuses
    assert statuses["POST /v1/completions", 200] > 0 and statuses["POST /v1/chat/completions", 200] > 0, statuses
