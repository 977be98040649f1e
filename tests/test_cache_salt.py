"""``cache_salt`` (vLLM's per-request field): a salted prompt's cached blocks are shared only with
requests of the same salt, so ``cached_tokens`` tells a client nothing about anyone else's prompts,
and the router looks the prompt up under the chain its engine caches it in."""

from __future__ import annotations

import pytest

from deployments.contract import EngineRequest
from engine import LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.kv.hashing import MAX_CACHE_SALT_CHARS, ROOT_HASH, prefix_routing_keys, salted_root
from router.policy import ReplicaLoad, RouterSettings
from router.request_router import request_prefix_keys

SHARED = list(range(10, 42))  # 4 full blocks of 8
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _run(eng: LLMEngine, salt: str | None, tail: int) -> tuple[int, list[int]]:
    eng.add_request(SHARED + [tail], PARAMS, request_id=f"{salt}-{tail}", cache_salt=salt)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs[-1].num_cached_tokens, [t for out in outs for t in out.new_token_ids]


@pytest.fixture
def engine(tiny_model_dir):
    return LLMEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64)


def test_a_salted_prompt_shares_cached_blocks_only_with_its_own_salt(engine):
    first_a, tokens_a = _run(engine, "tenant-a", 1)
    assert first_a == 0
    assert _run(engine, "tenant-a", 2)[0] == 32  # the same salt: the prompt's 4 blocks are hits
    cached_b, tokens_b = _run(engine, "tenant-b", 1)
    assert cached_b == 0 and tokens_b == tokens_a  # another salt: no hit, the same tokens
    assert _run(engine, None, 3)[0] == 0  # unsalted requests do not see salted blocks
    assert _run(engine, None, 4)[0] == 32  # ... and share theirs as before
    engine.block_manager.check_invariants()


def _routed(salt: str | None) -> EngineRequest:
    return EngineRequest(request_id="r", prompt_token_ids=SHARED, params=SamplingParams(), cache_salt=salt)


def test_the_router_looks_a_salted_prompt_up_in_the_engines_chain(engine):
    _run(engine, "tenant-a", 1)
    digest = set(engine.prefix_digest(100))
    load = ReplicaLoad.from_stats("r", {"free_slots": 8, "running": 0, "waiting": 0, "max_num_seqs": 8,
                                        "kv_blocks_used": 0, "kv_blocks_total": 64, "block_size": 8,
                                        "updated_at": 0.0})
    settings = RouterSettings()
    salted = request_prefix_keys(_routed("tenant-a"), [load], settings)
    assert len(salted) == 4 and set(salted) <= digest
    assert salted == prefix_routing_keys(SHARED, 8, root=salted_root(ROOT_HASH, "tenant-a"))
    for other in (_routed(None), _routed("tenant-b")):
        keys = request_prefix_keys(other, [load], settings)
        assert len(keys) == 4 and not set(keys) & digest
    assert request_prefix_keys(_routed(""), [load], settings) == []


@pytest.mark.parametrize("salt", ["", "s" * (MAX_CACHE_SALT_CHARS + 1), 7, b"bytes"])
def test_a_bad_salt_is_refused_by_name_and_queues_nothing(engine, salt):
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        engine.add_request(SHARED, PARAMS, request_id="bad", cache_salt=salt)
    assert not engine.has_unfinished() and "bad" not in engine.requests
