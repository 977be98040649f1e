"""The slot-aware ranking (router.policy), without Ray."""

from __future__ import annotations

import collections
import random
from collections import Counter

import pytest

from engine.kv.block_manager import BlockManager
from engine.kv.hashing import ROOT_HASH, prefix_routing_keys
from router.policy import ReplicaLoad, RouterSettings, adapter_home, make_prefix_digest, rank_replicas

NOW = 1_000.0
BS = 4
PROMPT = list(range(100, 132))  # 8 full blocks of 4
HASHES = prefix_routing_keys(PROMPT, BS)


def stats(*, running=0, max_num_seqs=8, waiting=0, kv_used=0, kv_total=100, prefix=(), healthy=True,
          updated_at=NOW, free_slots=None):
    return {
        "free_slots": max(max_num_seqs - running, 0) if free_slots is None else free_slots,
        "running": running, "waiting": waiting, "max_num_seqs": max_num_seqs,
        "kv_blocks_used": kv_used, "kv_blocks_total": kv_total, "block_size": BS,
        "prefix_hashes": list(prefix), "healthy": healthy, "updated_at": updated_at,
    }


def load(rid, **kw) -> ReplicaLoad:
    return ReplicaLoad.from_stats(rid, stats(**kw))


def rank(cands, hashes=HASHES, *, seed=0, prompt_len=len(PROMPT), stale_after_s=5.0, **kw):
    return rank_replicas(cands, hashes, NOW, random.Random(seed), stale_after_s, prompt_len=prompt_len, **kw)


def flat(ranking):
    return [rid for r in ranking.ranks for rid in r]


# ----------------------------------------------------------------------------- parsing
def test_from_stats_reads_the_contract():
    r = load("a", running=3, waiting=1, kv_used=40, prefix=HASHES[:2])
    assert r.known and r.free_slots == 5 and r.kv_blocks_free == 60
    assert r.load == pytest.approx(0.5)  # (3 running + 1 waiting) / 8 beats kv 0.4
    assert r.prefix_match(HASHES) == 2


@pytest.mark.parametrize("bad, problem", [
    ({}, "no stats yet"),
    ({**stats(), "running": "3"}, "running"),
    ({**stats(), "free_slots": -1}, "free_slots"),
    ({**stats(), "max_num_seqs": 0}, "max_num_seqs"),
    ({k: v for k, v in stats().items() if k != "updated_at"}, "updated_at"),
    ({**stats(), "prefix_hashes": 7}, "prefix_hashes"),
])
def test_malformed_stats_make_the_replica_unknown(bad, problem):
    r = ReplicaLoad.from_stats("a", bad)
    assert not r.known and problem in r.problem


def test_only_a_contiguous_cached_prefix_counts():
    # Blocks 1..7 cached but not block 0: nothing is reusable.
    assert load("a", prefix=HASHES[1:]).prefix_match(HASHES) == 0
    # Blocks 0, 1, 3: only the first two count.
    assert load("a", prefix=[HASHES[0], HASHES[1], HASHES[3]]).prefix_match(HASHES) == 2
    assert load("a", prefix=HASHES).prefix_match(HASHES) == len(HASHES)
    assert load("a", prefix=HASHES).prefix_match([]) == 0


def test_with_extra_running_takes_slots():
    r = load("a", running=6).with_extra_running(3)
    assert (r.running, r.free_slots) == (9, 0)
    assert not r.has_room(4, 0)


# ----------------------------------------------------------------------------- ranking
def test_free_slots_beat_a_full_replica():
    full = load("full", running=8)
    free = load("free", running=7)
    ranking = rank([full, free])
    assert ranking.ranks == [["free"], ["full"]]
    assert not ranking.saturated


def test_kv_headroom_counts_as_room():
    # A free slot but only 5 free KV blocks for an 8-block prompt: full for this request.
    short_kv = load("short_kv", running=0, kv_used=95)
    busy = load("busy", running=6)
    assert rank([short_kv, busy]).ranks == [["busy"], ["short_kv"]]
    # The cached part of the prompt needs no new blocks: with 4 blocks cached it fits.
    cached = load("cached", running=0, kv_used=95, prefix=HASHES[:4])
    assert rank([cached, busy]).ranks[0] == ["cached"]


def test_prefix_hit_wins_among_comparable_replicas():
    hit = load("hit", running=2, prefix=HASHES[:1])
    idle = load("idle", running=0)
    assert rank([idle, hit]).ranks[0] == ["hit"]
    longer = load("longer", running=2, prefix=HASHES[:5])
    assert flat(rank([idle, hit, longer])) == ["longer", "hit", "idle"]


def test_prefix_hit_does_not_win_over_a_much_less_loaded_replica():
    hit = load("hit", running=7, prefix=HASHES)  # one free slot left, load 0.875
    idle = load("idle", running=1)               # load 0.125
    assert flat(rank([hit, idle])) == ["idle", "hit"]
    # Widening the slack lets the hit win.
    assert flat(rank([hit, idle], load_slack=1.0)) == ["hit", "idle"]


def test_prefix_hit_never_beats_room():
    full_hit = load("full_hit", running=8, prefix=HASHES)
    free = load("free", running=7)
    assert flat(rank([full_hit, free])) == ["free", "full_hit"]


def test_lower_load_breaks_equal_prefix():
    a = load("a", running=4)
    b = load("b", running=2)
    assert flat(rank([a, b], hashes=[])) == ["b", "a"]


def test_stale_and_missing_stats_use_power_of_two_after_fresh_room():
    cands = [
        load("fresh", running=4),
        load("full", running=8),
        load("old1", updated_at=NOW - 60),
        load("old2", updated_at=NOW - 60),
        ReplicaLoad.from_stats("missing", {}),
        ReplicaLoad.from_stats("garbled", {"running": "x"}),
    ]
    unknown = {"old1", "old2", "missing", "garbled"}
    pairs = Counter()
    for seed in range(400):
        ranks = rank(cands, seed=seed).ranks
        assert ranks[0] == ["fresh"]
        assert len(ranks[1]) == 2 and set(ranks[1]) <= unknown  # two random choices share a rank
        assert set(ranks[1]) | set(ranks[2]) == unknown
        assert ranks[3] == ["full"] and len(ranks) == 4
        pairs.update(ranks[1])
    # Every unknown replica is drawn into the pair about half the time.
    assert all(120 < pairs[rid] < 280 for rid in unknown), pairs


def test_stale_threshold():
    r = load("a", updated_at=NOW - 4.9)
    assert r.is_fresh(NOW, 5.0) and not r.is_fresh(NOW + 0.2, 5.0)
    assert load("a", updated_at=NOW + 3).is_fresh(NOW, 5.0)  # clock skew ahead: still fresh


def test_all_full_are_all_ranked_least_loaded_first_and_flagged():
    cands = [load("a", running=8, waiting=4), load("b", running=8), load("c", running=8, waiting=1)]
    ranking = rank(cands)
    assert ranking.saturated
    assert ranking.ranks == [["b"], ["c"], ["a"]]


def test_unknown_replicas_clear_the_saturated_flag():
    ranking = rank([load("a", running=8), ReplicaLoad.from_stats("b", {})])
    assert not ranking.saturated and flat(ranking) == ["b", "a"]


def test_unhealthy_replicas_come_last():
    ranking = rank([load("sick", healthy=False), load("full", running=8), load("ok", running=1)])
    assert ranking.ranks == [["ok"], ["full"], ["sick"]]


def test_ties_are_broken_randomly_and_spread():
    cands = [load(rid, running=2) for rid in "abc"]
    rng = random.Random(7)
    firsts = Counter(rank_replicas(cands, HASHES, NOW, rng, 5.0).ranks[0][0] for _ in range(3000))
    assert set(firsts) == {"a", "b", "c"}
    assert all(850 < n < 1150 for n in firsts.values()), firsts


def test_seeded_rng_is_deterministic():
    cands = [load(rid, running=i % 3) for i, rid in enumerate("abcdef")] + [load("old", updated_at=0.0)]
    assert rank(cands, seed=3).ranks == rank(cands, seed=3).ranks
    orders = {tuple(flat(rank(cands, seed=s))) for s in range(20)}
    assert len(orders) > 1


def test_every_candidate_is_ranked_exactly_once():
    rng = random.Random(1)
    for _ in range(200):
        cands = []
        for i in range(rng.randint(1, 8)):
            kind = rng.random()
            if kind < 0.2:
                cands.append(ReplicaLoad.from_stats(i, {}))
            else:
                cands.append(load(i, running=rng.randint(0, 8), kv_used=rng.randint(0, 100),
                                  prefix=HASHES[:rng.randint(0, 8)], healthy=rng.random() > 0.1,
                                  updated_at=NOW - rng.choice([0, 10])))
        ids = flat(rank_replicas(cands, HASHES, NOW, rng, 5.0, prompt_len=len(PROMPT)))
        assert sorted(ids) == list(range(len(cands)))


# ----------------------------------------------------------------------------- helpers
def test_make_prefix_digest_keeps_newest_distinct():
    assert make_prefix_digest([1, 2, 3, 2, 4], 3) == [3, 2, 4]
    assert make_prefix_digest([1, 2], 10) == [1, 2]
    assert make_prefix_digest([1, 2], 0) == []
    digest = make_prefix_digest(HASHES, 512)
    assert load("a", prefix=digest).prefix_match(HASHES) == len(HASHES)


def test_router_keys_are_the_engines_digest_keys():
    bm = BlockManager(16, BS)
    blocks, parent = bm.allocate(bm.blocks_needed(len(PROMPT))), ROOT_HASH
    for i in range(len(PROMPT) // BS):  # what the scheduler does as the prompt is computed
        parent = bm.register_full_block(blocks[i], parent, PROMPT[i * BS:(i + 1) * BS])
    published = make_prefix_digest(bm.recent_routing_keys(512))
    assert published == HASHES and load("a", prefix=published).prefix_match(HASHES) == len(HASHES)
    bm.free(blocks)


@pytest.mark.parametrize("hashes, n, field", [([1], -1, "max_entries"), ([1], 1.5, "max_entries"),
                                               (["x"], 4, "hashes"), ([-3], 4, "hashes"),
                                               ([2**63], 4, "hashes")])
def test_make_prefix_digest_rejects_bad_input(hashes, n, field):
    with pytest.raises(ValueError, match=field):
        make_prefix_digest(hashes, n)


@pytest.mark.parametrize("kwargs, field", [
    ({"stale_after_s": 0}, "stale_after_s"), ({"block_size": 0}, "block_size"),
    ({"max_prefix_blocks": -1}, "max_prefix_blocks"), ({"load_slack": 2}, "load_slack"),
    ({"seed": "x"}, "seed"), ({"stale_after": 1}, "unknown request_router_kwargs"),
])
def test_router_settings_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterSettings.from_kwargs(kwargs)


# ----------------------------------------------------------------------------- LoRA adapters
def lora_load(rid, loaded=(), **kw) -> ReplicaLoad:
    return ReplicaLoad.from_stats(rid, {**stats(**kw), "lora_loaded": list(loaded), "lora_roots": {}})


def test_a_replica_holding_the_adapter_wins_among_comparable_loads():
    cands = [lora_load("a", running=1), lora_load("b", running=2, loaded=["sql"]), lora_load("c", running=1)]
    ranking = rank(cands, [], adapter="sql")
    assert flat(ranking)[0] == "b" and ranking.reason == "lora"
    assert rank(cands, []).reason == "load" and flat(rank(cands, []))[0] in ("a", "c")  # base model: load only
    assert flat(rank(cands, [], adapter="other"))[0] in ("a", "c")


def test_a_hot_adapter_spreads_once_its_replica_is_much_busier():
    """Affinity holds within the load slack only: past it, a replica without the adapter loads it."""
    cands = [lora_load("a", running=6, loaded=["sql"]), lora_load("b", running=1)]
    assert flat(rank(cands, [], adapter="sql")) == ["b", "a"]


def test_an_adapter_no_replica_holds_goes_home_whatever_the_router():
    """Rendezvous order: every router (any seed) sends an unseen adapter's requests to the same
    replica among comparable ones, different adapters to different replicas, never past the slack."""
    cands = [lora_load(r, running=1 + (r == "b")) for r in "abcd"]
    firsts = {a: {flat(rank(cands, [], adapter=a, seed=s))[0] for s in range(8)} for a in (f"x{i}" for i in range(32))}
    assert all(len(f) == 1 for f in firsts.values())  # one home per adapter, whatever the seed
    for a, (first,) in firsts.items():
        assert first == max("abcd", key=lambda r: adapter_home(a, r))
    homes = collections.Counter(f for (f,) in firsts.values())
    assert set(homes) == set("abcd") and min(homes.values()) >= 3
    assert rank(cands, [], adapter="x0").reason == "lora" and rank(cands, []).reason == "load"
    home = max("ab", key=lambda r: adapter_home("x0", r))
    busy = [lora_load(r, running=6 if r == home else 1) for r in "ab"]
    ranking = rank(busy, [], adapter="x0")
    assert flat(ranking)[0] != home and ranking.reason == "load"  # one comparable replica: load decided


def test_a_prefix_hit_counts_after_the_adapter():
    cands = [lora_load("a", running=1, prefix=HASHES), lora_load("b", running=1, loaded=["sql"])]
    assert flat(rank(cands, HASHES, adapter="sql"))[0] == "b"
    both = [lora_load("a", running=1, loaded=["sql"], prefix=HASHES), lora_load("b", running=1, loaded=["sql"])]
    ranking = rank(both, HASHES, adapter="sql")
    assert flat(ranking)[0] == "a" and ranking.reason == "prefix"


@pytest.mark.parametrize("field, value", [("lora_loaded", "sql"), ("lora_loaded", [1]), ("lora_roots", ["x"]),
                                          ("lora_roots", {"sql": 5})])
def test_malformed_adapter_stats_make_the_replica_unknown(field, value):
    r = ReplicaLoad.from_stats("a", {**stats(), field: value})
    assert not r.known and field in r.problem
