"""End to end on a local Ray: one Serve app (ingress + 2 replicas of the real engine on a
tiny random Llama), reached over gRPC (Serve's proxy) and the OpenAI HTTP API.

One module-scoped cluster and app serve every test here; tests leave it idle.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from tests.factories import make_lora_dir
from tests.hostile_cases import KINDS
from tests.ray_cluster import Service, served_app
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_waiting": 4, "block_size": 16,
          "num_kv_blocks": 256, "max_model_len": 1024}
PROMPTS = ["hello world", "the quick brown fox jumps"]
MAX_TOKENS = 24
MAX_PROMPT_TOKENS = 800  # room for the tool prompt a template without tools gets (~600 tokens here)


@pytest.fixture(scope="module")
def lora(tiny_model_dir, tmp_path_factory):  # one LoRA adapter, served as model "alpha"
    path = make_lora_dir(tiny_model_dir, tmp_path_factory.mktemp("e2e-lora") / "alpha", rank=4, scale=1.0)
    return {"adapters": {"alpha": str(path)}, "max_loras": 1, "max_lora_rank": 4}


@pytest.fixture(scope="module", params=["haproxy", "proxy"])
def service(request, tiny_model_dir, tmp_path_factory, lora):
    """Clients reach the ingress through Serve's proxy or HAProxy (deployments.ingress_env); the
    ingress reaches the engines over engine links (deployments.link), with mutual TLS behind HAProxy."""
    from deployments.ingress_env import ingress_env
    from tests.test_link_tls import link_certificates

    app = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine": {**ENGINE, "lora": lora},
           "num_replicas": 2,
           "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25},
           "max_prompt_tokens": MAX_PROMPT_TOKENS, "drain_timeout_s": 2}
    if request.param == "haproxy":
        tls = link_certificates(tmp_path_factory.mktemp("link-tls"), "app")
        app["engine_link_tls"] = {"certfile": tls.certfile, "keyfile": tls.keyfile, "cafile": tls.cafile}
    with served_app(app, env=ingress_env(request.param, local=True)) as ports:
        svc = Service(ports.http, ports.grpc)
        svc.mode = request.param
        yield svc
        svc.channel.close()


ONE_MODE = pytest.mark.parametrize("service", ["haproxy"], indirect=True)
"""For what the ingress and engines do alike whatever takes the client ports: the default mode
only. It stays the fixture's first param: pytest groups tests by param index, and a test given
another index would start a third service."""


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """Greedy outputs of the offline LLM API: what the service must reproduce."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(str(tiny_model_dir), **{**ENGINE, "max_waiting": 16})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat_ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    outs = llm.generate(PROMPTS + [{"prompt_token_ids": chat_ids}], params)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


def test_grpc_stream_matches_offline_llm(service, offline):
    for prompt, (text, ids) in zip(PROMPTS, offline):
        out = service.generate(prompt=prompt, sampling=pb.SamplingOptions(temperature=0, max_tokens=MAX_TOKENS))
        assert "".join(m.text for m in out) == text
        assert [t for m in out for t in m.token_ids] == ids
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH and out[-1].usage.completion_tokens == MAX_TOKENS
        assert len(out) > 1 and all(m.request_id == out[0].request_id for m in out)


def test_openai_client_matches_offline_llm(service, offline):
    client = service.openai()
    assert [(m.id, m.parent) for m in client.models.list().data] == [("tiny", None), ("alpha", "tiny")]
    text = offline[1][0]
    done = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].text == text and done.usage.completion_tokens == MAX_TOKENS
    stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == text
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == offline[2][0]
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline[2][0]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_anthropic_and_responses_clients_match_offline_llm(service, offline):
    """Server-sent events with named types (``event:`` lines) pass Serve's proxy and HAProxy alike."""
    client, messages, greedy = service.anthropic(), [{"role": "user", "content": PROMPTS[0]}], {"temperature": 0}
    whole = client.messages.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, extra_body=greedy)
    assert [b.text for b in whole.content] == [offline[2][0]] and whole.stop_reason == "max_tokens"
    with client.messages.stream(model="tiny", messages=messages, max_tokens=MAX_TOKENS, extra_body=greedy) as stream:
        assert "".join(stream.text_stream) == offline[2][0]
        assert stream.get_final_message().usage.output_tokens == MAX_TOKENS
    client = service.openai()
    whole = client.responses.create(model="tiny", input=PROMPTS[0], max_output_tokens=MAX_TOKENS, temperature=0)
    events = list(client.responses.create(model="tiny", input=PROMPTS[0], max_output_tokens=MAX_TOKENS,
                                          temperature=0, stream=True))
    assert whole.output_text == offline[2][0] == events[-1].response.output_text
    assert client.responses.retrieve(whole.id).output_text == offline[2][0]


@ONE_MODE
def test_agents_apis_and_embeddings_through_the_served_app(service, tiny_model_dir):
    """A forced call and its result's round trip on both agent APIs, a stored conversation
    continued, Anthropic's token count, and embeddings of a batch equal to its items one by one
    and to the offline engine's."""
    from engine import LLM
    from tests.test_anthropic_messages import USER as A_USER, WEATHER as A_WEATHER
    from tests.test_responses_api import TOOL

    anthropic, openai = service.anthropic(), service.openai()
    done = anthropic.messages.create(model="tiny", messages=A_USER, tools=[A_WEATHER], max_tokens=120,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = [b for b in done.content if b.type == "tool_use"]
    assert done.stop_reason == "tool_use" and set(call.input) == {"city", "days"}
    history = A_USER + [{"role": "assistant", "content": done.content},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "4 C"}]}]
    counted = anthropic.messages.count_tokens(model="tiny", messages=history, tools=[A_WEATHER]).input_tokens
    answer = anthropic.messages.create(model="tiny", messages=history, tools=[A_WEATHER], max_tokens=4)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
    first = openai.responses.create(model="tiny", input="weather in Paris?", tools=[TOOL], max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_weather"})
    (fc,) = first.output
    follow = openai.responses.create(model="tiny", previous_response_id=first.id, tools=[TOOL], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "4 C"}])
    assert fc.type == "function_call" and follow.previous_response_id == first.id and follow.output
    texts = ["hello world", "the quick brown fox jumps", "a"]
    batch = [d.embedding for d in openai.embeddings.create(model="tiny", input=texts).data]
    one_by_one = [openai.embeddings.create(model="tiny", input=t).data[0].embedding for t in texts]
    reference = LLM(str(tiny_model_dir), **ENGINE).embed(texts)
    for a, b, c in zip(batch, one_by_one, reference):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5 and max(abs(x - y) for x, y in zip(a, c)) < 1e-5


@ONE_MODE
def test_a_lora_adapter_by_model_name_over_both_protocols(service, tiny_model_dir, lora):
    from engine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = LLM(str(tiny_model_dir), **ENGINE, lora=lora).generate(PROMPTS[1], greedy, lora="alpha")[0].outputs[0]
    out = service.generate(model="alpha", prompt=PROMPTS[1], sampling=pb.SamplingOptions(temperature=0,
                                                                                         max_tokens=MAX_TOKENS))
    assert [t for m in out for t in m.token_ids] == list(want.token_ids)
    done = service.openai().completions.create(model="alpha", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].text == want.text
    assert list(service.stub.GetModelInfo(pb.GetModelInfoRequest()).lora_adapters) == ["alpha"]
    # GetLoad shows where it sits and what loading it cost (the stats lag by a routing period).
    deadline = time.monotonic() + 10
    while not any("alpha" in r.lora_loaded for r in service.stub.GetLoad(pb.GetLoadRequest()).replicas):
        assert time.monotonic() < deadline, "no replica reports the adapter in a slot"
        time.sleep(0.2)
    replicas = service.stub.GetLoad(pb.GetLoadRequest()).replicas
    assert sum(r.lora_loads for r in replicas) >= 1


@ONE_MODE
def test_logit_bias_over_both_protocols_matches_the_offline_llm(service, tiny_model_dir):
    """A ban on the greedy first token and a boost of another: the served tokens are the offline
    engine's with the same bias, over gRPC and over the OpenAI SDK (string keys, as OpenAI's)."""
    from engine import LLM, SamplingParams

    greedy = [t for m in service.generate(prompt=PROMPTS[1], sampling=pb.SamplingOptions(
        temperature=0, max_tokens=6, ignore_eos=True)) for t in m.token_ids]
    bias = {greedy[0]: -100.0, greedy[2]: 4.0}
    llm = LLM(str(tiny_model_dir), **ENGINE)
    want = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias=bias))[0].outputs[0]
    assert want.token_ids[0] != greedy[0]
    out = service.generate(prompt=PROMPTS[1], sampling=pb.SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True,
                                                                          logit_bias=bias))
    assert [t for m in out for t in m.token_ids] == list(want.token_ids)
    done = service.openai().completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                               logit_bias={str(t): v for t, v in bias.items()},
                                               extra_body={"ignore_eos": True})
    assert done.choices[0].text == want.text and done.usage.completion_tokens == 6


@ONE_MODE
def test_structured_outputs_over_both_protocols(service, capsys):
    """The openai SDK's ``parse`` with a pydantic model, a streamed json_schema, vLLM's ``structured_outputs``
    over HTTP, and gRPC (the message and the CLI): every output follows its constraint."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pick(BaseModel):
        color: Literal["red", "green", "blue"]
        count: int = Field(ge=0, le=9)

    client = service.openai()
    messages = [{"role": "user", "content": "pick one"}]
    done = client.chat.completions.parse(model="tiny", messages=messages, response_format=Pick, max_tokens=200,
                                         seed=1)
    assert isinstance(done.choices[0].message.parsed, Pick)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, seed=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}})
    assert set(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices))) == {"ok"}
    picked = client.completions.create(model="tiny", prompt="x", max_tokens=50, seed=3,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert picked.choices[0].text in ("left", "right") and picked.choices[0].finish_reason == "stop"
    out = service.generate(prompt="x", sampling=pb.SamplingOptions(
        max_tokens=50, seed=4, structured_outputs=pb.StructuredOutputs(regex="[a-f]{4}")))
    assert len("".join(m.text for m in out)) == 4 and out[-1].finish_reason == pb.FINISH_REASON_STOP
    from deployments.cli import main

    assert main(["generate", "--target", f"127.0.0.1:{service.grpc_port}", "--max-tokens", "50",
                 "--choice", "up", "--choice", "down", "x"]) == 0
    assert capsys.readouterr().out.strip() in ("up", "down")


@ONE_MODE
def test_n_choices_streamed_over_engine_links_match_the_offline_llm(service, tiny_model_dir):
    from engine import LLM, SamplingParams

    [want] = LLM(str(tiny_model_dir), **ENGINE).generate(PROMPTS[1], SamplingParams(
        n=3, seed=8, temperature=1.0, max_tokens=6, ignore_eos=True))
    texts = {0: "", 1: "", 2: ""}
    for c in service.openai().completions.create(model="tiny", prompt=PROMPTS[1], n=3, seed=8, max_tokens=6,
                                                 stream=True, extra_body={"ignore_eos": True}):
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {o.index: o.text for o in want.outputs}


@ONE_MODE
def test_a_forced_tool_call_through_the_served_app(service):
    from tests.test_tool_calls import USER, WEATHER

    done = service.openai().chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, seed=5)
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city", "days"}
    tool = pb.Tool(name="get_weather", parameters_json=json.dumps(WEATHER["function"]["parameters"]))
    out = service.generate(messages=pb.Messages(messages=[pb.ChatMessage(**m) for m in USER]), tools=[tool],
                           tool_choice="get_weather", sampling=pb.SamplingOptions(max_tokens=120, seed=5))
    (grpc_call,) = out[-1].tool_calls
    assert out[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS and "".join(m.text for m in out) == ""
    assert grpc_call.name == "get_weather" and set(json.loads(grpc_call.arguments_json)) == {"city", "days"}


@ONE_MODE
def test_load_spreads_and_prefers_the_cached_prefix(service):
    before = {r.replica_id: r.num_finished for r in service.replicas()}
    assert len(before) == 2

    def one(i):
        return service.generate(prompt_token_ids=pb.TokenIds(ids=[5 + i, 7, 9, 11]),
                                sampling=pb.SamplingOptions(temperature=0, max_tokens=48, ignore_eos=True))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert all(out[-1].finish_reason == pb.FINISH_REASON_LENGTH for out in pool.map(one, range(6)))
    after = {r.replica_id: r.num_finished for r in service.replicas()}
    assert all(after[rid] > before[rid] for rid in before), (before, after)

    # A 96-token prefix (6 blocks) lands on one replica; later requests sharing it follow it.
    prefix = [(i * 37 + 11) % 300 + 3 for i in range(96)]
    service.generate(prompt_token_ids=pb.TokenIds(ids=prefix + [1]), sampling=pb.SamplingOptions(max_tokens=2))
    # The digest reaches the router within ~1.25 s (engine refresh every 0.5 s when idle, then the
    # next 0.5 s routing-stats poll); 3 s leaves room for a loaded host.
    time.sleep(3.0)
    hits = {r.replica_id: r.prefix_cache_hits for r in service.replicas()}
    for i in range(4):
        service.generate(prompt_token_ids=pb.TokenIds(ids=prefix + [20 + i, 4]),
                         sampling=pb.SamplingOptions(max_tokens=2))
    gained = {r.replica_id: r.prefix_cache_hits - hits[r.replica_id] for r in service.replicas()}
    assert sorted(gained.values()) == [0, 4 * 96], gained


def test_ray_processes_inherit_the_serve_env(service):
    import ray

    from deployments.app import SERVE_ENV

    @ray.remote(num_cpus=0)
    def seen() -> tuple[dict[str, str | None], set]:
        import os

        columns = {pos[2] for pos in seen_columns.__code__.co_positions()}  # None: no column tables
        return {k: os.environ.get(k) for k in SERVE_ENV}, columns

    def seen_columns():
        return 1 + 1

    env, columns = ray.get(seen.remote(), timeout=60)
    assert env == SERVE_ENV and columns == {None}


def test_requests_reach_the_engines_over_links(service):
    import ray

    from tests.ray_cluster import APP

    prefix = f"SERVE_REPLICA::{APP}#EngineReplica#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]

    def stats():
        return [ray.get(ray.get_actor(n, namespace="serve").record_routing_stats.remote(), timeout=30) for n in names]

    before = stats()
    assert len(before) == 2 and all(s["link"].rsplit(":", 1)[1].isdigit() for s in before)
    for i in range(4):
        service.generate(prompt_token_ids=pb.TokenIds(ids=[9, 8 + i]), sampling=pb.SamplingOptions(max_tokens=2))
    assert sum(s["link_requests"] for s in stats()) - sum(s["link_requests"] for s in before) == 4


def test_the_client_ports_belong_to_the_modes_listener(service):
    import psutil

    owners = {c.laddr.port: c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    expected = {"proxy": "ray::ProxyActor", "haproxy": "haproxy"}
    for port in (service.grpc_port, service.http_port):
        command = " ".join(psutil.Process(owners[port]).cmdline())
        assert expected[service.mode] in command, (service.mode, port, command)


def test_cancelled_stream_and_deadlines_free_the_slot(service):
    call = service.stub.Generate(pb.GenerateRequest(prompt="hello", sampling=pb.SamplingOptions(
        max_tokens=400, ignore_eos=True)), timeout=60)
    next(call)
    assert sum(r.running for r in service.replicas()) == 1
    call.cancel()
    service.wait_idle()
    with pytest.raises(grpc.RpcError) as info:  # the client's deadline
        service.generate(timeout=0.3, prompt="hello", sampling=pb.SamplingOptions(max_tokens=400, ignore_eos=True))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    service.wait_idle()
    with pytest.raises(grpc.RpcError) as info:  # the server-side one
        service.generate(timeout_s=0.3, prompt="hello", sampling=pb.SamplingOptions(max_tokens=400, ignore_eos=True))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline of 0.3 s" in info.value.details()
    service.wait_idle()


# What each listener must pass through unchanged: a body it cannot parse, bad UTF-8, a 404 and
# field errors. Every kind, with its field names, is tests/test_hostile_e2e.py's (one listener).
LISTENER_KINDS = [k for k in KINDS if k.id in {"garbage-bytes", "bad-utf8-prompt", "unknown-model",
                                               "temperature-negative", "token-id-out-of-vocab"}]


@pytest.mark.parametrize("kind", LISTENER_KINDS, ids=[k.id for k in LISTENER_KINDS])
def test_bad_input_gets_a_clear_error_on_both_protocols(service, kind):
    import httpx2
    from google.protobuf.json_format import ParseDict

    if isinstance(kind.grpc, bytes):
        raw_call = service.channel.unary_stream("/slotserve.v1.SlotServe/Generate", request_serializer=None,
                                                response_deserializer=pb.GenerateResponse.FromString)
        call = raw_call(kind.grpc, timeout=30)
    else:
        call = service.stub.Generate(ParseDict(kind.grpc, pb.GenerateRequest()), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    grpc_needle, http_needle = kind.needles()
    assert info.value.code() == getattr(grpc.StatusCode, kind.code) and grpc_needle in info.value.details()
    path, body = kind.http
    r = httpx2.post(service.base_url.removesuffix("/v1") + path, headers={"content-type": "application/json"},
                    content=body if isinstance(body, bytes) else json.dumps(body).encode(), timeout=30)
    assert r.status_code == kind.status and http_needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == kind.param


def test_overload_is_refused_and_the_service_keeps_serving(service):
    import openai

    def grpc_one(i):
        try:
            service.generate(prompt=f"load {i}", sampling=pb.SamplingOptions(max_tokens=80, ignore_eos=True))
            return "ok"
        except grpc.RpcError as exc:
            return exc.code().name

    def http_one(i):
        try:
            service.openai().completions.create(model="tiny", prompt=f"load {i}", max_tokens=80,
                                                extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError:
            return "429"

    # 2 replicas x (4 slots + 4 waiting) = 16 places for 32 requests at once
    for one, refused in ((grpc_one, "RESOURCE_EXHAUSTED"), (http_one, "429")):
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32)))
        assert refused in results and "ok" in results and set(results) == {refused, "ok"}, results
        service.wait_idle()
    assert service.generate(prompt="still here", sampling=pb.SamplingOptions(max_tokens=4))[-1].usage


def test_health_info_tokenize_and_cli(service, offline, capsys):
    health = health_pb2_grpc.HealthStub(service.channel)

    def status(name: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status

    assert status("") == health_pb2.HealthCheckResponse.SERVING
    # The engine service turns SERVING once the ingress has seen a healthy replica's load report (first in
    # the module when this test runs alone).
    wait_until(lambda: status("slotserve.v1.SlotServe") == health_pb2.HealthCheckResponse.SERVING,
               "the engine service's health to be SERVING")
    info = service.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.served_model_name, info.max_model_len, info.max_prompt_tokens) == ("tiny", 1024, MAX_PROMPT_TOKENS)
    assert info.quantization == "none"
    tok = service.stub.Tokenize(pb.TokenizeRequest(text=PROMPTS[0]), timeout=10)
    assert tok.count == len(tok.token_ids) > 0
    load = service.stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert len(load.replicas) == 2 and load.total_slots == 8 and all(r.healthy for r in load.replicas)
    # Server reflection (grpcurl without the .proto, as the chart's NOTES show) on every ingress.
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(reflection_pb2_grpc.ServerReflectionStub(service.channel).ServerReflectionInfo(iter([ask]),
                                                                                                timeout=10))
    assert "slotserve.v1.SlotServe" in [s.name for s in reply.list_services_response.service]

    from deployments.cli import main

    assert main(["generate", "--target", f"127.0.0.1:{service.grpc_port}", "--max-tokens", str(MAX_TOKENS),
                 PROMPTS[0]]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == offline[0][0].rstrip("\n") and "24 completion tokens" in out.err
    assert main(["generate", "--target", f"127.0.0.1:{service.grpc_port}", "--n", "2", "--max-tokens", "3", "x"]) == 0
    assert capsys.readouterr().out.count("--- choice ") == 2  # each choice whole


def test_an_oversized_body_from_a_plain_client_gets_a_413_it_can_read(service):
    """40 MB to a limit of 8 MiB with Python's urllib, which sends the whole body before it reads:
    the server must read past the limit (and drop it) or the client sees a reset, not the 413."""
    import urllib.error
    import urllib.request

    body = b'{"model": "tiny", "prompt": "' + b"x" * (40 << 20) + b'"}'
    request = urllib.request.Request(f"{service.base_url}/completions", data=body,
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 413
    assert "the limit is" in json.loads(refused.value.read())["error"]["message"]
    assert service.generate(prompt="still here", sampling=pb.SamplingOptions(max_tokens=2))[-1].usage


def test_a_grpc_message_over_8_mib_is_refused_before_the_ingress(service):
    with pytest.raises(grpc.RpcError) as refused:
        service.generate(prompt="x" * (9 << 20), sampling=pb.SamplingOptions(max_tokens=2))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert service.generate(prompt="still here", sampling=pb.SamplingOptions(max_tokens=2))[-1].usage


def test_a_response_carries_one_request_id_the_clients_or_one_made_for_it(service):
    import httpx2

    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    mine = httpx2.post(f"{service.base_url}/completions", json=body, headers={"x-request-id": "client-7"}, timeout=60)
    assert mine.status_code == 200 and mine.headers.get_list("x-request-id") == ["client-7"]
    made = httpx2.post(f"{service.base_url}/completions", json=body, timeout=60)
    assert made.status_code == 200 and len(made.headers.get_list("x-request-id")) == 1


def test_a_restarted_ingress_serves_on_the_same_ports(service):
    """Last here: it kills the Router replica. With HAProxy, HAProxy must follow the new replica's
    own ports; with Serve's proxy, the proxy must route to the new replica."""
    import ray

    from tests.ray_cluster import APP

    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{APP}#Router#"))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    deadline, last = time.monotonic() + 90, None
    while time.monotonic() < deadline:
        try:
            assert service.generate(timeout=10, prompt="back", sampling=pb.SamplingOptions(max_tokens=4))[-1].usage
            return
        except grpc.RpcError as exc:
            last = exc
            time.sleep(0.5)
    raise AssertionError(f"no answer on port {service.grpc_port} 90 s after the ingress was killed: {last!r}")
