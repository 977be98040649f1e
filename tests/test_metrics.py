"""Metrics recording (deployments.metrics) in-process, no Ray: a fake recorder collects what
the replica, the ingress and the routing policy would send to Prometheus. Plus the Grafana
dashboard: it parses and asks only for metrics the project exports."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import defaultdict
from pathlib import Path

import grpc
import pytest

from deployments.contract import EngineRequest
from deployments.engine_client import LocalEngineClient
from deployments.errors import (BadRequest, Cancelled, DeadlineExceeded, ModelNotFound, Overloaded, ServingError,
                                Unauthenticated, Unavailable)
from deployments.frontend import Frontend, FrontendConfig
from deployments.grpc_service import SlotServeGrpcMixin
from deployments.metrics import (METRICS, REJECTION_REASONS, EngineMetrics, IngressMetrics, RequestMetrics,
                                 exported_names)
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.replica import EngineReplica
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.outputs import EngineStats, RequestTiming, StreamOutput
from engine.sampling import SamplingParams
from router.policy import ReplicaLoad, rank_replicas
from tests.fake_engine import FakeAsyncEngine

DASHBOARD = Path(__file__).resolve().parent.parent / "deployments" / "grafana" / "slotserve-dashboard.json"


class FakeRecorder:
    enabled = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict]] = []
        self.zeros: list[tuple[str, dict]] = []

    def record(self, name, value, tags=None):
        assert name in METRICS, name
        self.calls.append((name, value, dict(tags or {})))

    def start_at_zero(self, name, tags=None):
        assert METRICS[name].kind == "counter", name
        self.zeros.append((name, dict(tags or {})))

    def values(self, name: str, **tags) -> list[float]:
        return [v for n, v, t in self.calls if n == name and all(t.get(k) == w for k, w in tags.items())]

    def total(self, name: str, **tags) -> float:
        return sum(self.values(name, **tags))

    def by_tag(self, name: str, tag: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for n, v, t in self.calls:
            if n == name:
                out[t[tag]] += v
        return dict(out)


def _out(tokens: int, *, finished: bool = False, reason: str | None = None, timing=None, prompt: int = 5):
    return StreamOutput("r", list(range(tokens)), finished=finished, finish_reason=reason, num_prompt_tokens=prompt,
                        timing=timing)


# -- the replica's recording logic ---------------------------------------------------------

def test_stats_become_gauges_and_counter_deltas():
    rec = FakeRecorder()
    m = EngineMetrics(rec)
    s = EngineStats(running=3, waiting=2, max_num_seqs=4, kv_blocks_used=10, kv_blocks_total=40,
                    num_preemptions=1, num_generated_tokens=100, prefix_cache_queries=64, prefix_cache_hits=32,
                    weights_bytes=98_000_000, weights_format=("float32", "gguf"))
    m.record_stats(s, [8, 3, 3])
    assert rec.values("model_weights_bytes", dtype="float32", quantization="gguf") == [98_000_000]
    assert rec.values("num_requests_running") == [3] and rec.values("num_requests_waiting") == [2]
    assert rec.values("kv_cache_usage_perc") == [0.25] and rec.values("slot_occupancy") == [0.75]
    assert rec.values("num_slots") == [4] and rec.values("iteration_tokens_total") == [8, 3, 3]
    s.num_generated_tokens, s.num_preemptions = 130, 1
    m.record_stats(s, [])
    assert rec.values("generation_tokens") == [100, 30]  # deltas, never the total twice
    assert rec.values("num_preemptions") == [1]  # no change: nothing recorded
    assert rec.total("prefix_cache_queries") == 64 and rec.total("prefix_cache_hits") == 32
    m.record_stats(EngineStats(max_num_seqs=4, num_generated_tokens=7), [])  # a new engine counts from zero
    m.record_stats(EngineStats(max_num_seqs=4, num_generated_tokens=10), [])
    assert rec.values("generation_tokens") == [100, 30, 3]
    s.spec_decode_num_accepted_tokens_per_pos = (5, 2, 0)
    m.record_stats(s, [])
    s.spec_decode_num_accepted_tokens_per_pos = (7, 2, 1)
    m.record_stats(s, [])
    assert rec.by_tag("spec_decode_num_accepted_tokens_per_pos", "position") == {"0": 7, "1": 2, "2": 1}


def test_lora_stats_become_per_adapter_gauges_and_vllms_info_series():
    rec = FakeRecorder()
    m = EngineMetrics(rec)
    m.record_stats(EngineStats(max_num_seqs=4), [])  # no LoRA: no LoRA series but the counters' zeros
    assert not [c for c in rec.calls if c[0].startswith("lora_requests")]
    assert ("lora_loads", {}) in rec.zeros and ("lora_evictions", {}) in rec.zeros
    m.record_stats(EngineStats(max_num_seqs=4, max_loras=2, lora_running={"sql": 2}, lora_waiting={"chat": 1, "b": 3},
                               lora_loads=1), [])
    (info,) = [t for n, _, t in rec.calls if n == "lora_requests_info"]
    assert info == {"max_lora": "2", "running_lora_adapters": "sql", "waiting_lora_adapters": "b,chat"}
    assert rec.values("lora_requests_running", lora_name="sql") == [2]
    assert rec.values("lora_requests_waiting", lora_name="chat") == [1] and rec.values("lora_loads") == [1]
    m.record_stats(EngineStats(max_num_seqs=4, max_loras=2, lora_loads=3, lora_evictions=1), [])
    assert rec.values("lora_requests_running", lora_name="sql") == [2, 0]  # back to 0 once idle
    assert rec.values("lora_loads") == [1, 2] and rec.values("lora_evictions") == [1]


def test_request_latencies_come_from_the_engine_timing():
    rec = FakeRecorder()
    timing = RequestTiming(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=14.0)
    req = RequestMetrics(rec)
    req.on_message(_out(1, prompt=7), now=100.0)
    req.on_message(_out(1), now=100.2)
    req.on_message(_out(2), now=101.0)  # two coalesced tokens share the 0.8 s gap
    last = _out(1, finished=True, reason="length", timing=timing)
    req.on_message(last, now=101.1)
    req.on_end(last)
    req.on_end(None)  # a later close changes nothing
    assert rec.values("prompt_tokens") == [7]
    assert rec.values("inter_token_latency_seconds") == pytest.approx([0.2, 0.4, 0.4, 0.1])
    assert rec.by_tag("request_success", "finished_reason") == {"length": 1}
    expected = {"time_to_first_token_seconds": 1.0, "e2e_request_latency_seconds": 4.0,
                "request_queue_time_seconds": 0.5, "request_prefill_time_seconds": 0.5,
                "request_decode_time_seconds": 3.0}
    for name, seconds in expected.items():
        assert rec.values(name) == [pytest.approx(seconds)], name


def test_an_abandoned_request_counts_as_abort_without_latencies():
    rec = FakeRecorder()
    req = RequestMetrics(rec)
    req.on_message(_out(1), now=1.0)
    req.on_end(None)
    assert rec.by_tag("request_success", "finished_reason") == {"abort": 1}
    assert not rec.values("e2e_request_latency_seconds") and not rec.values("time_to_first_token_seconds")


def test_replica_records_what_it_served():
    async def main():
        rec = FakeRecorder()
        replica = EngineReplica("fake-model", {"vocab_size": 64, "max_num_seqs": 4, "step_delay_s": 0.001},
                                FakeAsyncEngine, drain_timeout_s=1, metrics=rec)
        asked = [3, 5, 8]
        for i, n in enumerate(asked):
            request = EngineRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=n, ignore_eos=True))
            got = [m async for m in replica.generate(request)]
            assert sum(len(m.token_ids) for m in got) == n
            assert [m.queue_time_s is not None for m in got] == [True] + [False] * (len(got) - 1)  # on the first only
        gen = replica.generate(EngineRequest(request_id="gone", prompt_token_ids=[1], params=SamplingParams(max_tokens=50)))
        await gen.__anext__()
        await gen.aclose()  # the client went away mid-stream
        replica.publish_metrics()
        assert rec.by_tag("request_success", "finished_reason") == {"length": 3, "abort": 1}
        assert rec.total("prompt_tokens") == 3 * 3 + 1
        assert rec.total("generation_tokens") >= sum(asked) + 1
        assert len(rec.values("e2e_request_latency_seconds")) == 3
        assert len(rec.values("inter_token_latency_seconds")) >= sum(n - 1 for n in asked)
        assert sum(rec.values("iteration_tokens_total")) == rec.total("generation_tokens")
        assert set(rec.values("num_slots")) == {4}
        await replica.shutdown()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_every_counter_is_exported_at_zero_from_the_start():
    def subclasses(cls):
        return {cls} | {s for sub in cls.__subclasses__() for s in subclasses(sub)}

    rec = FakeRecorder()
    EngineMetrics(rec)
    IngressMetrics(rec)
    assert {name for name, _ in rec.zeros} == {name for name, d in METRICS.items()
                                               if d.kind == "counter" and not d.tenant_only}  # test_quotas.py
    assert {t["finished_reason"] for n, t in rec.zeros if n == "request_success"} == {"stop", "length", "abort"}
    assert [t for n, t in rec.zeros if n == "spec_decode_num_accepted_tokens_per_pos"] == [{"position": "0"}]
    reasons = {cls.metric_reason for cls in subclasses(ServingError)} - {None}
    assert {t["reason"] for n, t in rec.zeros if n == "requests_rejected"} == set(REJECTION_REASONS) == reasons
    assert not rec.calls  # nothing counted yet


# -- the ingress: rejections by reason -----------------------------------------------------

@pytest.mark.parametrize("exc, reason", [
    (BadRequest("x"), "invalid"), (ModelNotFound("x"), "invalid"), (Unauthenticated("x"), "unauthenticated"),
    (Overloaded("x"), "overloaded"), (DeadlineExceeded("x"), "deadline"), (Unavailable("x"), "unavailable"),
    (ServingError("x"), "internal"), (InvalidRequestError("x"), "invalid"), (EngineOverloadedError("x"), "overloaded"),
    (asyncio.TimeoutError(), "deadline"), (Cancelled("x"), None), (asyncio.CancelledError(), None),
])
def test_rejections_are_counted_by_reason(exc, reason):
    rec = FakeRecorder()
    IngressMetrics(rec).rejected(exc)
    assert rec.by_tag("requests_rejected", "reason") == ({reason: 1} if reason else {})


class _Context:
    def __init__(self, metadata=()):
        self._metadata = list(metadata)
        self.code = None

    def invocation_metadata(self):
        return self._metadata

    def traceparent(self):
        return None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


class _Service(SlotServeGrpcMixin):
    def __init__(self, frontend):
        self.frontend = frontend


def test_grpc_generate_counts_rejections(tiny_model_dir):
    from engine.tokenizer import load_tokenizer

    async def main():
        tokenizer = load_tokenizer(tiny_model_dir)
        replica = EngineReplica("fake-model", {"vocab_size": tokenizer.vocab_size, "step_delay_s": 0.001},
                                FakeAsyncEngine, drain_timeout_s=1)
        config = FrontendConfig(served_model_name="tiny", model="fake-model", api_keys=("secret-key-1",))
        frontend = Frontend(config, tokenizer, LocalEngineClient([replica]))
        rec = frontend.metrics.recorder = FakeRecorder()
        service = _Service(frontend)
        auth = [("authorization", "Bearer secret-key-1")]
        cases = [(pb.GenerateRequest(prompt="hi"), [], grpc.StatusCode.UNAUTHENTICATED),
                 (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=-1)), auth,
                  grpc.StatusCode.INVALID_ARGUMENT),
                 (pb.GenerateRequest(prompt="hi", model="other"), auth, grpc.StatusCode.NOT_FOUND)]
        for request, metadata, code in cases:
            ctx = _Context(metadata)
            with pytest.raises(ServingError):
                [m async for m in service.Generate(request.SerializeToString(), grpc_context=ctx)]
            assert ctx.code == code
        ok = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=4))
        assert len([m async for m in service.Generate(ok.SerializeToString(), grpc_context=_Context(auth))]) > 0
        assert rec.by_tag("requests_rejected", "reason") == {"unauthenticated": 1, "invalid": 2}
        await replica.shutdown()
    asyncio.run(asyncio.wait_for(main(), 30))


# -- routing reasons -----------------------------------------------------------------------

def _load(rid, *, running=0, hashes=(), fresh=True):
    return ReplicaLoad(rid, known=True, free_slots=4 - running, running=running, max_num_seqs=4,
                       kv_blocks_total=100, block_size=16, prefix_hashes=frozenset(hashes),
                       updated_at=100.0 if fresh else 0.0)


def test_ranking_says_why_the_first_choice_won():
    rng = random.Random(0)

    def reason(loads, request=()):
        return rank_replicas(loads, list(request), 100.0, rng, stale_after_s=5.0, prompt_len=32).reason

    assert reason([_load("a", hashes=[7]), _load("b")], request=[7, 8]) == "prefix"
    assert reason([_load("a"), _load("b", running=1)], request=[7, 8]) == "load"
    assert reason([_load("a", running=4), _load("b", fresh=False)]) == "fallback"  # full / unknown stats
    assert reason([_load("a", running=4)]) == "fallback"


# -- the dashboard ---------------------------------------------------------------------------

def _expressions(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query") and isinstance(value, str):  # panel targets, template variables
                yield value
            else:
                yield from _expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from _expressions(item)


def test_dashboard_queries_only_exported_metrics():
    board = json.loads(DASHBOARD.read_text())
    exprs = list(_expressions(board))
    assert len(exprs) >= 10
    known = exported_names()
    used = {name for e in exprs for name in re.findall(r"\bray_[A-Za-z0-9_:]+", e)}
    assert used and used <= known, sorted(used - known)
    queried = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    for needed in ("slot_occupancy", "kv_cache_usage_perc", "num_requests_waiting", "num_preemptions",
                   "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "generation_tokens", "requests_rejected", "autoscaler_desired_replicas",
                   "tenant_tokens", "tenant_time_to_first_token_seconds", "tenant_queue_time_seconds",
                   "tenant_requests"):
        assert f"ray_slotserve_{needed}" in queried, needed
    for e in exprs:  # tenant panels split by tenant (configured tenants only: few series)
        assert "ray_slotserve_tenant_" not in e or re.search(r"by \([^)]*\btenant\b", e), e
