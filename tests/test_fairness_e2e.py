"""Tenants sharing one engine, end to end: real Ray Serve, the real app, the ``openai`` SDK.

Tenant A floods the engine (more streams than its slots); tenant B then sends a few short requests.
With token-fair scheduling B's requests are admitted at the next free slots, ahead of A's queue;
sent under A's key (one tenant: first come, first served) the same requests wait behind A's whole
queue. What is compared is the order of events, not their durations: for each of B's requests, how
many of A's requests started (their first token came) between B's request being sent and its first
token. That count does not depend on the host's speed. Latencies in seconds are measured by
``python -m benchmarks.fairness --served``.

Also here: a flood of ``n: 16`` requests, a tenant key rotated out mid-stream, and no KV block or
slot left behind by any of it.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time

import pytest

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from tests.ray_cluster import Service, served_app
from tests.waits import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

KEY_A, KEY_B, KEY_B_NEXT = "key-tenant-a-0001", "key-tenant-b-0001", "key-tenant-b-0002"
SLOTS = 2
ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": SLOTS, "max_waiting": 64, "block_size": 16,
          "num_kv_blocks": 64, "max_model_len": 512, "num_threads": 1}
# Floods long enough (2,400 steps each) that their queue outlasts several routing-stats periods: GetLoad
# reports what Serve last polled (every 0.5 s), and a flood that drains in a second can be missed.
FLOOD, FLOOD_TOKENS = 12, 400
CHOICES, CHOICE_TOKENS = 16, 100


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    b_keys = tmp_path_factory.mktemp("tenant-b") / "keys"
    b_keys.write_text(KEY_B + "\n")
    app = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine": ENGINE,
           "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25},
           "tenants": [{"name": "a", "api_keys": [KEY_A]}, {"name": "b", "api_keys_file": str(b_keys)}]}
    with served_app(app) as ports:
        svc = Service(ports.http, ports.grpc)
        svc.b_keys = b_keys
        yield svc
        svc.channel.close()


class Stream:
    """One streamed completion in a thread: when it was sent, its first token came, and it ended."""

    def __init__(self, client, prompt: str, max_tokens: int, n: int = 1) -> None:
        self.sent = self.first = self.done = None
        self.finish_reasons: list[str] = []
        self.tokens = 0
        self._args = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, n=n, stream=True, temperature=0,
                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        self._client = client

    def __call__(self) -> "Stream":
        self.sent = time.monotonic()
        for chunk in self._client.completions.create(**self._args):
            if chunk.usage is not None:
                self.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if self.first is None:
                    self.first = time.monotonic()
                if choice.finish_reason:
                    self.finish_reasons.append(choice.finish_reason)
        self.done = time.monotonic()
        return self


def _client(service: Service, key: str):
    client = service.openai()
    client.api_key = key
    return client


def _replicas(service: Service) -> list[pb.ReplicaLoad]:
    return service.stub.GetLoad(pb.GetLoadRequest(), metadata=(("authorization", f"Bearer {KEY_A}"),),
                                timeout=10).replicas


def _waiting(service: Service) -> int:
    return sum(r.waiting for r in _replicas(service))


def _flood_then(service: Service, pool, flood: list[Stream], probes: list[Stream], queued: int) -> None:
    """Start ``flood``, send ``probes`` once the engine has ``queued`` requests waiting, wait for all."""
    futures = [pool.submit(s) for s in flood]
    wait_until(lambda: _waiting(service) >= queued, f"{queued} of the flood queued", timeout_s=60, poll_s=0.05)
    futures += [pool.submit(s) for s in probes]
    for f in futures:
        f.result(timeout=180)


def _overtaken(probe: Stream, flood: list[Stream]) -> int:
    """The flood's requests whose first token came while ``probe`` waited for its own."""
    return sum(probe.sent < s.first < probe.first for s in flood)


def _no_leaks(service: Service) -> None:
    wait_until(lambda: all(r.running == r.waiting == r.kv_blocks_used == 0 for r in _replicas(service)),
               "engines idle with no KV block held", timeout_s=30, poll_s=0.2)


def test_a_tenant_is_served_ahead_of_another_tenants_flood(service):
    a, b = _client(service, KEY_A), _client(service, KEY_B)
    seen = {}
    with concurrent.futures.ThreadPoolExecutor(FLOOD + 3) as pool:
        for case, probe_client in (("fair", b), ("fcfs", a)):  # fcfs: the same probes as tenant A's own
            flood = [Stream(a, f"flood {i} of tenant a", FLOOD_TOKENS) for i in range(FLOOD)]
            probes = [Stream(probe_client, f"short {i}", 2) for i in range(3)]
            _flood_then(service, pool, flood, probes, queued=FLOOD - SLOTS - 4)
            assert all(s.finish_reasons == ["length"] and s.tokens == FLOOD_TOKENS for s in flood)
            seen[case] = [_overtaken(p, flood) for p in probes]
            _no_leaks(service)
    # Fair: a probe waits for a slot to turn over, or, once B's earlier probes put B's counter above
    # A's, for an A request or two. A's two running requests started in one step and end in one, so
    # a turnover that comes while the probes are still on their way to the engine gives A both slots.
    # First come, first served: behind most of A's queue.
    assert statistics.median(seen["fair"]) <= SLOTS and max(seen["fair"]) <= SLOTS + 1, seen
    assert statistics.median(seen["fcfs"]) >= FLOOD - SLOTS - 6, seen


def test_a_flood_of_many_choice_requests_does_not_hold_the_engine(service):
    """Each of A's requests asks for 16 choices: 48 sequences for 2 slots. B still gets in early."""
    a, b = _client(service, KEY_A), _client(service, KEY_B)
    flood = [Stream(a, f"many choices {i}", CHOICE_TOKENS, n=CHOICES) for i in range(3)]
    probes = [Stream(b, "short", 2)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        _flood_then(service, pool, flood, probes, queued=16)
    assert all(len(s.finish_reasons) == CHOICES and s.tokens == CHOICES * CHOICE_TOKENS for s in flood)
    assert probes[0].finish_reasons == ["length"]
    # First come, first served, B would wait for every one of A's 48 choices: all three of A's requests
    # would end first. Shared fairly, at most the request whose last choices hold the slots when B arrives
    # (or whose last tokens are on their way to A's client) ends before B's first token reaches B.
    probe = probes[0]
    assert sum(probe.sent < s.done < probe.first for s in flood) <= 1, "A requests ended while B waited"
    _no_leaks(service)


def test_a_tenant_key_rotated_out_mid_stream(service):
    """The stream that began under the old key finishes; a new request under it is refused."""
    import openai

    old, new = _client(service, KEY_B), _client(service, KEY_B_NEXT)
    stream = old.completions.create(model="tiny", prompt="rotation", max_tokens=64, stream=True, temperature=0,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    service.b_keys.write_text(KEY_B_NEXT + "\n")  # the ingress re-reads the file at most once a second

    def refused() -> bool:
        try:
            old.completions.create(model="tiny", prompt="x", max_tokens=1)
        except openai.AuthenticationError:
            return True
        return False

    wait_until(refused, "the rotated-out key refused", timeout_s=15, poll_s=0.2)
    chunks += list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 64
    assert new.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
    service.b_keys.write_text(KEY_B + "\n")
    wait_until(lambda: not refused(), "the first key back", timeout_s=15, poll_s=0.2)
    _no_leaks(service)
