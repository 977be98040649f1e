"""Seeded workloads: prompt lengths and output lengths from named distributions, plus arrivals.

Workloads are token ids, not text: every system gets exactly the same prompts, and output
lengths are enforced (ignore EOS, fixed max tokens) so every system does the same work.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

# Token ids below this are left out of random prompts: special tokens live there in most vocabularies.
_FIRST_PLAIN_TOKEN = 4


@dataclass(frozen=True)
class UniformInt:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (isinstance(self.lo, int) and isinstance(self.hi, int) and 1 <= self.lo <= self.hi):
            raise ValueError(f"UniformInt needs integers 1 <= lo <= hi, got lo={self.lo!r}, hi={self.hi!r}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.lo, self.hi + 1, size=n)]

    def describe(self) -> str:
        return f"uniform integer in [{self.lo}, {self.hi}]"

    @property
    def max(self) -> int:
        return self.hi


@dataclass(frozen=True)
class Constant:
    value: int

    def __post_init__(self) -> None:
        if not (isinstance(self.value, int) and self.value >= 1):
            raise ValueError(f"Constant needs a positive integer, got {self.value!r}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [self.value] * n

    def describe(self) -> str:
        return f"constant {self.value}"

    @property
    def max(self) -> int:
        return self.value


@dataclass(frozen=True)
class Mixture:
    """Shares of uniform ranges, stratified: the shares hold exactly (largest remainder), order shuffled.

    Plain i.i.d. draws would make a 5 % class appear 0 or 6 times in 48 requests, and the
    comparison would change with the seed more than with the systems.
    """

    parts: tuple[tuple[float, int, int], ...]

    def __post_init__(self) -> None:
        if not self.parts or abs(sum(p for p, _, _ in self.parts) - 1.0) > 1e-9:
            raise ValueError(f"Mixture shares must sum to 1, got {[p for p, _, _ in self.parts]}")
        for _, lo, hi in self.parts:
            UniformInt(lo, hi)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        exact = [share * n for share, _, _ in self.parts]
        counts = [int(x) for x in exact]
        by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)
        for i in by_remainder[: n - sum(counts)]:
            counts[i] += 1
        values: list[int] = []
        for count, (_, lo, hi) in zip(counts, self.parts):
            values += UniformInt(lo, hi).sample(rng, count)
        rng.shuffle(values)
        return values

    def describe(self) -> str:
        return ", ".join(f"{share:.0%} uniform in [{lo}, {hi}]" for share, lo, hi in self.parts)

    @property
    def max(self) -> int:
        return max(hi for _, _, hi in self.parts)


@dataclass(frozen=True)
class Arrival:
    """``burst``: every request at t=0. ``poisson``: exponential gaps at ``rate`` requests/s."""

    kind: str = "burst"
    rate: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("burst", "poisson"):
            raise ValueError(f"arrival must be 'burst' or 'poisson:RATE', got {self.kind!r}")
        if self.kind == "poisson" and not (self.rate is not None and self.rate > 0):
            raise ValueError(f"poisson arrival needs a positive rate, got {self.rate!r}")

    @classmethod
    def parse(cls, text: str) -> "Arrival":
        if text == "burst":
            return cls()
        kind, _, rate = text.partition(":")
        if kind != "poisson" or not rate:
            raise ValueError(f"arrival must be 'burst' or 'poisson:RATE' (requests/s), got {text!r}")
        try:
            return cls("poisson", float(rate))
        except ValueError:
            raise ValueError(f"arrival rate must be a number, got {rate!r}") from None

    def times(self, rng: np.random.Generator, n: int) -> list[float]:
        if self.kind == "burst":
            return [0.0] * n
        return [float(t) for t in np.cumsum(rng.exponential(1.0 / self.rate, size=n))]

    def describe(self) -> str:
        return "all at t=0" if self.kind == "burst" else f"Poisson, {self.rate:g} requests/s"


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    summary: str
    num_requests: int
    prompt_len: UniformInt | Constant | Mixture
    output_len: UniformInt | Constant | Mixture
    shared_prefix_len: int = 0
    """Tokens of one common prefix put in front of every prompt (prompt_len is the suffix)."""
    arrival: Arrival = field(default_factory=Arrival)
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.num_requests, int) and self.num_requests >= 1):
            raise ValueError(f"num_requests must be a positive integer, got {self.num_requests!r}")
        if not (isinstance(self.shared_prefix_len, int) and self.shared_prefix_len >= 0):
            raise ValueError(f"shared_prefix_len must be a non-negative integer, got {self.shared_prefix_len!r}")

    @property
    def max_seq_len(self) -> int:
        return self.shared_prefix_len + self.prompt_len.max + self.output_len.max

    def describe(self) -> dict:
        return {
            "name": self.name, "summary": self.summary, "num_requests": self.num_requests,
            "prompt_len": self.prompt_len.describe(), "output_len": self.output_len.describe(),
            "shared_prefix_len": self.shared_prefix_len, "arrival": self.arrival.describe(),
            "seed": self.seed,
        }


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_s: float


def build_requests(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    """The request list of a workload, identical for a given spec, seed and vocabulary."""
    if vocab_size <= _FIRST_PLAIN_TOKEN:
        raise ValueError(f"vocab_size must exceed {_FIRST_PLAIN_TOKEN}, got {vocab_size}")
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    prefix = rng.integers(_FIRST_PLAIN_TOKEN, vocab_size, size=spec.shared_prefix_len).tolist()
    prompt_lens = spec.prompt_len.sample(rng, n)
    output_lens = spec.output_len.sample(rng, n)
    arrivals = spec.arrival.times(rng, n)
    requests = []
    for i in range(n):
        own = rng.integers(_FIRST_PLAIN_TOKEN, vocab_size, size=prompt_lens[i]).tolist()
        requests.append(BenchRequest(f"req-{i:04d}", tuple(prefix + own), output_lens[i], arrivals[i]))
    return sorted(requests, key=lambda r: r.arrival_s)


def warmup_requests(vocab_size: int, count: int = 4, prompt_len: int = 24, output_len: int = 8) -> list[BenchRequest]:
    """Short requests run before the clock starts; their own seed, so they warm no prefix of the workload."""
    rng = np.random.default_rng(10_000_019)
    return [BenchRequest(f"warmup-{i}", tuple(rng.integers(_FIRST_PLAIN_TOKEN, vocab_size, size=prompt_len).tolist()),
                         output_len, 0.0) for i in range(count)]


_MIXED = Mixture(((0.70, 16, 64), (0.25, 128, 512), (0.05, 1024, 2048)))

PRESETS: dict[str, WorkloadSpec] = {
    "mixed": WorkloadSpec(
        "mixed", "most answers short, some medium, a few long: where static batching wastes the most",
        48, UniformInt(16, 1024), _MIXED),
    "uniform": WorkloadSpec(
        "uniform", "every request alike (prompt 256, output 128): static batching's best case",
        48, Constant(256), Constant(128)),
    "shared-prefix": WorkloadSpec(
        "shared-prefix", "one long system prompt shared by every request, short own suffixes (prefix caching)",
        48, UniformInt(16, 128), UniformInt(32, 128), shared_prefix_len=768),
    "offline32": WorkloadSpec(
        "offline32", "32 requests at once, prompts 64-512, outputs 64-192: the offline run compared with vLLM",
        32, UniformInt(64, 512), UniformInt(64, 192)),
    "tiny": WorkloadSpec(
        "tiny", "a smoke test: a handful of short requests of mixed lengths",
        6, UniformInt(8, 40), Mixture(((0.5, 2, 6), (0.5, 8, 16)))),
}

def schedule_bound(requests: list[BenchRequest], slots: int) -> dict:
    """Decode steps each schedule needs if every request arrived at once: what batching alone can win.

    Static batches of ``slots`` in arrival order each last as long as their longest output;
    continuous batching needs at least the longest output, and at least total / slots steps.
    Their ratio is the speed-up to expect when a step costs the same however full it is
    (real steps differ a little: prefill chunks, fuller batches cost more); a target far above
    it needs more requests, not a faster step.
    """
    outs = [r.output_len for r in requests]
    static = sum(max(outs[i:i + slots]) for i in range(0, len(outs), slots))
    continuous = max(max(outs), -(-sum(outs) // slots))
    return {"static_steps": static, "continuous_steps_lower_bound": continuous,
            "ratio": static / continuous, "slots": slots}


def get_workload(name: str, *, num_requests: int | None = None, arrival: Arrival | None = None,
                 seed: int = 0) -> WorkloadSpec:
    """A preset by name, optionally with another request count, arrival process or seed."""
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(PRESETS)}")
    spec = PRESETS[name]
    return replace(spec, num_requests=spec.num_requests if num_requests is None else num_requests,
                   arrival=arrival or spec.arrival, seed=seed)
