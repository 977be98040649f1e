"""A decode step against its bytes-read floor: the step's time beside the time this host needs only to
read what the step must read (every weight once, and each running request's KV cache once a layer),
at the host's measured read bandwidth:

    python -m benchmarks.step_floor --levels 1,16

The engine is the one ``slotserve serve`` runs by default (the built-in model's GGUF blocks,
``quantization: gguf``, compiled, the host's default dtype); ``--kv-cache-dtype int8`` and
``--options '{...}'`` change it. Each level runs that many requests of ``--prompt-len`` tokens to
``--max-tokens`` tokens (EOS ignored) and times every decode step after all have their first token.

The floor of one step is (weight bytes + KV bytes of that step's contexts) / bandwidth. The bandwidth
is the best of several whole reads of a buffer much larger than the caches (``torch.sum`` on float32,
``--threads`` threads), before and after the steps: what a plain streaming read reaches here, not a
datasheet's peak. Every weight counts once (a tied model's head and embedding are one tensor).

Beside each level: the quantized linear layers alone, every one once on that many rows, timed as a step
runs them, with the multiply-adds a second they reach; the rest of the step is attention, the
elementwise ops and the framework.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def read_bandwidth(mib: int = 1024, rounds: int = 7) -> float:
    """Bytes a second of the best of ``rounds`` whole reads of a ``mib`` MiB float32 buffer."""
    buf = torch.ones(mib << 18, dtype=torch.float32)  # 4 bytes an element
    buf.sum()  # pages touched before timing
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / best


def kv_token_bytes(runner) -> int:
    """KV bytes one context token holds over all layers (what attention reads of it a step)."""
    return runner.num_layers * runner.backend.token_bytes(runner.dtype)


def decode_steps(engine, level: int, prompt_len: int, max_tokens: int, tag: str) -> list[tuple[float, int]]:
    """(seconds, context tokens read) of every decode step of ``level`` requests run together."""
    from engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    vocab = min(engine.vocab_size, 1000) - 100
    for i in range(level):  # distinct prompts: no prefix shared between requests
        engine.add_request([100 + (i * 7919 + j * 31) % vocab for j in range(prompt_len)], params,
                           request_id=f"{tag}-{i}")
    while len(engine.scheduler.running) < level or not all(r.num_output_tokens for r in engine.scheduler.running):
        engine.step()
    steps = []
    while engine.has_unfinished():
        # Each running request reads its whole context: prompt and outputs so far, the new token's included.
        context = sum(r.num_tokens for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, context))
    return steps


def linear_layers(model) -> list[tuple[torch.nn.Module, int]]:
    """Every quantized linear layer a decode step runs, with its input width; the LM head last (it reads
    the hidden state). Not the embedding: a step reads only its tokens' rows."""
    layers = [(m, m.in_features) for m in model.modules()
              if hasattr(m, "in_features") and (getattr(m, "qtype", None) is not None or getattr(m, "qparts", None))]
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head, "qtype", None) is not None:
        layers.append((head, layers[0][1]))
    return layers


def linear_time(runner, level: int, rounds: int = 5) -> tuple[float, int]:
    """(seconds, multiply-adds) of one pass of ``level`` rows through every quantized linear layer alone,
    one after another as a step runs them (the weights stream through the caches the same way); best of
    ``rounds``. What the step takes beyond it is attention, the elementwise ops and the framework."""
    from engine.model.quant import quant_linear
    layers = linear_layers(runner.model)
    inputs = {k: torch.randn(level, k).to(runner.dtype) for k in {k for _, k in layers}}
    macs = 0
    with torch.inference_mode():
        for layer, k in layers:
            macs += quant_linear(inputs[k], layer).shape[-1] * k * level
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for layer, k in layers:
                quant_linear(inputs[k], layer)
            best = min(best, time.perf_counter() - t0)
    return best, macs


def measure_steps(engine, level: int, prompt_len: int, max_tokens: int, rounds: int) -> list[list]:
    """``rounds`` runs of ``decode_steps`` at ``level`` running, after one untimed (shapes compiled)."""
    decode_steps(engine, level, prompt_len, max_tokens, f"warm{level}")
    return [decode_steps(engine, level, prompt_len, max_tokens, f"l{level}r{r}") for r in range(rounds)]


def against_floor(runner, steps: dict[int, list[list]], bandwidth: float) -> dict:
    """Each level's fastest run beside its floor: bytes read a step over ``bandwidth``."""
    weights, per_token = runner.param_bytes, kv_token_bytes(runner)
    table = {}
    for level, runs in steps.items():
        timed = []
        for run in runs:
            read = sum(weights + context * per_token for _, context in run) / len(run)
            timed.append({"ms_per_step": sum(s for s, _ in run) / len(run) * 1e3, "bytes_per_step": read,
                          "mb_per_step": read / 1e6, "floor_ms_per_step": read / bandwidth * 1e3})
        best = min(timed, key=lambda run: run["ms_per_step"])
        seconds, macs = linear_time(runner, level)
        best |= {"times_floor": best["ms_per_step"] / best["floor_ms_per_step"], "linear_layers_ms": seconds * 1e3,
                 "linear_layers_gmac_s": macs / seconds / 1e9}
        best = {k: round(v, 4) for k, v in best.items()}
        best["all_ms_per_step"] = [round(run["ms_per_step"], 2) for run in timed]
        table[level] = best
        print(f"{level} running: {best['ms_per_step']:.2f} ms a step (runs {best['all_ms_per_step']}), "
              f"{best['mb_per_step']:.1f} MB read a step, floor {best['floor_ms_per_step']:.2f} ms: "
              f"{best['times_floor']:.2f}x the floor; the linear layers alone {best['linear_layers_ms']:.2f} ms "
              f"({best['linear_layers_gmac_s']:.1f} G multiply-adds a second)", flush=True)
    return {"weight_bytes": weights, "kv_bytes_per_token": per_token, "levels": table}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=256, help="as the served benchmark's random run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads, for the engine and the read alike")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--read-mib", type=int, default=1024, help="the bandwidth's buffer: far larger than the caches")
    ap.add_argument("--options", default="{}", help="more engine options, as JSON")
    ap.add_argument("--out", default="bench-out/step_floor.json")
    args = ap.parse_args(argv)
    from engine.cpu_features import host_cpu
    from engine.llm import LLM
    torch.set_num_threads(args.threads)
    levels = [int(v) for v in args.levels.split(",")]
    # The host's speed drifts: the fastest read seen before or after the steps makes the floor.
    bandwidth = read_bandwidth(args.read_mib)
    options = {"quantization": "gguf", "block_size": 32, "max_num_seqs": max(levels),
               "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.prompt_len + args.max_tokens + 16,
               **json.loads(args.options)}
    llm = LLM(args.model, **options)
    steps = {level: measure_steps(llm.engine, level, args.prompt_len, args.max_tokens, args.rounds) for level in levels}
    bandwidth = max(bandwidth, read_bandwidth(args.read_mib))
    print(f"read bandwidth, {args.threads} threads: {bandwidth / 1e9:.1f} GB/s", flush=True)
    report = {"environment": {"host_cpu": host_cpu(), "threads": args.threads},
              "read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "options": options,
              "dtype": str(llm.engine.runner.dtype), **against_floor(llm.engine.runner, steps, bandwidth)}
    llm.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
