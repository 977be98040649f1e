"""A replica killed mid-stream on a local Ray: every stream completes, token for token.

32 greedy streams spread over 2 engine replicas (real engine, tiny random Llama); once
every stream has its first tokens, one replica's actor process is killed. The ingress
resumes its requests on the other replica from the tokens already sent, so each client
sees one uninterrupted stream equal to the offline LLM's output.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
from tests.ray_cluster import APP, served_app
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

STREAMS = 32
MAX_TOKENS = 500  # long enough to be mid-stream everywhere when the replica dies
ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 16, "max_waiting": 48, "block_size": 16,
          "num_kv_blocks": 2048, "max_model_len": 1024}


def _prompt(i: int) -> list[int]:
    return [3 + (i * 17 + k * 5) % 300 for k in range(8)]


@pytest.fixture(scope="module")
def stub(tiny_model_dir):
    app = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine": ENGINE, "num_replicas": 2,
           "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25}, "drain_timeout_s": 2}
    with served_app(app) as ports:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
        yield slotserve_pb2_grpc.SlotServeStub(channel)
        channel.close()


class Stream(threading.Thread):
    def __init__(self, stub, i: int) -> None:
        super().__init__(daemon=True)
        self.stub, self.i = stub, i
        self.tokens: list[int] = []
        self.finish = self.error = None
        self.completion_tokens = 0
        self.ended_at = 0.0  # time.monotonic()

    def run(self) -> None:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=_prompt(self.i)), sampling=pb.SamplingOptions(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        try:
            for message in self.stub.Generate(request, timeout=300):
                self.tokens += message.token_ids
                if message.finish_reason:
                    self.finish = pb.FinishReason.Name(message.finish_reason)
                    self.completion_tokens = message.usage.completion_tokens
        except grpc.RpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
        finally:
            self.ended_at = time.monotonic()


def _kill_one_busy_replica(stub) -> str:
    import ray

    loads = {r.replica_id: r.running for r in stub.GetLoad(pb.GetLoadRequest(), timeout=10).replicas}
    victim = max(loads, key=loads.get)
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{APP}#EngineReplica#") and a["name"].endswith(victim))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return victim


def offline_tokens(model_dir) -> list[list[int]]:
    """What each stream must get: the offline LLM's greedy tokens."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    return [list(o.outputs[0].token_ids) for o in LLM(str(model_dir), **{**ENGINE, "max_waiting": 64}).generate(
        [{"prompt_token_ids": _prompt(i)} for i in range(STREAMS)],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]


def streams_under_way(stub) -> list[Stream]:
    """STREAMS streams started, once both replicas are streaming (the rest queued behind them)."""
    streams = [Stream(stub, i) for i in range(STREAMS)]
    for s in streams:
        s.start()
    wait_until(lambda: sum(bool(s.tokens) for s in streams) >= STREAMS // 2
               and all(r.running for r in stub.GetLoad(pb.GetLoadRequest(), timeout=10).replicas),
               "both replicas running streams", 120, poll_s=0.2)
    assert not any(s.finish for s in streams), "streams ended before the fault: raise MAX_TOKENS"
    return streams


def assert_all_complete(streams: list[Stream], want: list[list[int]]) -> None:
    for s in streams:
        s.join(300)
    assert [s.error for s in streams if s.error] == []
    assert all(s.finish == "FINISH_REASON_LENGTH" and s.completion_tokens == MAX_TOKENS for s in streams)
    assert [s.tokens for s in streams] == want


def test_replica_killed_mid_stream_loses_no_stream_and_no_token(stub, tiny_model_dir):
    want = offline_tokens(tiny_model_dir)
    streams = streams_under_way(stub)
    victim = _kill_one_busy_replica(stub)
    print(f"killed {victim} with {sum(bool(s.tokens) for s in streams)} of {STREAMS} streams under way")
    assert_all_complete(streams, want)
