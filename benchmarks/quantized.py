"""Decode time per step with the model's GGUF blocks (``quantization: gguf``) against its de-quantized
weights, one engine after the other in one process, at a few numbers of running requests:

    python -m benchmarks.quantized --levels 1,16

Each level generates ``--max-tokens`` tokens (EOS ignored) for that many requests at once, after one
untimed round; the step time is the wall time over the tokens of one request. The JSON names the
host's CPU features and each engine's weight bytes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France?", "List three colors.",
           "Explain gravity simply."]


def _measure(options: dict, model: str, levels: list[int], max_tokens: int, rounds: int) -> dict:
    from engine import LLM, SamplingParams
    llm = LLM(model, **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    result = {"weight_mib": round(llm.engine.runner.param_bytes / (1 << 20), 1), "levels": {}}
    for level in levels:
        prompts = (PROMPTS * level)[:level]
        llm.generate(prompts, params)  # untimed: the first steps of a shape
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            times.append((time.perf_counter() - t0) / max_tokens * 1e3)
        best = min(times)
        result["levels"][level] = {"ms_per_step": round(best, 2), "tok_s": round(level * 1e3 / best, 1)}
        print(f"  {options.get('quantization') or options['dtype']}: {level} running: {best:.1f} ms/step, "
              f"{level * 1e3 / best:.1f} tok/s", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--eager", action="store_true", help="both engines eager (enforce_eager), not compiled")
    ap.add_argument("--out", default="bench-out/quantized.json")
    args = ap.parse_args(argv)
    from engine.cpu_features import host_cpu
    levels = [int(v) for v in args.levels.split(",")]
    common = {"dtype": args.dtype, "max_num_seqs": max(levels), "enforce_eager": args.eager}
    report = {"environment": {"host_cpu": host_cpu()}, "systems": {}}
    for name, extra in (("dequantized", {}), ("gguf", {"quantization": "gguf"})):
        print(f"{name}:", flush=True)
        report["systems"][name] = _measure({**common, **extra}, args.model, levels, args.max_tokens, args.rounds)
    base, quant = report["systems"]["dequantized"]["levels"], report["systems"]["gguf"]["levels"]
    report["speedup"] = {level: round(base[level]["ms_per_step"] / quant[level]["ms_per_step"], 2) for level in levels}
    print("gguf speed-up over de-quantized weights, per level:", report["speedup"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
