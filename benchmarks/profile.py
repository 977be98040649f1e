"""Where the engine's step time goes, at a fixed number of running requests.

For each level, that many requests are started with long outputs; once all of them are
past prefill, the engine's cumulative phase timers (EngineConfig profile=True) are read
before and after a run of pure decode steps, and the difference is shared out by phase.
"""

from __future__ import annotations

import math
from typing import Callable

from benchmarks.engine_systems import exact_params, make_engine
from benchmarks.systems import BenchSettings
from benchmarks.workloads import UniformInt

LEVELS = (1, 8, 32, 64)
PHASES = ("schedule", "prepare", "forward", "sample", "output")
PROMPT_LEN = 128


def _phase_delta(before: dict, after: dict) -> dict[str, float]:
    keys = set(PHASES) | set(before) | set(after)
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(keys)}


def _measure_level(engine, level: int, steps: int, vocab_size: int, tag: str) -> dict:
    import numpy as np

    rng = np.random.default_rng(level)
    ids = []
    for i in range(level):
        prompt = UniformInt(4, vocab_size - 1).sample(rng, PROMPT_LEN)
        ids.append(engine.add_request(prompt, exact_params(steps * 4 + 16), request_id=f"{tag}-{level}-{i}"))
    started: set[str] = set()
    while len(started) < level:
        for out in engine.step():
            if out.new_token_ids:
                started.add(out.request_id)
    before = engine.stats()
    running = []
    for _ in range(steps):
        engine.step()
        running.append(engine.stats().running)
    after = engine.stats()
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    phases = _phase_delta(before.step_time_s, after.step_time_s)
    total = sum(phases.values())
    shares = {k: (v / total if total > 0 else None) for k, v in phases.items()}
    forward = shares.get("forward")
    return {
        "running": level, "steps": steps, "min_running": min(running), "max_running": max(running),
        "step_ms": 1000 * total / steps, "decode_tokens_per_s": level * steps / total if total > 0 else None,
        "seconds": phases, "shares": shares,
        "outside_forward_share": None if forward is None else 1.0 - forward,
    }


def run_profile(settings: BenchSettings, steps: int, progress: Callable[[int], None],
                levels: tuple[int, ...] = LEVELS) -> dict:
    """Phase shares of the step time at each number of running requests."""
    top = max(levels)
    blocks = top * math.ceil((PROMPT_LEN + steps * 4 + 16) / settings.block_size) + 1
    engine = make_engine(settings, "continuous", profile=True, max_num_seqs=top, num_kv_blocks=blocks)
    # A short pass first, so one-off costs (allocations, first kernels) land in no level.
    _measure_level(engine, min(levels), 4, engine.vocab_size, "warmup")
    results = []
    for level in levels:
        results.append(_measure_level(engine, level, steps, engine.vocab_size, "profile"))
        progress(1)
    return {"levels": results, "phases": list(PHASES), "prompt_len": PROMPT_LEN,
            "note": "decode-only steps after every request's prefill; shares of the summed phase timers"}
