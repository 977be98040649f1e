"""The client side of the served system: real gRPC streams, timestamped as they arrive.

Every request is one ``Generate`` server stream on a shared ``grpc.aio`` channel, sent at
its arrival time (all at once for a burst). Each streamed message is timestamped here, in
the client, so TTFT, ITL and end-to-end latency include everything on the serving path:
the gRPC proxy, the ingress (validation, routing, detokenization) and both Ray hops.

Also here: the light-load probe behind the "added TTFT" figure, run the same way against
the served app and against an in-process ``AsyncEngine`` (in a fresh process).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc
import numpy as np

from benchmarks.metrics import RequestTrace
from benchmarks.workloads import BenchRequest
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc

OCCUPANCY_PERIOD_S = 0.5  # each GetLoad costs the ingress a few ms: keep the probe light
PROBE_REQUESTS = 100  # enough for a p99 (the second largest)
PROBE_PROMPT_LEN = 16
PROBE_OUTPUT_LENS = (1, 2, 3, 4)
_PROBE_SEED = 20_000_003


def generate_request(r: BenchRequest) -> pb.GenerateRequest:
    """Token ids in, greedy, exactly ``output_len`` tokens out (EOS ignored)."""
    return pb.GenerateRequest(
        request_id=r.request_id, prompt_token_ids=pb.TokenIds(ids=list(r.prompt_token_ids)),
        sampling=pb.SamplingOptions(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))


def probe_requests(vocab_size: int) -> list[BenchRequest]:
    """Short prompts, 1-4 output tokens: a load light enough that TTFT is mostly path, not queueing."""
    rng = np.random.default_rng(_PROBE_SEED)
    return [BenchRequest(f"probe-{i}", tuple(rng.integers(4, vocab_size, size=PROBE_PROMPT_LEN).tolist()),
                         PROBE_OUTPUT_LENS[i % len(PROBE_OUTPUT_LENS)], 0.0) for i in range(PROBE_REQUESTS)]


async def _stream_one(stub, r: BenchRequest, trace: RequestTrace, t0: float) -> None:
    last = None
    async for msg in stub.Generate(generate_request(r)):
        trace.add(time.perf_counter() - t0, len(msg.token_ids))
        last = msg
    if last is None or last.finish_reason != pb.FINISH_REASON_LENGTH:
        reason = "no message" if last is None else pb.FinishReason.Name(last.finish_reason)
        raise RuntimeError(f"request {r.request_id} ended with {reason}, not after its {r.output_len} tokens")


async def _sample_occupancy(stub, t0: float, samples: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """Busy slots / slots from GetLoad, the product's own load report, every OCCUPANCY_PERIOD_S."""
    while not stop.is_set():
        report = await stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        samples.append((time.perf_counter() - t0, report.occupancy))
        try:
            await asyncio.wait_for(stop.wait(), OCCUPANCY_PERIOD_S)
        except asyncio.TimeoutError:
            pass


async def _run_streams(target: str, requests: list[BenchRequest], progress: Callable[[int], None],
                       sample_occupancy: bool) -> tuple[list[RequestTrace], float, list[tuple[float, float]]]:
    traces = {r.request_id: RequestTrace(r.request_id, r.arrival_s, r.output_len, len(r.prompt_token_ids))
              for r in requests}
    occupancy: list[tuple[float, float]] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = slotserve_pb2_grpc.SlotServeStub(channel)
        await channel.channel_ready()
        stop = asyncio.Event()
        t0 = time.perf_counter()

        async def one(r: BenchRequest) -> None:
            delay = r.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await _stream_one(stub, r, traces[r.request_id], t0)
            progress(1)

        sampler = asyncio.create_task(_sample_occupancy(stub, t0, occupancy, stop)) if sample_occupancy else None
        try:
            await asyncio.gather(*(one(r) for r in requests))
        finally:
            stop.set()
            if sampler is not None:
                await sampler
    last = max((t.messages[-1][0] for t in traces.values() if t.messages), default=0.0)
    return list(traces.values()), last, occupancy


def run_streams(target: str, requests: list[BenchRequest], progress: Callable[[int], None] = lambda n: None,
                sample_occupancy: bool = False) -> tuple[list[RequestTrace], float, list[tuple[float, float]]]:
    """All requests as concurrent gRPC streams: (traces, time of the last token, occupancy samples)."""
    return asyncio.run(_run_streams(target, requests, progress, sample_occupancy))


async def _sequential_ttft(target: str, requests: list[BenchRequest]) -> list[float]:
    ttfts = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = slotserve_pb2_grpc.SlotServeStub(channel)
        await channel.channel_ready()
        for r in requests:
            trace = RequestTrace(r.request_id, 0.0, r.output_len, len(r.prompt_token_ids))
            await _stream_one(stub, r, trace, time.perf_counter())
            ttfts.append(trace.ttft_s)
    return ttfts


def served_probe_ttft(target: str, vocab_size: int) -> list[float]:
    """Client-side TTFT of the probe requests, one at a time, through gRPC + Ray."""
    return asyncio.run(_sequential_ttft(target, probe_requests(vocab_size)))


def engine_probe_ttft(engine_options: dict, model_dir: str) -> list[float]:
    """The same probe against an in-process AsyncEngine with the same options (run in a fresh process).

    TTFT from the ``generate`` call to the first streamed output in the caller's event
    loop: the engine's own queueing, prefill and loop-thread hand-off, no serving path.
    """
    from engine.async_engine import AsyncEngine
    from engine.sampling import SamplingParams

    from benchmarks.workloads import warmup_requests

    engine = AsyncEngine.from_options(model_dir, **engine_options)

    async def one(r: BenchRequest) -> float | None:
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        start, first = time.perf_counter(), None
        async for out in engine.generate(list(r.prompt_token_ids), params, request_id=r.request_id):
            if first is None and out.new_token_ids:
                first = time.perf_counter() - start
        return first

    async def main() -> list[float]:
        for r in warmup_requests(engine.vocab_size):
            await one(r)
        return [await one(r) for r in probe_requests(engine.vocab_size)]

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def percentiles(values) -> dict:
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}


def added_ttft(served: list[float], engine: list[float]) -> dict:
    """Per probe request, served TTFT minus in-process TTFT; p50 / p90 / p99 of those and of each side."""
    if len(served) != len(engine) or not served:
        raise ValueError(f"probe runs differ in length: served {len(served)}, engine {len(engine)}")
    diffs = np.asarray(served) - np.asarray(engine)
    return {**percentiles(diffs), "served_ttft_s": percentiles(served),
            "engine_ttft_s": percentiles(engine), "requests": len(served), "prompt_len": PROBE_PROMPT_LEN,
            "output_lens": list(PROBE_OUTPUT_LENS)}
