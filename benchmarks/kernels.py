"""Which kernels a decode step spends its time in: torch's profiler over pure decode steps.

The engine profile (benchmarks.profile) splits a step into host phases; this splits the
forward into kernels, at a few numbers of running requests, with the same engine settings
as the benchmark (CUDA graphs on where the engine uses them), the decoder stack compiled and
not (``compile_model``), one after the other in one process. On a GPU:

    python -m benchmarks.kernels --device cuda --model-shape llama-1b --levels 1,32

On this project's CPU, the default model's shape at 16 running with ~430-token contexts:

    python -m benchmarks.kernels --device cpu --model-shape smollm2-135m --levels 16 --prompt-len 420

Steps are timed without the profiler first (device synchronised), then profiled. Each level also
reports attention's share of the profiled step: the attention op's total time (the kernel, its K/V
writes, its wrapper) over the step's.
"""

from __future__ import annotations

import argparse
import tempfile
import time

ATTENTION_OPS = ("slotserve::attention", "slotserve_cpu::attention")
"""The compiled graph's attention op (the Python one, or its C++ twin on the CPU kernel)."""
CPU_KERNEL_OPS = ("slotserve_cpu::paged_attention", "slotserve_cpu::write_kv")
"""What an eager step's attention is made of on the CPU kernel (its Python wrapper is not an op)."""


def attention_share(events, step_s: float, steps: int) -> float | None:
    """Attention's share of a profiled CPU step: the compiled graph's attention op in all (wrapper
    included), else the CPU kernel's own ops; None when neither ran."""
    total = {e.key: e.cpu_time_total for e in events}
    keys = [k for k in ATTENTION_OPS if k in total] or [k for k in CPU_KERNEL_OPS if k in total]
    return sum(total[k] for k in keys) / 1e6 / steps / step_s if keys else None


def _start(engine, level: int, steps: int, vocab: int, tag: str, prompt_len: int = 128) -> list[str]:
    from benchmarks.engine_systems import exact_params

    ids = [engine.add_request([(7 * i + j) % (vocab - 4) + 4 for j in range(prompt_len)], exact_params(2 * steps + 16),
                              request_id=f"{tag}-{i}") for i in range(level)]
    started: set[str] = set()
    while len(started) < level:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    return ids


def _finish(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def profile_level(engine, level: int, steps: int, device: str, top: int,
                  prompt_len: int = 128) -> tuple[float, float | None, str]:
    """(ms per decode step unprofiled, attention's share of a profiled step on CPU, the profiler's
    kernel table)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = _start(engine, level, steps, engine.vocab_size, f"k{level}", prompt_len)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps // 2):
            engine.step()
        sync()
        profiled_s = (time.perf_counter() - t0) / (steps // 2)
    _finish(engine, ids)
    events = prof.key_averages()
    share = attention_share(events, profiled_s, steps // 2) if device == "cpu" else None
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return step_ms, share, events.table(sort_by=key, row_limit=top, max_name_column_width=70)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.engine_systems import make_engine
    from benchmarks.models import MODEL_SHAPES, make_shaped_model_dir
    from benchmarks.systems import BenchSettings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--levels", default="1,32", help="running requests to profile at, comma-separated")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=15, help="kernels listed per level")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens in each request's prompt")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    step_ms: dict[tuple[bool, int], float] = {}
    shares: dict[tuple[bool, int], float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_shaped_model_dir(tmp, args.model_shape, args.dtype, args.device)
        blocks = max(levels) * -(-(args.prompt_len + 2 * args.steps + 32) // 16) + 1
        settings = BenchSettings(str(model_dir), max_num_seqs=max(levels), block_size=16, num_kv_blocks=blocks,
                                 dtype=args.dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype)
        for compiled in (False, True):
            engine = make_engine(settings, enforce_eager=False, compile_model=compiled)
            runner = engine.runner
            print(f"\n# compile_model={compiled}: attention {runner.backend.name}, CUDA graphs "
                  f"{runner.graphs is not None}, compiled in {runner.compile_s or 0:.1f} s")
            _finish(engine, _start(engine, 1, 4, engine.vocab_size, "warmup"))
            for level in levels:
                key = compiled, level
                step_ms[key], shares[key], table = profile_level(engine, level, args.steps, args.device, args.top,
                                                                 args.prompt_len)
                share = "" if shares[key] is None else f", attention {100 * shares[key]:.1f} % of a profiled step"
                print(f"\n== {level} running: {step_ms[key]:.2f} ms per decode step (unprofiled){share}\n{table}")
            del engine, runner
            _release(args.device)
    print("\nrunning  uncompiled ms  compiled ms  speed-up  attention share (uncompiled, compiled)")
    for level in levels:
        off, on = step_ms[False, level], step_ms[True, level]
        share = " ".join("-" if shares[c, level] is None else f"{100 * shares[c, level]:.1f} %" for c in (False, True))
        print(f"{level:7d}  {off:13.2f}  {on:11.2f}  {off / on:7.2f}x  {share}")


def _release(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
