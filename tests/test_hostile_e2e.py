"""Hostile input against the real served app: gRPC and the OpenAI API (over HTTPS), with API keys.

One module-scoped local Ray cluster (tests/hostile_service.py) serves every test; the table of
bad Generate inputs is tests/hostile_cases.py. Every kind must get its documented status and
an error that names the field, and none may cost the service anything: the last test checks
that normal requests still succeed and every engine holds zero KV blocks once idle.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket

import grpc
import httpx2
import pytest
from google.protobuf.json_format import ParseDict
from hypothesis import given, settings
from hypothesis import strategies as st
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deployments.openai_protocol import ChatRequest, CompletionRequest
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from tests.hostile_cases import CHAT, COMPLETIONS, KINDS, USER, Kind
from tests.hostile_service import ALLOWED_PRIORITY, GRPC_MAX_MESSAGE_BYTES, KEYS, MAX_BODY_BYTES, hostile_service
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    with hostile_service(tiny_model_dir, tmp_path_factory.mktemp("hostile")) as svc:
        yield svc


@pytest.mark.parametrize("kind", KINDS, ids=[k.id for k in KINDS])
def test_bad_generate_input_gets_the_documented_error(service, kind: Kind):
    grpc_needle, http_needle = kind.needles()
    if kind.grpc is not None:
        if isinstance(kind.grpc, bytes):
            call = service.raw_call("Generate", streaming=True)(kind.grpc, timeout=30, metadata=service.auth())
        else:
            call = service.stub.Generate(ParseDict(kind.grpc, pb.GenerateRequest()), timeout=30,
                                         metadata=service.auth())
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == getattr(grpc.StatusCode, kind.code), info.value.details()
        assert grpc_needle in info.value.details()
    if kind.http is not None:
        path, body = kind.http
        r = service.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                         headers=kind.headers)
        assert r.status_code == kind.status, r.text
        error = r.json()["error"]
        assert error["param"] == kind.param and http_needle in error["message"], error
        assert error["type"] and error["message"]


# Other RPCs, raw bytes where the stub would refuse to send them.
RPC_KINDS = [  # (id, method, request message or raw bytes, status code, text of the details)
    ("tokenize-no-input", "Tokenize", pb.TokenizeRequest(), "INVALID_ARGUMENT", "text"),
    ("tokenize-unknown-model", "Tokenize", pb.TokenizeRequest(model="gpt-4", text="hi"), "NOT_FOUND", "model"),
    ("tokenize-over-char-limit", "Tokenize", pb.TokenizeRequest(text="x" * 5000), "INVALID_ARGUMENT", "text"),
    ("tokenize-bad-role", "Tokenize", pb.TokenizeRequest(messages=pb.Messages(messages=[pb.ChatMessage(
        role="wizard", content="hi")])), "INVALID_ARGUMENT", "role"),
    ("tokenize-bad-utf8", "Tokenize", b"\x12\x01\xff", "INVALID_ARGUMENT", "UTF-8"),
    ("get-load-garbage", "GetLoad", b"\xff\xff", "INVALID_ARGUMENT", "slotserve.v1.GetLoadRequest"),
    ("get-model-info-garbage", "GetModelInfo", b"\x0b", "INVALID_ARGUMENT", "slotserve.v1.GetModelInfoRequest"),
    ("abort-empty-id", "Abort", pb.AbortRequest(), "INVALID_ARGUMENT", "request_id"),
    ("abort-garbage", "Abort", b"\x0a\x05ab", "INVALID_ARGUMENT", "slotserve.v1.AbortRequest"),
    ("message-over-grpc-limit", "Generate", pb.GenerateRequest(prompt="x" * (GRPC_MAX_MESSAGE_BYTES + 1)),
     "RESOURCE_EXHAUSTED", "larger than max"),
    ("unknown-method", "Frobnicate", b"", "UNIMPLEMENTED", ""),
]


@pytest.mark.parametrize("case", RPC_KINDS, ids=[c[0] for c in RPC_KINDS])
def test_bad_rpc_input_gets_the_documented_error(service, case):
    _, method, request, code, needle = case
    content = request if isinstance(request, bytes) else request.SerializeToString()
    streaming = method == "Generate"
    with pytest.raises(grpc.RpcError) as info:
        reply = service.raw_call(method, streaming)(content, timeout=30, metadata=service.auth())
        if streaming:
            list(reply)
    assert info.value.code() == getattr(grpc.StatusCode, code) and needle in info.value.details()


HTTP_ROUTE_KINDS = [  # (id, method, path, status, param)
    ("unknown-model-card", "GET", "/v1/models/gpt-4", 404, "model"),
    ("unknown-path", "POST", "/v1/audio/transcriptions", 404, None),
    ("wrong-method", "GET", "/v1/completions", 405, None),
]


@pytest.mark.parametrize("case", HTTP_ROUTE_KINDS, ids=[c[0] for c in HTTP_ROUTE_KINDS])
def test_bad_routes_get_openai_shaped_errors(service, case):
    _, method, path, status, param = case
    r = service.http.request(method, path, headers={"authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == status and r.json()["error"]["param"] == param and r.json()["error"]["message"], r.text


def test_oversized_body_is_refused_before_it_is_read(service):
    # Only the headers go out: the 413 must come back while the client still owes 1 GB.
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {KEYS[0]}\r\n"
            "content-type: application/json\r\ncontent-length: 1000000000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", service.http_port), timeout=30) as sock:
        with service.ssl_context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            tls.sendall(head)
            reply = b""
            while not reply.endswith(b"}"):  # the status line, then the JSON error body
                chunk = tls.recv(65536)
                if not chunk:
                    break
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"the limit is %d" % MAX_BODY_BYTES in reply
    # No content-length (chunked): refused once the bytes read pass the limit.
    chunks = (b" " * 8192 for _ in range(MAX_BODY_BYTES // 8192 + 2))
    r = service.post(COMPLETIONS, content=chunks)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_duplicate_client_request_ids_are_both_served(service):
    def grpc_one(_):
        return service.generate(prompt="same id", request_id="dup-1", sampling=pb.SamplingOptions(max_tokens=4))

    def http_one(_):
        return service.post(COMPLETIONS, {"model": "tiny", "prompt": "same id", "max_tokens": 4},
                            headers={"x-request-id": "dup-2"})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        grpc_outs = list(pool.map(grpc_one, range(2)))
        http_outs = list(pool.map(http_one, range(2)))
    assert all(out[-1].finish_reason and out[-1].client_request_id == "dup-1" for out in grpc_outs)
    assert grpc_outs[0][0].request_id != grpc_outs[1][0].request_id  # the server's ids stay distinct
    # one copy: Serve's proxy echoes it, and the ingress adds none of its own behind a proxy
    assert all(r.status_code == 200 and r.headers.get_list("x-request-id") == ["dup-2"] for r in http_outs)
    assert http_outs[0].json()["id"] != http_outs[1].json()["id"]


def test_tolerated_oddities_are_served(service):
    # Unknown protobuf fields are skipped (proto3 forward compatibility); the ends of allowed_priority.
    unknown_field = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=2)).SerializeToString()
    out = list(service.raw_call("Generate", streaming=True)(unknown_field + b"\xa0\x06\x01", timeout=30,
                                                            metadata=service.auth()))
    assert pb.GenerateResponse.FromString(out[-1]).finish_reason
    for priority in ALLOWED_PRIORITY:
        assert service.generate(prompt="hi", priority=priority, sampling=pb.SamplingOptions(max_tokens=2))[-1].usage
    # OpenAI fields without effect, and refused ones at their harmless values.
    body = {"model": "tiny", "prompt": ["hi"], "max_tokens": 2, "user": "u", "n": 1, "logit_bias": {}, "echo": False,
            "top_k": 2**62, "temperature": 1.0}
    assert service.post(COMPLETIONS, body).status_code == 200
    for i in range(3):  # every engine replica is asked, none knows it: found=false, at once
        assert service.stub.Abort(pb.AbortRequest(request_id=f"no-such-request-{i}"), timeout=10,
                                  metadata=service.auth()).found is False


# -- property-based: random bodies and sampling values never become a 500 / INTERNAL ------------

# Each example is a valid request with up to 3 fields set to a plausible or a hostile value, so
# that both outcomes (served, refused by name) come up often.
_LEAF = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
         | st.text(max_size=12))
_JSON = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)
_INT64, _DOUBLE = st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True)
_STOPS = st.lists(st.text(min_size=1, max_size=4), max_size=3)
_TOKEN_IDS = st.lists(st.integers(0, 400), min_size=1, max_size=8)
_SAMPLING = {  # name: (plausible, hostile)
    "temperature": (st.floats(0, 2), _DOUBLE), "top_p": (st.floats(0.05, 1), _DOUBLE),
    "min_p": (st.floats(0, 1), _DOUBLE), "repetition_penalty": (st.floats(0.5, 2), _DOUBLE),
    "presence_penalty": (st.floats(-2, 2), _DOUBLE), "frequency_penalty": (st.floats(-2, 2), _DOUBLE),
    "top_k": (st.integers(-1, 50), _INT64), "max_tokens": (st.integers(1, 6), _INT64),
    "min_tokens": (st.integers(0, 3), _INT64), "logprobs": (st.integers(0, 5), _INT64),
    "seed": (st.integers(0, 2**63 - 1), _INT64), "stop": (_STOPS, st.lists(st.text(max_size=300), max_size=18)),
    "stop_token_ids": (_TOKEN_IDS, st.lists(_INT64, max_size=66)), "ignore_eos": (st.booleans(), st.booleans()),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.booleans(), st.booleans())}
_BODY = {name: plausible for name, (plausible, _) in _SAMPLING.items()} | {
    "model": st.just("tiny"), "prompt": st.text(max_size=40) | _TOKEN_IDS, "stream": st.booleans(),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": st.text(max_size=20)}), min_size=1, max_size=3),
    "logprobs": st.booleans() | st.integers(0, 5), "top_logprobs": st.integers(0, 5), "n": st.just(1),
    "max_completion_tokens": st.integers(1, 6), "priority": st.integers(-5, 5), "user": st.text(max_size=8),
    "stream_options": st.just({"include_usage": True}), "echo": st.just(False), "logit_bias": st.just({})}


def _some(values: dict):
    """Up to 3 of ``values``' fields, each with a value from its strategy."""
    names = st.lists(st.sampled_from(sorted(values)), max_size=3, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({name: values[name] for name in chosen}))


def _body_fields(path):
    allowed = set((CompletionRequest if path == COMPLETIONS else ChatRequest).model_fields) | {"frobnicate", "prompt",
                                                                                             "messages"}
    return _some({name: (_BODY[name] | _JSON) if name in _BODY else _JSON for name in allowed})


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(path=st.sampled_from([COMPLETIONS, CHAT]), data=st.data())
def test_random_json_bodies_never_fail_the_server(service, path, data):
    base = {"model": "tiny", "max_tokens": 4, **({"prompt": "hi"} if path == COMPLETIONS else {"messages": USER})}
    body = {**base, **data.draw(_body_fields(path))}
    for name in ("max_tokens", "max_completion_tokens"):  # valid requests stay short
        if isinstance(body.get(name), int) and body[name] > 6:
            body[name] = 6
    r = service.post(path, content=json.dumps(body).encode())
    assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"], r.text


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(fields=_some({name: plausible | hostile for name, (plausible, hostile) in _SAMPLING.items()}))
def test_random_sampling_options_are_served_or_refused_by_name(service, fields):
    if fields.get("max_tokens", 0) > 6:
        fields["max_tokens"] = 6
    try:
        out = service.generate(prompt="hi", sampling=pb.SamplingOptions(**fields), timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, exc.code(), exc.details())
        assert any(name in exc.details() for name in fields), (fields, exc.details())
    else:
        assert out[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


# -- API keys and health probes --------------------------------------------------------------

def _grpc_calls(service):
    s = service.stub
    return {"Generate": lambda md: list(s.Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(
                max_tokens=2)), timeout=30, metadata=md)),
            "Abort": lambda md: s.Abort(pb.AbortRequest(request_id="x"), timeout=30, metadata=md),
            "Tokenize": lambda md: s.Tokenize(pb.TokenizeRequest(text="hi"), timeout=30, metadata=md),
            "GetModelInfo": lambda md: s.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=md),
            "Embed": lambda md: s.Embed(pb.EmbedRequest(text="hi"), timeout=30, metadata=md),
            "GetLoad": lambda md: s.GetLoad(pb.GetLoadRequest(), timeout=30, metadata=md),
            "Generate-garbage": lambda md: list(service.raw_call("Generate", True)(b"\xff", timeout=30,
                                                                                   metadata=md))}


ROUTES = [("POST", COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
          ("POST", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
          ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, "store": False}),
          ("POST", "/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
          ("POST", "/v1/embeddings", {"model": "tiny", "input": "hi"}),
          ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None), ("GET", "/load", None)]
BAD_AUTH = {"none": None, "wrong-key": "Bearer key-wrong-00000000", "scheme-only": "Bearer",
            "other-scheme": f"Basic {KEYS[0]}", "key-prefix": f"Bearer {KEYS[0][:-1]}"}


def _http_call(service, method, path, body, authorization):
    headers = {} if authorization is None else {"authorization": authorization}
    return service.http.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("auth", BAD_AUTH, ids=list(BAD_AUTH))
def test_every_rpc_and_route_refuses_a_missing_or_bad_key(service, auth):
    md = [] if BAD_AUTH[auth] is None else [("authorization", BAD_AUTH[auth])]
    for name, call in _grpc_calls(service).items():
        with pytest.raises(grpc.RpcError) as info:
            call(md)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details(), name
    for method, path, body in ROUTES:
        r = _http_call(service, method, path, body, BAD_AUTH[auth])
        error = r.json()["error"]  # OpenAI's shape, or Anthropic's on /v1/messages
        kind = error["type"] if path == "/v1/messages" else error["code"]
        assert r.status_code == 401 and kind in ("invalid_api_key", "authentication_error"), (path, r.text)


def _accepted(service, key: str) -> bool:
    """Whether every RPC and route takes ``key``."""
    calls = _grpc_calls(service)
    calls.pop("Generate-garbage")
    for call in calls.values():
        try:
            call([("authorization", f"Bearer {key}")])
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc.details()
            return False
    return all(_http_call(service, m, p, b, f"Bearer {key}").status_code == 200 for m, p, b in ROUTES)


def test_each_key_in_the_file_is_accepted_and_health_needs_none(service):
    assert all(_accepted(service, key) for key in KEYS)
    assert _http_call(service, "GET", "/v1/models", None, KEYS[1]).status_code == 200  # a bare key works too
    health = health_pb2_grpc.HealthStub(service.channel)  # Kubernetes' probes send no keys
    for name in ("", "slotserve.v1.SlotServe"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert service.http.get("/health").status_code == 200 and service.http.get("/-/healthz").status_code == 200


def test_rotated_keys_file_applies_without_restart(service):
    original = service.keys_file.read_text()
    new_key = "key-charlie-0000003"
    try:
        service.keys_file.write_text(new_key + "\n")  # the replica re-reads it at most once a second
        wait_until(lambda: _http_call(service, "GET", "/v1/models", None, f"Bearer {new_key}").status_code == 200,
                   "the new key accepted", timeout_s=15, poll_s=0.2)
        assert _accepted(service, new_key) and not _accepted(service, KEYS[0])
        service.keys_file.write_text("# every key revoked\n")  # an empty file refuses all, never opens the door
        wait_until(lambda: not _accepted(service, new_key), "the revoked key refused", timeout_s=15, poll_s=0.2)
        assert _http_call(service, "GET", "/v1/models", None, None).status_code == 401
    finally:
        service.keys_file.write_text(original)
        wait_until(lambda: _accepted(service, KEYS[0]), "the original keys back", timeout_s=15, poll_s=0.2)


# -- TLS ------------------------------------------------------------------------------------

def test_openai_client_over_https_and_plain_http_fails(service):
    client = service.openai()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 4
    stream = client.completions.create(model="tiny", prompt="hi", max_tokens=4, stream=True)
    assert [c.choices[0].finish_reason for c in stream][-1] in ("stop", "length")
    with pytest.raises(httpx2.TransportError):
        with httpx2.Client(trust_env=False, timeout=10) as plain:
            plain.get(f"http://127.0.0.1:{service.http_port}/v1/models",
                      headers={"authorization": f"Bearer {KEYS[0]}"})


# -- last: the battery cost the service nothing ---------------------------------------------

def test_after_the_battery_the_service_serves_and_frees_every_kv_block(service):
    out = service.generate(prompt="still here", sampling=pb.SamplingOptions(max_tokens=4, temperature=0))
    assert out[-1].usage.completion_tokens >= 1
    r = service.post(CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"

    def idle():
        replicas = service.replicas()
        return len(replicas) == 2 and all(r.healthy and r.running == r.waiting == r.kv_blocks_used == 0
                                          for r in replicas)

    wait_until(idle, "every engine idle with zero KV blocks used", timeout_s=20, poll_s=0.2)
