"""Prometheus metrics end to end: a local Ray exporting metrics every second, the app with one
engine replica (real engine, tiny random Llama) behind gRPC, known traffic, then a scrape of
Ray's metrics port: every metric the project defines is there and counts what was sent."""

from __future__ import annotations

import concurrent.futures
import urllib.request
from collections import Counter

import grpc
import pytest

from deployments.metrics import exported_names
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
from tests.ray_cluster import free_port, served_app
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

KEY = "metrics-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
# A small KV pool (8 blocks of 16 = 128 tokens) so two long requests must preempt each other;
# two slots and a one-request queue so a third busy request makes the engine refuse more.
ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 2, "max_waiting": 1, "block_size": 16,
          "num_kv_blocks": 8, "max_model_len": 128, "num_threads": 1}
LONG = 100  # tokens: two such requests (20-token prompts) need 15 blocks of the 8


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    app = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine": ENGINE,
           "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25}, "api_keys": [KEY],
           # autoscaling 1..1: SlotOccupancyPolicy runs in the controller and records its gauges
           "autoscaling": {"min_replicas": 1, "max_replicas": 1, "metrics_interval_s": 0.5,
                           "look_back_period_s": 1.0, "upscale_delay_s": 0, "downscale_delay_s": 0}}
    metrics_port = free_port()
    # Workers push metrics to the node's exporter every metrics_report_interval_ms (Ray clamps it to >= 1 s).
    with served_app(app, _metrics_export_port=metrics_port,
                    _system_config={"metrics_report_interval_ms": 1000}) as ports:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
        yield slotserve_pb2_grpc.SlotServeStub(channel), metrics_port
        channel.close()


class Scrape:
    """One read of Ray's Prometheus endpoint: sample values summed over series."""

    def __init__(self, port: int) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples
                        if "slotserve" in s.name]
        self.names = {s.name for s in self.samples}

    def sum(self, name: str, **labels) -> float:
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: Counter = Counter()
        for s in self.samples:
            if s.name == name and s.value:
                out[s.labels[label]] += s.value
        return dict(out)


def _generate(stub, metadata=AUTH, **fields) -> tuple[str, object]:
    """(outcome, detail): ("ok", last message) or (status code name, details)."""
    try:
        out = list(stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=60))
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()
    return "ok", out[-1]


def _sampling(max_tokens: int, **kw) -> pb.SamplingOptions:
    return pb.SamplingOptions(max_tokens=max_tokens, temperature=0, **kw)


def _ids(start: int, n: int) -> pb.TokenIds:
    return pb.TokenIds(ids=list(range(start, start + n)))


def _known_traffic(stub) -> tuple[int, int, Counter]:
    """Requests with known token counts: (generated tokens, prompt tokens, finish reasons)."""
    prompt = _ids(3, 40)  # two full blocks: the second request reuses them (prefix cache hit)
    first = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=_sampling(6, ignore_eos=True)),
                               metadata=AUTH, timeout=60))
    stop = _generate(stub, prompt_token_ids=prompt, sampling=_sampling(6, stop_token_ids=[first[0].token_ids[0]]))
    short = _generate(stub, prompt_token_ids=_ids(60, 20), sampling=_sampling(9, ignore_eos=True))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # 2 x 120 tokens in a 128-token pool: preemption
        longs = list(pool.map(lambda i: _generate(stub, prompt_token_ids=_ids(100 + 30 * i, 20),
                                                  sampling=_sampling(LONG, ignore_eos=True)), range(2)))
    lasts = [first[-1]] + [detail for outcome, detail in [stop, short, *longs] if outcome == "ok"]
    assert len(lasts) == 5, (stop, short, longs)
    reasons = Counter(pb.FinishReason.Name(m.finish_reason).removeprefix("FINISH_REASON_").lower() for m in lasts)
    assert reasons == {"length": 4, "stop": 1}
    return sum(m.usage.completion_tokens for m in lasts), 40 + 40 + 20 * 3, reasons


def _rejections(stub) -> Counter:
    """One request of each rejection we can provoke cheaply; returns the outcomes seen."""
    seen = Counter()
    seen[_generate(stub, metadata=(), prompt="hi")[0]] += 1
    seen[_generate(stub, prompt_token_ids=pb.TokenIds(ids=[10**6]))[0]] += 1
    seen[_generate(stub, prompt_token_ids=_ids(200, 20), sampling=_sampling(LONG, ignore_eos=True),
                   timeout_s=0.05)[0]] += 1
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three long requests: two slots, one queued
        busy = [pool.submit(_generate, stub, prompt_token_ids=_ids(250 + 20 * i, 20),
                            sampling=_sampling(LONG, ignore_eos=True)) for i in range(3)]
        # While all three are in flight the ingress holds as many streams as the engine can take
        # (it counts its own, exactly): a short request is then refused at the door.
        while not any(f.done() for f in busy):
            outcome = _generate(stub, prompt_token_ids=_ids(320, 20), sampling=_sampling(4, ignore_eos=True))[0]
            seen[outcome] += 1
            if outcome == "RESOURCE_EXHAUSTED":
                break
        seen.update(f.result()[0] for f in busy)
    return seen


def test_metrics_reach_prometheus(cluster):
    stub, port = cluster

    def at_zero():  # before any traffic: every counter is there, at 0, for increase() to start from
        s = Scrape(port)
        counted = {(x.name, x.labels.get("reason") or x.labels.get("finished_reason")) for x in s.samples}
        wanted = {("ray_slotserve_num_preemptions_total", None), ("ray_slotserve_prompt_tokens_total", None),
                  ("ray_slotserve_request_success_total", "abort"),
                  ("ray_slotserve_requests_rejected_total", "overloaded"),
                  ("ray_slotserve_requests_rejected_total", "unavailable")}
        return s if wanted <= counted else None
    s = wait_until(at_zero, "the counters exported at 0", timeout_s=30, poll_s=0.5)
    assert s.sum("ray_slotserve_num_preemptions_total") == 0 and s.sum("ray_slotserve_requests_rejected_total") == 0

    generated, prompt_tokens, reasons = _known_traffic(stub)

    def settled():
        s = Scrape(port)
        done = (s.sum("ray_slotserve_generation_tokens_total", model_name="tiny") == generated
                and s.sum("ray_slotserve_request_success_total", model_name="tiny") == 5
                and s.sum("ray_slotserve_e2e_request_latency_seconds_count", model_name="tiny") == 5)
        return s if done else None
    s = wait_until(settled, "the known traffic in Ray's metrics", timeout_s=30, poll_s=0.5)
    assert s.sum("ray_slotserve_prompt_tokens_total", model_name="tiny") == prompt_tokens
    assert s.by("ray_slotserve_request_success_total", "finished_reason") == reasons
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert s.sum(f"ray_slotserve_{name}_count", model_name="tiny") == 5, name
    assert 0 < s.sum("ray_slotserve_inter_token_latency_seconds_count") <= generated - 5
    assert s.sum("ray_slotserve_num_preemptions_total") >= 1
    assert s.sum("ray_slotserve_prefix_cache_hits_total") >= 32  # the second request's two blocks
    assert s.sum("ray_slotserve_iteration_tokens_total_count") > 0
    assert s.sum("ray_slotserve_routing_decisions_total", model_name="tiny") >= 5
    assert s.sum("ray_slotserve_num_slots", model_name="tiny") == 2

    seen = _rejections(stub)
    assert seen["UNAUTHENTICATED"] == 1 and seen["INVALID_ARGUMENT"] == 1, seen
    expected = {"unauthenticated": 1, "invalid": 1, "deadline": seen["DEADLINE_EXCEEDED"],
                "overloaded": seen["RESOURCE_EXHAUSTED"]}
    assert expected["deadline"] == 1 and expected["overloaded"] >= 1, seen
    # No GPU here (the GPU gauges are tests/test_nvml.py's) and no LoRA (test_metrics.py records those).
    wanted = exported_names(gpu=False, lora=False, tenants=False)  # tenants: tests/test_quotas.py

    def all_there():
        s = Scrape(port)
        return s if wanted <= s.names and s.by("ray_slotserve_requests_rejected_total", "reason") == expected else None
    s = wait_until(all_there, "every metric and the rejections", timeout_s=30, poll_s=0.5)
    assert s.sum("ray_slotserve_autoscaler_desired_replicas", application="slotserve") == 1
    assert s.sum("ray_slotserve_autoscaler_current_replicas", application="slotserve") == 1
