"""Serving input handling without Ray: validation, OpenAI bodies, proto mapping, errors, configs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.app import AppConfig
from deployments.errors import (BadRequest, Cancelled, DeadlineExceeded, ModelNotFound, Overloaded, ServingError,
                                Unavailable, to_serving_error)
from deployments.grpc_service import delta_to_proto, generate_input, parse
from deployments.openai_protocol import parse_chat_body, parse_completion_body
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.requests import (GenerateInput, PreparedRequest, build_sampling_params, check_text, check_vocab,
                                  effective_timeout, new_request_id, parse_messages)
from deployments.textstream import TextDelta, TokenLogprob, Usage
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _params(fields, prompt_len=4, max_model_len=64, default=16):
    return build_sampling_params(fields, num_prompt_tokens=prompt_len, max_model_len=max_model_len,
                                 default_max_tokens=default)


# -- sampling and prompt validation ------------------------------------------------------

def test_sampling_defaults_and_vllm_extras():
    p = _params({"temperature": 0, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "seed": 7,
                 "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [3], "stop": "END"})
    assert (p.temperature, p.top_k, p.min_p, p.seed, p.ignore_eos, p.min_tokens) == (0, 5, 0.1, 7, True, 2)
    assert p.stop == ("END",) and p.stop_token_ids == (3,) and p.max_tokens == 16
    # the default max_tokens never runs past the context
    assert _params({}, prompt_len=60, max_model_len=64).max_tokens == 4


@pytest.mark.parametrize("fields, needle", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**9}, "at most 60 tokens"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 99}, "logprobs"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"bogus": 1}, "unknown field bogus"),
])
def test_bad_sampling_values_name_the_field(fields, needle):
    with pytest.raises(BadRequest, match=needle):
        _params(fields)


def test_prompt_that_fills_the_context_is_rejected():
    with pytest.raises(BadRequest, match="no room"):
        _params({}, prompt_len=64, max_model_len=64)


def test_text_limits():
    assert check_text("prompt", "héllo", 10) == "héllo"
    with pytest.raises(BadRequest, match="empty"):
        check_text("prompt", "", 10)
    with pytest.raises(BadRequest, match="limit is 3"):
        check_text("prompt", "abcd", 3)
    with pytest.raises(BadRequest, match="UTF-8") as info:
        GenerateInput(prompt="bad \ud800 surrogate")
    assert info.value.param == "prompt"
    with pytest.raises(BadRequest, match="string"):
        GenerateInput(prompt=42)


def test_messages_and_token_ids():
    msgs = parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                            "name": "ignored"}])
    assert msgs[0].content == "ab"
    for bad, param in [([], "messages"), ([{"role": "wizard", "content": "x"}], "messages.0.role"),
                       ([{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url"}]}],
                        "messages.1.content")]:
        with pytest.raises(BadRequest) as info:
            parse_messages(bad)
        assert info.value.param == param and param in info.value.message
    assert GenerateInput(prompt_token_ids=[1, 2]).prompt_token_ids == (1, 2)
    for bad, param in (([], "prompt_token_ids"), ([1, -1], "prompt_token_ids.1"), ([True], "prompt_token_ids.0"),
                       (["1"], "prompt_token_ids.0")):
        with pytest.raises(BadRequest) as info:
            GenerateInput(prompt_token_ids=bad)
        assert info.value.param == param
    check_vocab((1, 9), 10)
    with pytest.raises(BadRequest, match=r"\[0, 10\)") as info:
        check_vocab((1, 10), 10)
    assert info.value.param == "prompt_token_ids.1"


def test_request_id_and_timeout():
    assert GenerateInput(request_id="").request_id is None and GenerateInput(request_id="abc").request_id == "abc"
    assert len(new_request_id()) == 32 and new_request_id() != new_request_id()
    for bad in ("x" * 200, "bad\nid", 5):
        with pytest.raises(BadRequest, match="request_id"):
            GenerateInput(request_id=bad)
    assert effective_timeout(None, 30.0) == 30.0 and effective_timeout(0, 30.0) == 30.0
    assert effective_timeout(5, 30.0) == 5 and effective_timeout(60, 30.0) == 30.0 and effective_timeout(5, None) == 5
    with pytest.raises(BadRequest, match="timeout_s"):
        GenerateInput(timeout_s=-1)


def test_engine_request_carries_token_ids_only():
    params = SamplingParams(stop=["END"], include_stop_str_in_output=True, max_tokens=5)
    context = {"traceparent": "00-ab-cd-01", "tracestate": "vendor=1"}
    req = PreparedRequest("r1", (1, 2, 3), params, priority=2, trace_context=context).engine_request()
    assert req.prompt_token_ids == [1, 2, 3] and req.priority == 2 and req.trace_context == context
    assert req.params.stop == () and req.params.max_tokens == 5 and req.cache_salt is None
    salted = PreparedRequest("r2", (1, 2, 3), params, cache_salt="tenant-a").engine_request()
    assert salted.cache_salt == "tenant-a"


# -- OpenAI bodies -----------------------------------------------------------------------

def test_completion_body():
    parsed = parse_completion_body({"model": "m", "prompt": "hi", "max_tokens": 5, "top_k": 3, "priority": 1,
                                    "cache_salt": "s1", "stream": True, "stream_options": {"include_usage": True},
                                    "user": "u"})
    assert parsed.stream and parsed.include_usage
    assert parsed.input.prompt == "hi" and parsed.input.priority == 1 and parsed.input.cache_salt == "s1"
    assert parsed.input.sampling == {"max_tokens": 5, "top_k": 3}
    assert parse_completion_body({"model": "m", "prompt": [[1, 2]]}).input.prompt_token_ids == (1, 2)
    assert parse_completion_body({"model": "m", "prompt": ["one"]}).input.prompt == "one"


@pytest.mark.parametrize("body, needle", [
    ([1, 2], "JSON object"),
    ({"prompt": "x"}, "model is required"),
    ({"model": "m"}, "prompt is required"),
    ({"model": "m", "prompt": ["a", "b"]}, "one prompt per request"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "^best_of is not supported"),
    ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "m", "prompt": "x", "frobnicate": 1}, "unknown field"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_completion_bodies(body, needle):
    with pytest.raises(BadRequest, match=needle):
        parse_completion_body(body)


def test_chat_body():
    parsed = parse_chat_body({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2, "seed": 1})
    assert parsed.input.sampling == {"max_tokens": 7, "logprobs": 2, "seed": 1}
    assert parsed.input.default_max_tokens is None  # chat uses the server's default
    for body, needle in [({"model": "m"}, "messages is required"),
                         ({"model": "m", "messages": [], "tools": [{"type": "function"}]}, "tool"),
                         ({"model": "m", "messages": [], "response_format": {"type": "json"}}, "response_format"),
                         ({"model": "m", "messages": [], "top_logprobs": 2}, "logprobs=true")]:
        with pytest.raises(BadRequest, match=needle):
            parse_chat_body(body)


# -- gRPC messages -----------------------------------------------------------------------

def test_proto_to_generate_input():
    msg = pb.GenerateRequest(request_id="r", prompt="hello", priority=3, timeout_s=2.5,
                             sampling=pb.SamplingOptions(temperature=0.0, max_tokens=9, stop=["\n"], seed=4,
                                                         skip_special_tokens=False, ignore_eos=True))
    inp = generate_input(parse(pb.GenerateRequest, msg.SerializeToString()))
    assert (inp.prompt, inp.request_id, inp.priority, inp.timeout_s) == ("hello", "r", 3, 2.5)
    # only fields that were set travel: temperature 0 (greedy) is kept, top_p (unset) is not
    assert inp.sampling == {"temperature": 0.0, "max_tokens": 9, "seed": 4, "skip_special_tokens": False,
                            "stop": ["\n"], "ignore_eos": True}
    chat = pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="x")]))
    assert generate_input(chat).messages[0].content == "x"
    with pytest.raises(BadRequest) as info:  # int64 on the wire: the negative id is rejected by name
        generate_input(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, -1])))
    assert info.value.param == "prompt_token_ids.1"


def test_malformed_protobuf_is_invalid_argument():
    for raw in (b"\x1a\x02\xff\xfe", b"\xff\xff\xff"):  # a non-UTF-8 prompt; garbage
        with pytest.raises(BadRequest, match="not a valid slotserve.v1.GenerateRequest"):
            parse(pb.GenerateRequest, raw)


def test_delta_to_proto():
    delta = TextDelta("r", "hi", (4, 5), (TokenLogprob(4, -0.1, "h", ((4, -0.1, "h"), (9, -2.0, "x"))),),
                      "length", Usage(3, 2, 1))
    out = delta_to_proto(delta)
    assert out.finish_reason == pb.FINISH_REASON_LENGTH and list(out.token_ids) == [4, 5]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_prompt_tokens) == (3, 2, 1)
    assert out.logprobs[0].top_logprobs[1].token_id == 9


# -- error mapping -----------------------------------------------------------------------

def _ray_task_error(cause: BaseException, *, as_cause: bool = False) -> BaseException:
    """What a replica's exception looks like at the ingress: wrapped, with the remote traceback."""
    import ray.exceptions

    err = ray.exceptions.RayTaskError("generate", "Traceback (most recent call last): ...", cause)
    return err.as_instanceof_cause() if as_cause else err


def _ray_errors():
    import ray.exceptions as rx
    import ray.serve.exceptions as sx
    from ray.serve._private.common import DeploymentID

    return [
        (_ray_task_error(InvalidRequestError("prompt too long")), BadRequest, "INVALID_ARGUMENT", 400),
        (_ray_task_error(InvalidRequestError("prompt too long"), as_cause=True), BadRequest, "INVALID_ARGUMENT", 400),
        (_ray_task_error(EngineOverloadedError("queue full")), Overloaded, "RESOURCE_EXHAUSTED", 429),
        (sx.BackPressureError(num_queued_requests=9, max_queued_requests=8), Overloaded, "RESOURCE_EXHAUSTED", 429),
        (_ray_task_error(EngineDeadError("loop died"), as_cause=True), Unavailable, "UNAVAILABLE", 503),
        (rx.ActorDiedError(), Unavailable, "UNAVAILABLE", 503),
        (rx.ActorUnavailableError("connection lost", None), Unavailable, "UNAVAILABLE", 503),
        (rx.RayActorError(), Unavailable, "UNAVAILABLE", 503),
        (_ray_task_error(rx.ActorDiedError()), Unavailable, "UNAVAILABLE", 503),
        (sx.DeploymentUnavailableError(DeploymentID("EngineReplica", "slotserve")), Unavailable, "UNAVAILABLE", 503),
        (sx.ReplicaUnavailableError("replica-1"), Unavailable, "UNAVAILABLE", 503),
        (rx.TaskCancelledError(), Cancelled, "CANCELLED", 499),
        (sx.RequestCancelledError("r1"), Cancelled, "CANCELLED", 499),
        (rx.GetTimeoutError("get timed out"), DeadlineExceeded, "DEADLINE_EXCEEDED", 504),
        (sx.gRPCStatusError(InvalidRequestError("bad")), BadRequest, "INVALID_ARGUMENT", 400),
        (sx.RayServeException("something else"), ServingError, "INTERNAL", 500),
    ]


@pytest.mark.parametrize("exc, kind, code, status", [
    (InvalidRequestError("prompt too long"), BadRequest, "INVALID_ARGUMENT", 400),
    (EngineOverloadedError("queue full"), Overloaded, "RESOURCE_EXHAUSTED", 429),
    (EngineDeadError("loop died"), Unavailable, "UNAVAILABLE", 503),
    (asyncio.TimeoutError(), DeadlineExceeded, "DEADLINE_EXCEEDED", 504),
    (asyncio.CancelledError(), Cancelled, "CANCELLED", 499),
    (ModelNotFound("nope"), ModelNotFound, "NOT_FOUND", 404),
    (KeyError("x"), ServingError, "INTERNAL", 500),
    *_ray_errors(),
])
def test_error_mapping(exc, kind, code, status):
    err = to_serving_error(exc)
    assert type(err) is kind and err.grpc_code == code and err.http_status == status
    assert "Traceback" not in err.message
    body = err.openai_body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_wrapped_replica_error_keeps_the_original_message():
    err = to_serving_error(_ray_task_error(InvalidRequestError("prompt is 90 tokens; the limit is 64")))
    assert err.message == "prompt is 90 tokens; the limit is 64"
    # a class merely named like Ray's is not Ray's
    assert type(to_serving_error(type("ActorDiedError", (Exception,), {})("x"))) is ServingError


def test_retry_after_is_a_second_unless_the_error_names_its_own():
    from deployments.errors import TenantLimitExceeded
    from deployments.http_common import error_response

    assert error_response(Overloaded("full")).headers["retry-after"] == "1"
    assert error_response(Unavailable("none")).headers["retry-after"] == "1"
    assert error_response(TenantLimitExceeded("over", 10.2)).headers["retry-after"] == "11"
    assert "retry-after" not in error_response(BadRequest("bad")).headers


# -- configs -------------------------------------------------------------------------------

def test_app_config_rejects_bad_fields_by_name():
    cases = [({"bogus": 1}, "unknown field bogus"), ({"routing": "default"}, "unknown field routing"),
             ({"engine": {"max_num_seqs": 0}}, "engine: max_num_seqs"),
             ({"autoscaling": {"min_replicas": 2, "max_replicas": 1}}, "autoscaling.max_replicas"),
             ({"autoscaling": {"speed": 1}}, "autoscaling.speed"),
             ({"replica_resources": {"num_gpus": -1}}, "replica_resources.num_gpus"),
             ({"num_replicas": 2, "autoscaling": {}}, "not both"),
             ({"engine_link_tls": {"certfile": "/tls/tls.crt"}}, "engine_link_tls.keyfile"),
             ({"autoscaling": {"policy": "default"}}, "autoscaling.policy"),
             ({"api_keys": ["short"]}, "api_keys"), ({"engine": [1]}, "engine must be a valid dictionary"),
             ({"allowed_priority": [3, 1]}, r"allowed_priority must be \[lowest, highest\]"),
             ({"allowed_priority": [0, 2**31]}, "allowed_priority.1"),
             # The test double is not selectable from a config.
             ({"engine_class": "tests.fake_engine:FakeAsyncEngine"}, "unknown field engine_class")]
    for args, needle in cases:
        with pytest.raises(ValueError, match=needle):
            AppConfig.from_args(args)
    cfg = AppConfig.from_args({"model": "/models/Llama-3.1-8B-Instruct/", "engine": {"max_num_seqs": 4,
                                                                                     "max_waiting": 10}})
    assert cfg.model_name == "Llama-3.1-8B-Instruct" and cfg.engine_max_ongoing_requests() == 30
    assert AppConfig.from_args(None).model_name == "smollm2-135m"
    assert AppConfig.from_args(None).allowed_priority == (0, 0)  # clients may not jump the queue unless allowed


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_config_files_are_valid_serve_configs(name):
    from ray.serve.schema import ServeDeploySchema

    from deployments.cli import load_serve_config
    from deployments.grpc_registration import SERVICER_FUNCTIONS

    config = load_serve_config(ROOT / "configs" / name)
    ServeDeploySchema(**config)
    assert config["grpc_options"]["grpc_servicer_functions"] == list(SERVICER_FUNCTIONS)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = AppConfig.from_args(app["args"])
    if name.startswith("gpu"):
        assert cfg.replica_resources.num_gpus == 1
    else:
        assert config["http_options"] == {"host": "127.0.0.1", "port": 8000}
        assert config["grpc_options"]["port"] == 9000 and cfg.replica_resources.num_gpus == 0
    if name == "local-cpu.yaml":
        assert (cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas) == (1, 2)
    tp = cfg.tensor_parallel_size
    assert (tp > 1) == ("-tp" in name)
    if tp > 1:  # one bundle per rank on one node; the replica actor fits in bundle 0
        from deployments.app import engine_deployment_options

        options = engine_deployment_options(cfg)
        assert options["placement_group_strategy"] == "STRICT_PACK"
        bundles = options["placement_group_bundles"]
        assert len(bundles) == tp and bundles[0].get("GPU", 0) == options["ray_actor_options"]["num_gpus"]


def test_tensor_parallel_reserves_one_bundle_per_rank():
    from deployments.app import engine_deployment_options

    tp2 = {"engine": {"tensor_parallel_size": 2}}
    with pytest.raises(ValueError, match="replica_resources.num_gpus"):
        AppConfig.from_args({**tp2, "replica_resources": {"num_gpus": 2}})
    with pytest.raises(ValueError, match="^replica_resources must be non-zero"):
        AppConfig.from_args({**tp2, "replica_resources": {"num_cpus": 0}})
    options = engine_deployment_options(AppConfig.from_args({**tp2, "replica_resources": {"num_cpus": 2, "num_gpus": 1}}))
    assert options["placement_group_bundles"] == [{"CPU": 2, "GPU": 1}] * 2
    # GPU ranks see the node's GPUs and pick theirs (deployments.tp_launcher)
    assert options["ray_actor_options"]["runtime_env"]["env_vars"] == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert "placement_group_bundles" not in engine_deployment_options(AppConfig.from_args({}))


def test_port_overrides():
    from deployments.cli import load_serve_config

    config = load_serve_config(ROOT / "configs" / "local-cpu.yaml", http_port=8123, grpc_port=9123)
    assert config["http_options"]["port"] == 8123 and config["grpc_options"]["port"] == 9123


def test_speculative_config_from_the_command_line():
    from deployments.app import AppConfig
    from deployments.cli import load_serve_config, parser

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    args = parser().parse_args(["serve", "--speculative-config", json.dumps(spec)])
    config = load_serve_config(ROOT / "configs" / "local-cpu.yaml", speculative_config=args.speculative_config)
    engine = config["applications"][0]["args"]["engine"]
    assert engine["speculative_config"] == spec and engine["quantization"] == "gguf"  # the rest kept
    assert AppConfig.from_args(config["applications"][0]["args"]).engine["speculative_config"] == spec
    for bad in ("{method: ngram", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "--speculative-config", bad])


def test_generated_code_is_up_to_date(tmp_path):
    """gen.py output matches the committed stubs (edit the .proto, then run gen.py)."""
    import shutil

    src = ROOT / "deployments"
    shutil.copytree(src / "proto", tmp_path / "deployments" / "proto")
    subprocess.run([sys.executable, str(tmp_path / "deployments" / "proto" / "gen.py")], check=True,
                   capture_output=True)
    fresh = tmp_path / "deployments" / "proto_gen"
    committed = {p.relative_to(src / "proto_gen"): p.read_text() for p in (src / "proto_gen").rglob("*.py*")}
    generated = {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*.py*")}
    assert generated == committed


def test_a_load_report_tells_no_caller_what_only_routers_need():
    """/load (JSON) and GetLoad (protobuf) carry the same public fields: no engine-link address (a
    socket a peer holding the link token could reach), no adapter path on disk, no prefix hash."""
    from deployments.admission import PUBLIC_LOAD_FIELDS, summarize_load
    from router.policy import RoutingStats
    from deployments.grpc_service import load_to_proto

    assert set(PUBLIC_LOAD_FIELDS) == {f.name for f in pb.ReplicaLoad.DESCRIPTOR.fields}
    replica = RoutingStats(replica_id="r1", healthy=True, running=2, waiting=0, max_num_seqs=4, free_slots=2,
                           kv_blocks_used=1, kv_blocks_total=8, block_size=16, updated_at=5.0,
                           link="10.0.0.7:41234", link_requests=9, lora_paths={"sql": "/adapters/sql"},
                           lora_roots={"sql": "ab" * 32}, lora_loaded=["sql"], prefix_hashes=[1, 2, 3])
    summary = summarize_load([replica])
    (public,) = summary["replicas"]
    assert set(public) == {*PUBLIC_LOAD_FIELDS, "num_prefix_hashes"}
    assert (public["replica_id"], public["running"], public["free_slots"], public["num_prefix_hashes"]) == ("r1", 2, 2, 3)
    assert not any(secret in repr(summary) for secret in ("10.0.0.7", "/adapters/sql", "ab" * 32))
    assert load_to_proto(summarize_load([replica])).replicas[0].lora_loaded == ["sql"]
