"""Which engine replica should take a request: the slot-aware ranking, pure.

No ray and no engine imports: the request's block routing keys come in already computed
(``engine.kv.hashing.prefix_routing_keys``), so the whole policy is unit-tested
without a cluster. ``router.request_router`` feeds it from Ray Serve.

Each replica publishes its ``RoutingStats`` (Serve polls ``record_routing_stats``, which hands
them over as a plain dict, so routers of another release still read them). Stats that are missing,
malformed or older than ``stale_after_s`` make a replica "unknown": the router knows nothing
about its load and falls back to random choice.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Hashable, Iterable, Mapping, Sequence

import msgspec

from engine.kv.hashing import PREFIX_DIGEST_ENTRIES

DEFAULT_LOAD_SLACK = 0.25
ROUTING_DECISIONS_METRIC = "slotserve_routing_decisions"
"""Counter recorded by ``router.request_router``, label ``reason``: one of ``ROUTING_REASONS``."""
ROUTING_REASONS = ("prefix", "lora", "load", "fallback")
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


Count = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class RoutingStats(msgspec.Struct, kw_only=True):
    """One replica's load as it publishes it: what routers rank by, and what the ingress's admission,
    readiness and load reports (``/load``, ``GetLoad``) read."""

    free_slots: Count
    running: Count
    waiting: Count
    """Waiting in its engine, and taken by the replica but not yet counted there."""
    max_num_seqs: Positive
    kv_blocks_used: Count
    kv_blocks_total: Count
    block_size: Positive
    updated_at: float
    """``time.time()`` at the replica when taken."""
    healthy: bool = True
    replica_id: str = ""
    max_waiting: Count = 0
    prefix_hashes: list[int] = []
    """Routing keys of recently cached full blocks (``engine.kv.hashing.prefix_routing_keys``)."""
    link: str | None = None
    """Its engine link's address (``deployments.link``); None before the link listens."""
    link_requests: Count = 0
    lora_loaded: list[str] = []
    """LoRA adapters in its device slots."""
    lora_roots: dict[str, str] = {}
    """Adapter -> the root of its prefix-cache hash chain (hex)."""
    lora_paths: dict[str, str] = {}
    """Adapter -> its directory: where a replica lacking it loads it from."""
    lora_loads: Count = 0
    lora_evictions: Count = 0
    kv_usage: float = 0.0
    slot_occupancy: float = 0.0
    num_finished: Count = 0
    prefix_cache_hits: Count = 0
    prefix_cache_queries: Count = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.updated_at):
            raise ValueError(f"updated_at must be a time.time() value, got {self.updated_at!r}")

    @classmethod
    def unknown(cls, replica_id: str) -> "RoutingStats":
        """A replica that published nothing usable yet: no load known, not healthy."""
        return cls(free_slots=0, running=0, waiting=0, max_num_seqs=0, kv_blocks_used=0, kv_blocks_total=0,
                   block_size=0, updated_at=0.0, healthy=False, replica_id=replica_id)

    @classmethod
    def parse(cls, stats: Any) -> "RoutingStats":
        """From what Serve delivers (a dict); msgspec.ValidationError names what is wrong."""
        return stats if isinstance(stats, cls) else msgspec.convert(stats, cls)

    def as_dict(self) -> dict[str, Any]:
        """For Serve's ``record_routing_stats``."""
        return msgspec.structs.asdict(self)


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load as the router sees it (from its published routing stats)."""

    replica_id: Hashable
    known: bool = False
    """False when the stats were missing or malformed (see ``problem``)."""
    problem: str = ""
    free_slots: int = 0
    running: int = 0
    waiting: int = 0
    max_num_seqs: int = 1
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 1
    prefix_hashes: frozenset = field(default=frozenset(), repr=False)
    healthy: bool = True
    updated_at: float = 0.0
    lora_loaded: frozenset = frozenset()
    """LoRA adapters in the replica's device slots: a request for one runs without loading it."""
    lora_roots: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Adapter -> the root of its prefix-cache hash chain (hex): an adapter request's prefix keys."""

    @classmethod
    def from_stats(cls, replica_id: Hashable, stats: Any) -> ReplicaLoad:
        """Parse a replica's routing stats; never raises (a bad replica must not stop routing)."""
        return read_stats(replica_id, stats)[1]

    @classmethod
    def of(cls, replica_id: Hashable, s: RoutingStats) -> ReplicaLoad:
        return cls(replica_id, known=True, free_slots=s.free_slots, running=s.running, waiting=s.waiting,
                   max_num_seqs=s.max_num_seqs, kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
                   block_size=s.block_size, prefix_hashes=frozenset(s.prefix_hashes), healthy=s.healthy,
                   updated_at=s.updated_at, lora_loaded=frozenset(s.lora_loaded), lora_roots=s.lora_roots)

    @property
    def kv_blocks_free(self) -> int:
        return max(self.kv_blocks_total - self.kv_blocks_used, 0)

    @property
    def load(self) -> float:
        """Queued work per slot, or the KV fill fraction when that is higher."""
        slots = (self.running + self.waiting) / self.max_num_seqs
        kv = self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
        return max(slots, kv)

    def is_fresh(self, now: float, stale_after_s: float) -> bool:
        # A timestamp slightly in the future (clock skew between hosts) still counts as fresh.
        return self.known and now - self.updated_at <= stale_after_s

    def prefix_match(self, request_hashes: Sequence[int]) -> int:
        """How many leading blocks of the request this replica has cached.

        Only a contiguous prefix counts: a cached block is reusable only when every
        block before it is reused too (the hashes are chained).
        """
        n = 0
        for h in request_hashes:
            if h not in self.prefix_hashes:
                break
            n += 1
        return n

    def has_room(self, prompt_len: int, matched_blocks: int) -> bool:
        """A free slot, and KV blocks for the uncached part of the prompt (at least one block)."""
        if self.free_slots <= 0:
            return False
        if not self.kv_blocks_total:  # the replica does not report KV: slots are the only limit
            return True
        needed = max(-(-prompt_len // self.block_size) - matched_blocks, 1)
        return self.kv_blocks_free >= needed

    def with_extra_running(self, n: int) -> ReplicaLoad:
        """This load plus ``n`` requests sent since the stats were taken (not yet in them)."""
        if n <= 0:
            return self
        return replace(self, running=self.running + n, free_slots=max(self.free_slots - n, 0))


def read_stats(replica_id: Hashable, stats: Any) -> tuple[RoutingStats | None, ReplicaLoad]:
    """What a replica published, parsed (None when there is nothing usable) and as a load."""
    if not stats:
        return None, ReplicaLoad(replica_id, problem="no stats yet")
    try:
        parsed = RoutingStats.parse(stats)
    except msgspec.ValidationError as exc:
        return None, ReplicaLoad(replica_id, problem=str(exc))
    return parsed, ReplicaLoad.of(replica_id, parsed)


@dataclass(frozen=True)
class Ranking:
    ranks: list[list[Hashable]]
    """Replica ids, best first; Serve tries each inner list in turn (lowest queue length within one)."""
    saturated: bool
    """No replica is known to have room: the request will queue in an engine (or Serve backs off)."""
    reason: str = "load"
    """Why the first choice: ``prefix`` (a replica with room holding the request's prefix),
    ``lora`` (the request's adapter picked among comparable replicas: one holding it, or its
    home), ``load`` (a replica with room, on load alone) or ``fallback`` (none known to have
    room: stats missing or stale, all full, or unhealthy)."""


def rank_replicas(
    candidates: Sequence[ReplicaLoad],
    request_hashes: Sequence[int],
    now: float,
    rng: random.Random,
    stale_after_s: float,
    *,
    prompt_len: int = 0,
    load_slack: float = DEFAULT_LOAD_SLACK,
    adapter: str | None = None,
) -> Ranking:
    """Rank replicas for one request, best first. Every candidate appears exactly once.

    Tiers, in order:

    1. Fresh, healthy replicas **with room** (a free slot and KV blocks for the uncached
       part of the prompt), one per rank. Among them, the *comparable* ones are those whose
       ``load`` is within ``load_slack`` of the least loaded one (0.25: a quarter of the
       slots). Comparable replicas are ordered by whether they hold the request's LoRA
       ``adapter`` in a slot, then by longest cached prefix of the request (contiguous
       leading blocks), then, for an adapter request, by the adapter's ``home`` order of
       replicas (rendezvous hashing: the same for every router, and no stats needed), then
       lower load, then at random; so a loaded adapter or a prefix hit of one block beats a
       replica with slightly more free slots, and an adapter no replica reports yet goes where
       its earlier requests went. The rest follow by load, then adapter, then prefix, then at
       random: affinity never sends work to a much busier replica, so a hot adapter spreads to
       more replicas as its load grows.
    2. Replicas with **missing or stale** stats (older than ``stale_after_s``): power of
       two choices; two of them drawn at random share one rank (Serve takes the one with
       the shorter queue), the others follow in one rank.
    3. Fresh replicas that are **full** (no free slot or no KV headroom), one per rank,
       least loaded first: the request will wait in that engine's queue.
    4. Replicas reporting themselves **unhealthy**, in one last rank.

    Ties are broken with ``rng`` (one draw per candidate, in candidate order), so a
    seeded ``rng`` gives a reproducible ranking.
    """
    room: list[tuple[float, tuple[bool, int, int], float, Hashable]] = []  # (load, (adapter, blocks, home), tie, id)
    full: list[tuple[float, float, Hashable]] = []
    unknown: list[Hashable] = []
    sick: list[Hashable] = []
    for c in candidates:
        tie = rng.random()
        if not c.is_fresh(now, stale_after_s):
            unknown.append(c.replica_id)
        elif not c.healthy:
            sick.append(c.replica_id)
        else:
            matched = c.prefix_match(request_hashes)
            if c.has_room(prompt_len, matched):
                home = 0 if adapter is None else adapter_home(adapter, c.replica_id)
                room.append((c.load, (adapter is not None and adapter in c.lora_loaded, matched, home), tie,
                             c.replica_id))
            else:
                full.append((c.load, tie, c.replica_id))

    order, comparable = _order_with_room(room, load_slack)
    ranks: list[list[Hashable]] = [[rid] for rid in order]
    reason = "fallback"
    if ranks:
        first = ranks[0][0]
        has_adapter, blocks, _ = next(m for _, m, _, rid in room if rid == first)
        homed = adapter is not None and comparable > 1
        reason = "prefix" if blocks > 0 else "lora" if has_adapter or homed else "load"
    ranks += _power_of_two(unknown, rng)
    ranks += [[rid] for _, _, rid in sorted(full, key=lambda x: x[:2])]
    if sick:
        ranks.append(sick)
    return Ranking(ranks=ranks, saturated=not room and not unknown, reason=reason)


def adapter_home(adapter: str, replica_id: Hashable) -> int:
    """The replica's rendezvous score for ``adapter``: the highest-scoring replica is its home. Stable
    across processes (not Python's salted ``hash``), so every router sends it the same way."""
    digest = hashlib.blake2b(f"{adapter}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _order_with_room(room: list[tuple[float, tuple[bool, int, int], float, Hashable]], load_slack: float
                     ) -> tuple[list[Hashable], int]:
    """(the replicas in order, how many lead as comparable: within ``load_slack`` of the least loaded)."""
    if not room:
        return [], 0
    ceiling = min(load for load, _, _, _ in room) + load_slack + 1e-9
    comparable = sorted((x for x in room if x[0] <= ceiling),
                        key=lambda x: (-x[1][0], -x[1][1], -x[1][2], x[0], x[2]))
    busier = sorted((x for x in room if x[0] > ceiling), key=lambda x: (x[0], -x[1][0], -x[1][1], x[2]))
    return [x[3] for x in comparable + busier], len(comparable)


def _power_of_two(unknown: list[Hashable], rng: random.Random) -> list[list[Hashable]]:
    if not unknown:
        return []
    ids = list(unknown)
    rng.shuffle(ids)
    return [ids[:2], ids[2:]] if len(ids) > 2 else [ids]


def make_prefix_digest(hashes: Iterable[int], max_entries: int = PREFIX_DIGEST_ENTRIES) -> list[int]:
    """The ``prefix_hashes`` a replica publishes: the newest ``max_entries`` distinct hashes.

    ``hashes`` (``engine.kv.hashing.routing_key`` values) are ordered oldest to newest, as
    ``BlockManager.recent_routing_keys`` returns them. The digest travels in every
    routing-stats broadcast: ``PREFIX_DIGEST_ENTRIES``, as the replicas publish.
    """
    if not _is_int(max_entries) or max_entries < 0:
        raise ValueError(f"max_entries must be an integer >= 0, got {max_entries!r}")
    newest_first: list[int] = []
    seen: set[int] = set()
    for h in reversed(list(hashes)):
        if not _is_int(h) or not 0 <= h < 2**63:
            raise ValueError(f"hashes must be 63-bit routing keys from engine.kv.hashing, got {h!r}")
        if h in seen:
            continue
        if len(newest_first) >= max_entries:
            break
        seen.add(h)
        newest_first.append(h)
    newest_first.reverse()
    return newest_first


@dataclass(frozen=True)
class RouterSettings:
    """The ``request_router_kwargs`` of ``SlotAwareRequestRouter``, validated."""

    stale_after_s: float = 5.0
    """Stats older than this are ignored (the replica is ranked as unknown)."""
    block_size: int = 16
    """Block size for the request's hashes when no replica has reported one yet."""
    max_prefix_blocks: int = 256
    """Hash at most this many leading blocks of a prompt (bounds router CPU per request)."""
    load_slack: float = DEFAULT_LOAD_SLACK
    """How much busier (in load units) a replica may be and still win on a prefix hit."""
    seed: int | None = None
    """Seed for tie-breaking; None draws from the OS."""
    model_name: str = ""
    """The ``model_name`` label of the router's metrics (the served model name)."""
    lora_affinity: bool = True
    """Prefer comparable replicas that hold the request's LoRA adapter; off: load and prefix only."""

    def __post_init__(self) -> None:
        if not _is_number(self.stale_after_s) or self.stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be a number > 0, got {self.stale_after_s!r}")
        if not _is_int(self.block_size) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if not _is_int(self.max_prefix_blocks) or self.max_prefix_blocks < 0:
            raise ValueError(f"max_prefix_blocks must be an integer >= 0, got {self.max_prefix_blocks!r}")
        if not _is_number(self.load_slack) or not 0 <= self.load_slack <= 1:
            raise ValueError(f"load_slack must be a number in [0, 1], got {self.load_slack!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.model_name, str):
            raise ValueError(f"model_name must be a string, got {self.model_name!r}")
        if not isinstance(self.lora_affinity, bool):
            raise ValueError(f"lora_affinity must be true or false, got {self.lora_affinity!r}")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> RouterSettings:
        allowed = [f for f in cls.__dataclass_fields__]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise ValueError(f"unknown request_router_kwargs {unknown}; allowed: {allowed}")
        return cls(**kwargs)
