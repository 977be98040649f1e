"""Per-request traces and the figures drawn from them.

Times are seconds since the measured run started (t0). A request's arrival is its
scheduled arrival time, not the moment a busy loop got round to submitting it, so time
spent queued behind a running step counts against the system, as it would for a client.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field

import numpy as np

# Timelines are downsampled to this many points in the JSON: enough for a plot, small on disk.
_MAX_TIMELINE_POINTS = 600


@dataclass
class RequestTrace:
    request_id: str
    arrival_s: float
    requested_tokens: int
    prompt_len: int
    messages: list[tuple[float, int]] = field(default_factory=list)
    """(time, number of new tokens) for every message that carried tokens."""

    def add(self, t: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.messages.append((t, num_tokens))

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.messages)

    @property
    def ttft_s(self) -> float | None:
        return self.messages[0][0] - self.arrival_s if self.messages else None

    @property
    def e2e_s(self) -> float | None:
        return self.messages[-1][0] - self.arrival_s if self.messages else None

    def itl_samples(self) -> list[float]:
        """One sample per token after the first: a message's gap is shared by the tokens it carries."""
        samples: list[float] = []
        if not self.messages:
            return samples
        first_t, first_n = self.messages[0]
        # Tokens that arrived together with the first one came at no extra wait.
        samples += [0.0] * (first_n - 1)
        prev = first_t
        for t, n in self.messages[1:]:
            samples += [(t - prev) / n] * n
            prev = t
        return samples


@dataclass
class SystemRun:
    """What a system runner hands back: raw traces and counters, no summary yet."""

    traces: list[RequestTrace]
    makespan_s: float
    computed_tokens: int
    """Tokens the system computed, wanted or not (static batches pad to their longest request)."""
    occupancy: list[tuple[float, float]] = field(default_factory=list)
    """(time, busy slots / slots) samples; each value holds until the next sample."""
    preemptions: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    notes: dict = field(default_factory=dict)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(arr.mean())}


def time_weighted_mean(samples: list[tuple[float, float]], end: float) -> float | None:
    """Mean of a step function that holds each sample's value until the next (the last until ``end``)."""
    if not samples:
        return None
    times = [t for t, _ in samples] + [max(end, samples[-1][0])]
    total = times[-1] - times[0]
    if total <= 0:
        return float(np.mean([v for _, v in samples]))
    return float(sum(v * (times[i + 1] - times[i]) for i, (_, v) in enumerate(samples)) / total)


def downsample(points: list[tuple[float, float]], limit: int = _MAX_TIMELINE_POINTS) -> list[list[float]]:
    """A step function as at most ``limit`` points: time-weighted means over equal time bins."""
    if len(points) <= limit:
        return [[round(t, 6), round(v, 6)] for t, v in points]
    times = np.array([t for t, _ in points])
    values = np.array([v for _, v in points])
    fine = 8
    grid = np.linspace(times[0], times[-1], limit * fine, endpoint=False)
    sampled = values[np.searchsorted(times, grid, side="right") - 1]
    means = sampled.reshape(limit, fine).mean(axis=1)
    return [[round(float(t), 6), round(float(v), 6)] for t, v in zip(grid[::fine], means)]


def summarize(run: SystemRun) -> dict:
    """Every figure of one system's run, JSON-ready."""
    traces = run.traces
    output_tokens = sum(t.output_tokens for t in traces)
    makespan = run.makespan_s if run.makespan_s > 0 else None
    itl = [s for t in traces for s in t.itl_samples()]
    hit_rate = None
    if run.prefix_cache_queries:
        hit_rate = run.prefix_cache_hits / run.prefix_cache_queries
    return {
        "num_requests": len(traces),
        "requested_tokens": sum(t.requested_tokens for t in traces),
        "output_tokens": output_tokens,
        # Same work for every system, or the comparison is void: each request got exactly what it asked.
        "exact_output_lengths": all(t.output_tokens == t.requested_tokens for t in traces),
        "computed_tokens": run.computed_tokens,
        "prompt_tokens": sum(t.prompt_len for t in traces),
        "makespan_s": run.makespan_s,
        "output_tokens_per_s": output_tokens / makespan if makespan else None,
        "requests_per_s": len(traces) / makespan if makespan else None,
        "ttft_s": percentiles([t.ttft_s for t in traces if t.ttft_s is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([t.e2e_s for t in traces if t.e2e_s is not None]),
        "mean_slot_occupancy": time_weighted_mean(run.occupancy, run.makespan_s),
        "preemptions": run.preemptions,
        "prefix_cache_hit_rate": hit_rate,
        "requests": [{"id": t.request_id, "arrival_s": t.arrival_s, "prompt_len": t.prompt_len,
                      "requested_tokens": t.requested_tokens, "output_tokens": t.output_tokens,
                      "ttft_s": t.ttft_s, "e2e_s": t.e2e_s,
                      "mean_itl_s": float(np.mean(t.itl_samples())) if t.output_tokens > 1 else None}
                     for t in traces],
        "occupancy_timeline": downsample(run.occupancy),
        "notes": run.notes,
    }


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)
