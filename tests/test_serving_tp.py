"""A tensor-parallel engine replica on a local Ray: the replica (rank 0) in bundle 0 of a
2-bundle placement group, its rank worker a Ray actor in bundle 1; over gRPC it gives the
tokens of TP=1, and deleting the app releases every bundle (the rank actor is gone)."""

from __future__ import annotations


import pytest

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from tests.ray_cluster import APP, served_app
from tests.ray_cluster import Service
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_waiting": 4, "block_size": 16,
          "num_kv_blocks": 64, "max_model_len": 512}
PROMPT = [5, 9, 13, 200, 7, 11]
MAX_TOKENS = 8


def test_tp2_replica_serves_the_tp1_tokens(tiny_model_dir):
    import ray
    from ray import serve

    from engine import LLM, SamplingParams

    offline = LLM(str(tiny_model_dir), **ENGINE)
    want = list(offline.generate([{"prompt_token_ids": PROMPT}],
                                 SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
                .outputs[0].token_ids)
    app = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine": {**ENGINE, "tensor_parallel_size": 2},
           "num_replicas": 1, "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25},
           "drain_timeout_s": 2}
    with served_app(app) as ports:
        service = Service(ports.http, ports.grpc)
        out = service.generate(prompt_token_ids=pb.TokenIds(ids=PROMPT),
                               sampling=pb.SamplingOptions(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [t for m in out for t in m.token_ids] == want
        (replica,) = service.replicas()  # one replica to routing and stats, whatever its rank count
        assert replica.healthy
        # Both bundles (0.5 CPU each) and the ingress are held; deleting the app frees them all,
        # so the rank actor is gone with its replica.
        assert ray.available_resources().get("CPU", 0) == pytest.approx(0.75)
        service.channel.close()
        serve.delete(APP)
        wait_until(lambda: ray.available_resources().get("CPU", 0) == pytest.approx(2), "every bundle released",
                   30, poll_s=0.2)
