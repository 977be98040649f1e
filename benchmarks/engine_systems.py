"""slotserve's engine, driven step by step so every message can be timestamped."""

from __future__ import annotations

import time
from typing import Callable

from benchmarks.metrics import RequestTrace, SystemRun
from benchmarks.systems import BenchSettings
from benchmarks.workloads import BenchRequest, warmup_requests


def make_engine(settings: BenchSettings, scheduling: str = "continuous", profile: bool = False,
                max_num_seqs: int | None = None, num_kv_blocks: int | None = None, **options):
    """``options``: further engine options (EngineConfig.from_options)."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    slots = max_num_seqs or settings.max_num_seqs
    config = EngineConfig.from_options(
        settings.model_dir, max_num_seqs=slots,
        max_num_batched_tokens=max(settings.max_num_batched_tokens, slots),
        block_size=settings.block_size, num_kv_blocks=num_kv_blocks or settings.num_kv_blocks,
        enable_prefix_caching=settings.enable_prefix_caching, scheduling=scheduling, dtype=settings.dtype,
        device=settings.device, max_model_len=settings.max_model_len, kv_cache_dtype=settings.kv_cache_dtype,
        profile=profile, **options)
    return LLMEngine(config)


def exact_params(num_tokens: int):
    """Greedy, exactly ``num_tokens`` tokens: EOS is ignored so every system does the same work."""
    from engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)


def _warm_up(engine) -> None:
    for r in warmup_requests(engine.vocab_size):
        engine.add_request(list(r.prompt_token_ids), exact_params(r.output_len), request_id=r.request_id)
    while engine.has_unfinished():
        engine.step()


def drive(engine, requests: list[BenchRequest], progress: Callable[[int], None]) -> SystemRun:
    """Submit each request at its arrival time and step until all are done, timestamping every message."""
    _warm_up(engine)
    before = engine.stats()
    traces = {r.request_id: RequestTrace(r.request_id, r.arrival_s, r.output_len, len(r.prompt_token_ids))
              for r in requests}
    pending = list(requests)
    occupancy: list[tuple[float, float]] = []
    last_token_t = 0.0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            engine.add_request(list(r.prompt_token_ids), exact_params(r.output_len), request_id=r.request_id)
        if not engine.has_unfinished():
            occupancy.append((now, 0.0))
            time.sleep(max(pending[0].arrival_s - now, 0.0))
            continue
        outputs = engine.step()
        t = time.perf_counter() - t0
        for out in outputs:
            trace = traces.get(out.request_id)
            if trace is None:
                continue
            trace.add(t, len(out.new_token_ids))
            if out.new_token_ids:
                last_token_t = t
            if out.finished:
                if out.finish_reason == "abort":
                    raise RuntimeError(f"engine aborted {out.request_id} during the benchmark")
                progress(1)
        stats = engine.stats()
        occupancy.append((t, stats.running / stats.max_num_seqs))
    after = engine.stats()
    return SystemRun(
        list(traces.values()), last_token_t, after.num_generated_tokens - before.num_generated_tokens, occupancy,
        preemptions=after.num_preemptions - before.num_preemptions,
        prefix_cache_queries=after.prefix_cache_queries - before.prefix_cache_queries,
        prefix_cache_hits=after.prefix_cache_hits - before.prefix_cache_hits,
        notes={"steps": after.num_steps - before.num_steps,
               "kv_blocks_total": after.kv_blocks_total, "block_size": after.block_size})


def run_async_engine(requests: list[BenchRequest], settings: BenchSettings,
                     progress: Callable[[int], None]) -> SystemRun:
    """The same engine behind ``AsyncEngine`` (its loop thread, asyncio streams), in this process:
    what a served engine replica runs, without Ray, Serve or any network."""
    import asyncio

    from benchmarks.served_system import engine_options
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_options(settings.model_dir, **engine_options(settings))
    traces = {r.request_id: RequestTrace(r.request_id, r.arrival_s, r.output_len, len(r.prompt_token_ids))
              for r in requests}
    occupancy: list[tuple[float, float]] = []

    async def one(r: BenchRequest, t0: float, trace: RequestTrace | None) -> None:
        await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
        stream = engine.generate(list(r.prompt_token_ids), exact_params(r.output_len), request_id=r.request_id)
        async for out in stream:
            if trace is not None:
                t = time.perf_counter() - t0
                trace.add(t, len(out.new_token_ids))
                stats = engine.stats()
                occupancy.append((t, stats.running / stats.max_num_seqs))
        if trace is not None:
            progress(1)

    async def run_all(batch: list[BenchRequest], timed: bool) -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(r, t0, traces[r.request_id] if timed else None) for r in batch))

    try:
        asyncio.run(run_all(warmup_requests(engine.vocab_size), timed=False))
        before = engine.stats()
        asyncio.run(run_all(requests, timed=True))
        after = engine.stats()
    finally:
        engine.shutdown()
    last = max((t.messages[-1][0] for t in traces.values() if t.messages), default=0.0)
    return SystemRun(
        list(traces.values()), last, after.num_generated_tokens - before.num_generated_tokens, sorted(occupancy),
        preemptions=after.num_preemptions - before.num_preemptions,
        prefix_cache_queries=after.prefix_cache_queries - before.prefix_cache_queries,
        prefix_cache_hits=after.prefix_cache_hits - before.prefix_cache_hits,
        notes={"steps": after.num_steps - before.num_steps,
               "kv_blocks_total": after.kv_blocks_total, "block_size": after.block_size})


def run_continuous(requests: list[BenchRequest], settings: BenchSettings,
                   progress: Callable[[int], None]) -> SystemRun:
    return drive(make_engine(settings, "continuous"), requests, progress)


def run_static(requests: list[BenchRequest], settings: BenchSettings,
               progress: Callable[[int], None]) -> SystemRun:
    return drive(make_engine(settings, "static"), requests, progress)
