"""Observability overhead: tokens/s with tracing and metrics on vs off, one workload, one process.

    python -m benchmarks.observability                        # tiny random Llama, about a minute
    python -m benchmarks.observability --model smollm2-135m --rounds 5

One serving stack (engine replica + frontend + the gRPC Generate method, no Serve proxy) run
"off", as slotserve runs by default (no exporter: no tracing; outside Ray: no metrics), and "on":
Ray's metrics (a local Ray is started for them) and an OpenTelemetry SDK provider sampling every
request, batch-exporting to memory. Rounds alternate off / on (which goes first alternates too)
over the same requests, all sent at once; the report gives the median of each round's on / off
tokens/s (target: at least 0.97, i.e. within 3 %). On a busy machine the rounds are noisy, so it
also meters the CPU time spent inside the tracing and metrics hooks (thread CPU time, which other
load does not inflate) as a share of the "on" rounds' CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.workloads import Constant, UniformInt, WorkloadSpec, build_requests

TARGET_RATIO = 0.97


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.observability",
                                description="Tokens/s with tracing + metrics on vs off (same requests, one process).")
    p.add_argument("--model", default=None,
                   help="local HF model directory or built-in name (default: a tiny random Llama)")
    p.add_argument("--requests", type=int, default=32, help="requests per round, sent at once (default 32)")
    p.add_argument("--output-len", type=int, default=64, help="tokens each request generates (default 64)")
    p.add_argument("--slots", type=int, default=8, help="max_num_seqs (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per side, alternating (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-ray-metrics", action="store_true", help="'on' without Ray's metrics (tracing only)")
    p.add_argument("--out-dir", default="bench-out", help="where observability.json goes (default bench-out)")
    return p


class _Context:
    """What the gRPC method reads of Serve's context: no metadata (a client without a trace)."""

    def invocation_metadata(self):
        return ()

    def set_code(self, code) -> None:
        pass

    def set_details(self, details) -> None:
        pass


class _HookMeter:
    """CPU seconds spent inside the observability hooks, in whichever thread calls them."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def call(self, fn, *args, **kwargs):
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - t


def _metered_exporter(meter: _HookMeter):
    """Spans kept in memory; the batch processor's exports are metered (its own thread)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    class MeteredExporter(InMemorySpanExporter):
        def export(self, spans):
            return meter.call(super().export, spans)

    return MeteredExporter()


def _metered(meter: _HookMeter, provider, recorder):
    """The "on" side's tracing and recorder, every hook call metered."""
    from deployments.tracing import Tracing

    class Span:
        def __init__(self, span) -> None:
            self._span = span

        def engine_trace_context(self, *args):
            return meter.call(self._span.engine_trace_context, *args)

        def on_request(self, *args):
            meter.call(self._span.on_request, *args)

        def on_tenant(self, *args):
            meter.call(self._span.on_tenant, *args)

        def end(self, *args, **kwargs):
            meter.call(self._span.end, *args, **kwargs)

    class MeteredTracing(Tracing):
        def start_ingress(self, *args, **kwargs):
            return Span(meter.call(super().start_ingress, *args, **kwargs))

        def record_engine_request(self, *args, **kwargs):
            meter.call(super().record_engine_request, *args, **kwargs)

    class MeteredRecorder:
        enabled = recorder.enabled

        def record(self, *args, **kwargs):
            meter.call(recorder.record, *args, **kwargs)

    return MeteredRecorder(), MeteredTracing(provider)


def _model_dir(args, scratch: Path) -> str:
    from benchmarks.models import make_tiny_model_dir, resolve_default_model
    from benchmarks.served_system import with_tokenizer

    model = str(resolve_default_model(args.model)) if args.model else str(make_tiny_model_dir(scratch / "tiny"))
    return with_tokenizer(model, scratch / "served")  # the ingress detokenizes: a tokenizer must be there


class _Stack:
    """Replica + frontend + gRPC method over one engine, switched between "off" and "on"."""

    def __init__(self, model_dir: str, tokenizer, args, on: tuple) -> None:
        from deployments.engine_client import LocalEngineClient
        from deployments.frontend import Frontend, FrontendConfig
        from deployments.grpc_service import SlotServeGrpcMixin
        from deployments.metrics import NullRecorder
        from deployments.replica import EngineReplica
        from deployments.tracing import Tracing

        # No prefix cache: both sides of a round send the same prompts, and the second must not find them cached.
        options = {"max_num_seqs": args.slots, "max_waiting": args.requests, "enable_prefix_caching": False}
        if args.threads:
            options["num_threads"] = args.threads
        self.modes = {"off": (NullRecorder(), Tracing(None)), "on": on}  # (metrics recorder, tracing)
        recorder, tracing = self.modes["off"]
        self.replica = EngineReplica(model_dir, options, drain_timeout_s=5, model_name="bench", metrics=recorder,
                                     tracing=tracing)
        self.service = SlotServeGrpcMixin()
        self.service.frontend = Frontend(FrontendConfig(served_model_name="bench", model=model_dir), tokenizer,
                                         LocalEngineClient([self.replica]), tracing=tracing)

    def switch(self, mode: str):
        recorder, tracing = self.modes[mode]
        self.replica.metrics.recorder = recorder
        self.replica.tracing = self.service.frontend.tracing = tracing
        return self.service


async def _round(service, requests, output_len: int) -> tuple[int, float, float]:
    """(tokens streamed back, seconds, this process's CPU seconds) for ``requests`` sent at once
    through gRPC Generate."""
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

    async def one(prompt) -> int:
        msg = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(prompt)),
                                 sampling=pb.SamplingOptions(max_tokens=output_len, temperature=0, ignore_eos=True))
        return sum([len(m.token_ids) async for m in service.Generate(msg.SerializeToString(), grpc_context=_Context())])

    t0, cpu0 = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(one(r.prompt_token_ids) for r in requests))
    return sum(counts), time.perf_counter() - t0, time.process_time() - cpu0


def _workload(args, vocab_size: int, seed: int):
    spec = WorkloadSpec("observability", "short prompts, fixed outputs, all at once", args.requests,
                        UniformInt(16, 128), Constant(args.output_len), seed=seed)
    return build_requests(spec, vocab_size)


async def _measure(args, stack: _Stack, exporter, provider, meter: _HookMeter, vocab_size: int) -> list[dict]:
    for name in ("off", "on"):  # warm-up: first-call costs, off the clock
        await _round(stack.switch(name), _workload(args, vocab_size, 10_000), args.output_len)
    provider.force_flush()
    exporter.clear()
    rows = []
    for i in range(args.rounds):
        requests = _workload(args, vocab_size, i)  # the same requests for both sides of a round
        for name in ("off", "on") if i % 2 == 0 else ("on", "off"):  # neither side always goes first
            meter.seconds = 0.0
            tokens, seconds, cpu_s = await _round(stack.switch(name), requests, args.output_len)
            row = {"mode": name, "round": i + 1, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                   "tokens_per_cpu_s": tokens / cpu_s, "cpu_s": cpu_s}
            if name == "on":
                t = time.process_time()
                provider.force_flush()  # the rest of the round's export, metered like the rest
                row["cpu_s"] += time.process_time() - t
                row["hook_cpu_s"] = meter.seconds
                row["spans"] = len(exporter.get_finished_spans())
                exporter.clear()
            rows.append(row)
            print(f"  {name:3} round {i + 1}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s "
                  f"({tokens / cpu_s:.1f} per CPU second)", flush=True)
    await stack.replica.shutdown()
    return rows


def run(args) -> dict:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    from benchmarks.models import model_vocab_size
    from deployments.metrics import NullRecorder, RayRecorder
    from engine.tokenizer import load_tokenizer

    for name in ("requests", "output_len", "slots", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    with tempfile.TemporaryDirectory(prefix="slotserve-obs-") as scratch:
        model_dir = _model_dir(args, Path(scratch))
        tokenizer = load_tokenizer(model_dir)
        meter = _HookMeter()
        exporter = _metered_exporter(meter)
        provider = TracerProvider(sampler=ALWAYS_ON)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        metrics = NullRecorder()
        if not args.no_ray_metrics:
            import ray

            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
            metrics = RayRecorder("bench")
        try:
            stack = _Stack(model_dir, tokenizer, args, on=_metered(meter, provider, metrics))
            rows = asyncio.run(_measure(args, stack, exporter, provider, meter, model_vocab_size(model_dir)))
        finally:
            provider.shutdown()
            if not args.no_ray_metrics:
                ray.shutdown()
    return summarize(args, rows)


def summarize(args, rows: list[dict]) -> dict:
    """Medians per side, and the median of each round's on / off (the two ran back to back, so
    load from elsewhere on the machine weighs on both alike)."""
    def side(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    def paired(key: str) -> float:
        by_round = {(r["round"], r["mode"]): r[key] for r in rows}
        return statistics.median(by_round[i, "on"] / by_round[i, "off"] for i in range(1, args.rounds + 1))

    ratio = paired("tokens_per_s")
    spans = [r["spans"] for r in rows if "spans" in r]
    return {"model": args.model or "tiny random Llama", "requests": args.requests, "output_len": args.output_len,
            "slots": args.slots, "rounds": args.rounds, "ray_metrics": not args.no_ray_metrics, "rows": rows,
            "median_tokens_per_s": {m: side(m, "tokens_per_s") for m in ("off", "on")},
            "ratio_on_off": ratio, "ratio_on_off_cpu": paired("tokens_per_cpu_s"), "target_ratio": TARGET_RATIO,
            "hook_cpu_share": statistics.median(r["hook_cpu_s"] / r["cpu_s"] for r in rows if r["mode"] == "on"),
            "spans_per_request": min(spans) / args.requests, "within_target": ratio >= TARGET_RATIO}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from benchmarks.report import write_json

    out = Path(args.out_dir) / "observability.json"
    write_json(out, results)
    m = results["median_tokens_per_s"]
    print(f"median tokens/s: off {m['off']:.1f}, on {m['on']:.1f}; on / off per round, median: "
          f"{results['ratio_on_off']:.3f} (target >= {TARGET_RATIO}), per CPU second "
          f"{results['ratio_on_off_cpu']:.3f}; hooks' share of the 'on' CPU time {results['hook_cpu_share']:.2%}; "
          f"{results['spans_per_request']:.0f} spans per request\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
