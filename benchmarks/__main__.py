"""``python -m benchmarks [--quick] [--workload NAME] [--json-out FILE] [--systems a,b] [--out-dir D]``.

On a GPU without a model hub: ``python -m benchmarks --device cuda --dtype bfloat16 --model-shape llama-1b``
(random weights of that shape, made in place)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import models
from benchmarks.harness import run_all
from benchmarks.markdown import format_markdown
from benchmarks.plots import write_plots
from benchmarks.profile import LEVELS
from benchmarks.report import environment, format_table, judge_targets, load_average, ratios, write_json
from benchmarks.systems import SYSTEMS, BenchSettings, kv_blocks_for, parse_systems
from benchmarks.workloads import PRESETS, Arrival, WorkloadSpec, build_requests, get_workload, schedule_bound

QUICK_PROFILE_STEPS = 16
FULL_PROFILE_STEPS = 64


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run slotserve's engine and HF transformers on the same workload, one after the other; "
                    "write a table, a JSON file and PNG plots.")
    p.add_argument("--quick", action="store_true",
                   help="tiny random model made on the fly and a short profile; the same workload (minutes on 2 cores)")
    p.add_argument("--workload", default="mixed", choices=sorted(PRESETS), help="workload preset (default mixed)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated systems, in order (default all of: {', '.join(SYSTEMS)})")
    p.add_argument("--out-dir", default="bench-out", help="where the JSON, plots and logs go (default bench-out)")
    p.add_argument("--json-out", default=None, help="JSON file (default OUT_DIR/results-WORKLOAD.json)")
    p.add_argument("--model", default=None,
                   help="local HF model directory or built-in name (default: the engine's default model; "
                        "--quick: a tiny random model)")
    p.add_argument("--model-shape", default=None, choices=sorted(models.MODEL_SHAPES),
                   help="random weights of this model's shape, written to a temporary directory (no hub)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where every system runs (default cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations of every system (auto: the engine's own choice: bfloat16 on cuda "
                        "and on CPUs with AVX-512 BF16 or AMX, else float32)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="int8: slotserve's int8 KV cache and vLLM's 8-bit one (fp8); HF systems keep theirs in "
                        "--dtype (default auto: the model's dtype)")
    p.add_argument("--num-requests", type=_positive_int, default=None, help="override the preset's request count")
    p.add_argument("--arrival", default=None, help="'burst' (all at t=0, default) or 'poisson:RATE' requests/s")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--threads", type=_positive_int, default=os.cpu_count() or 1, help="torch threads for every system")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16, help="slots = HF batch size (default 16)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048, help="token budget per step")
    p.add_argument("--block-size", type=_positive_int, default=16, help="KV block size = HF page size (default 16)")
    p.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="KV pool for the engine and HF paged cache (default: every slot holds the longest request)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off in both paged systems")
    p.add_argument("--vllm-python", default=None,
                   help="interpreter of a venv with vLLM, for the vllm system (e.g. /tmp/peer/venv/bin/python)")
    p.add_argument("--no-profile", action="store_true", help="skip the engine step profile")
    p.add_argument("--profile-steps", type=_positive_int, default=None, help="decode steps measured per profile level")
    return p


def _settings(args, model_dir: Path, max_seq_len: int) -> BenchSettings:
    limit = models.model_max_len(model_dir)
    if limit is not None and max_seq_len > limit:
        raise ValueError(f"workload needs {max_seq_len} tokens per request but the model holds {limit}")
    blocks = args.num_kv_blocks or kv_blocks_for(max_seq_len, args.block_size, args.max_num_seqs)
    return BenchSettings(str(model_dir), max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                         num_kv_blocks=blocks, threads=args.threads, dtype=_dtype(args), device=args.device,
                         enable_prefix_caching=not args.no_prefix_caching, vllm_python=args.vllm_python,
                         kv_cache_dtype=args.kv_cache_dtype)


def _dtype(args) -> str:
    if args.dtype != "auto":
        return args.dtype
    from engine.cpu_features import fast_bf16
    return "bfloat16" if args.device == "cuda" or fast_bf16() else "float32"


def _device_info(settings: BenchSettings, model_dir: Path) -> dict:
    """The GPU, its torch and CUDA versions, and the attention kernel the engine picks for the model."""
    import torch

    from engine.attention import resolve_backend
    from engine.model import ModelArch

    if settings.device != "cuda":
        return {"device": settings.device}
    device = torch.device("cuda")
    arch = ModelArch.from_dir(model_dir)
    backend, why = resolve_backend("auto", device, getattr(torch, settings.dtype), settings.block_size, arch.head_dim)
    return {"device": "cuda", "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda, "attention_backend": backend, "attention_why": why}


def _collect(raw: dict) -> dict:
    systems = {}
    for name, res in raw.items():
        head = {"title": SYSTEMS[name].title, "description": SYSTEMS[name].description}
        if res.get("ok"):
            systems[name] = {**head, **res["summary"], "peak_rss_bytes": res["peak_rss_bytes"],
                             "process_wall_s": res["wall_s"], "host_cpu_busy_before": res["host_cpu_busy_before"]}
        else:
            systems[name] = {**head, "error": res.get("error"), "log": res.get("log")}
    return systems


def run(args, spec: WorkloadSpec, model_dir: Path, model_label: str, argv: list[str]) -> tuple[dict, int]:
    started = time.perf_counter()
    load_at_start = load_average()
    requests = build_requests(spec, models.model_vocab_size(model_dir))
    settings = _settings(args, model_dir, spec.max_seq_len)
    names = parse_systems(args.systems)
    out_dir = Path(args.out_dir)
    steps = None if args.no_profile else (args.profile_steps or (QUICK_PROFILE_STEPS if args.quick
                                                                 else FULL_PROFILE_STEPS))
    raw, profile = run_all(names, requests, settings, out_dir / "logs", steps, len(LEVELS))
    systems = _collect(raw)
    threads = next((r.get("torch_threads") for r in raw.values() if r.get("ok")), None)
    profile_out = None
    if profile is not None:
        profile_out = profile["profile"] if profile.get("ok") else {"error": profile.get("error")}
        profile_out["host_cpu_busy_before"] = profile.get("host_cpu_busy_before")
    ok_systems = {n: s for n, s in systems.items() if "error" not in s}
    bound = schedule_bound(requests, settings.max_num_seqs)
    table = ratios(ok_systems)
    results = {
        "workload": {**spec.describe(), "schedule_bound": bound},
        "model": model_label, "quick": args.quick,
        "command": "python -m benchmarks " + " ".join(argv), "settings": settings.as_dict(),
        "environment": {**environment(threads, load_at_start), **_device_info(settings, model_dir)},
        "systems": systems, "ratios": table,
        "targets": judge_targets(spec.name, table, profile_out, bound, args.quick), "profile": profile_out,
    }
    results["plots"] = write_plots(results, out_dir)
    results["elapsed_s"] = time.perf_counter() - started
    failed = len(ok_systems) < len(systems) or (profile_out is not None and "error" in profile_out)
    return results, 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        parse_systems(args.systems)
        if args.model and args.model_shape:
            raise ValueError("give --model or --model-shape, not both")
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda asked for, but CUDA is not available")
        spec = get_workload(args.workload, num_requests=args.num_requests,
                            arrival=Arrival.parse(args.arrival) if args.arrival else None, seed=args.seed)
        with tempfile.TemporaryDirectory(prefix="slotserve-bench-model-") as tmp:
            if args.model:
                model_dir, label = models.resolve_default_model(args.model), args.model
            elif args.model_shape:
                model_dir = models.make_shaped_model_dir(Path(tmp) / args.model_shape, args.model_shape,
                                                         _dtype(args), args.device)
                label = f"{args.model_shape} shape, random weights"
            elif args.quick:
                model_dir, label = models.make_tiny_model_dir(Path(tmp) / "tiny"), "tiny random Llama"
            else:
                name = models.default_model_name()
                model_dir, label = models.resolve_default_model(name), name
            results, code = run(args, spec, model_dir, label, argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    json_out = Path(args.json_out or Path(args.out_dir) / f"results-{results['workload']['name']}.json")
    write_json(json_out, results)
    md_out = json_out.with_suffix(".md")
    md_out.write_text(format_markdown(results))
    print(format_table(results))
    print(f"\nJSON: {json_out}\nMarkdown: {md_out}" + "".join(f"\nplot: {p}" for p in results["plots"]))
    print(f"took {results['elapsed_s']:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
