"""Engine stats: the numbers routing, autoscaling and metrics read."""

from __future__ import annotations

from engine import LLMEngine, SamplingParams
from engine.kv.hashing import prefix_routing_keys


def test_stats_track_load_and_fragmentation(tiny_model_dir):
    eng = LLMEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64,
                                 max_num_seqs=3, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, n in enumerate([5, 30, 17, 9]):
        eng.add_request([3 + i] * n, params, request_id=f"r{i}")
    s = eng.stats()
    assert (s.running, s.waiting, s.max_num_seqs, s.kv_blocks_total) == (0, 4, 3, 64)
    eng.step()
    s = eng.stats()
    assert (s.running, s.waiting, s.free_slots) == (3, 1, 0)
    assert s.slot_occupancy == 1.0
    for _ in range(5):
        eng.step()
        s = eng.stats()
        # only the last, partial block of each running request holds empty slots
        assert s.kv_blocks_used * s.block_size - s.kv_tokens < s.running * s.block_size
        assert s.kv_blocks_used == sum(len(r.block_ids) for r in eng.scheduler.running)
    while eng.has_unfinished():
        eng.step()
    s = eng.stats()
    assert (s.running, s.waiting, s.kv_blocks_used, s.num_finished) == (0, 0, 0, 4)
    assert s.num_generated_tokens == 80 and s.num_steps > 0
    assert s.as_dict()["slot_occupancy"] == 0.0


def test_prefix_cache_counters(tiny_model_dir):
    eng = LLMEngine.from_options(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    shared = list(range(10, 42))  # 4 full blocks
    eng.add_request(shared + [1], params)
    while eng.has_unfinished():
        eng.step()
    eng.add_request(shared + [2, 3], params, request_id="second")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    s = eng.stats()
    assert s.prefix_cache_queries == 33 + 34
    assert s.prefix_cache_hits == 32
    assert outs[-1].num_cached_tokens == 32
    assert set(prefix_routing_keys(shared, 8)) <= set(eng.prefix_digest(100))  # what the router looks up
