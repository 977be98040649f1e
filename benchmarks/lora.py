"""What LoRA costs per token: the same requests on the base model, then spread over 1, 4 and 16 adapters.

    python -m benchmarks.lora [--model smollm2-135m] [--requests 32] [--slots 16] [--rank 16] [--rounds 2]
    python -m benchmarks.lora --device cuda --dtype bfloat16 --model-shape llama-1b --slots 64 --requests 128

One process; every engine eager, or with ``--compiled`` every one compiled (with CUDA graphs of
decode steps on a GPU), so the ratio is LoRA's own cost either way. Runs, in turn and
``--rounds`` times so that a drifting host shows as a spread: the base engine; an engine with
adapter slots whose requests use none (the cost of having slots); and requests spread
round-robin over 1, 4 and 16 adapters of rank ``--rank`` (``max_loras`` = the adapter count, so each
step mixes them all). Adapters have random weights of the model's real shapes, written in PEFT's
format. With ``--model-shape`` the base model has random weights of that shape too
(``benchmarks.models``) and prompts are token ids."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine.lora.adapter import MODULES, full_shape

ASK = "Write a short story about a robot number {i} who learns to paint."


def write_adapter(path: Path, arch, rank: int, seed: int) -> Path:
    """A random LoRA of ``rank`` on every projection, as ``peft``'s ``save_pretrained`` writes one."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in MODULES:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            for which in "AB":
                shape = full_shape(arch, module, which, rank)
                key = f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{which}.weight"
                tensors[key] = torch.randn(shape, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}))
    return path


def _run(llm, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> dict:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    steps0 = engine.stats().num_steps
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora=names)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = engine.stats().num_steps - steps0
    return {"tok_s": tokens / wall, "step_ms": 1e3 * wall / steps, "tokens": tokens, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--counts", default="1,4,16", help="adapter counts to spread the requests over")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--model-shape", default=None, help="random weights of this shape (benchmarks.models) instead")
    ap.add_argument("--compiled", action="store_true", help="compiled engines (CUDA graphs on a GPU), not eager")
    ap.add_argument("--out", default="bench-out/lora.json")
    args = ap.parse_args(argv)
    from engine import LLM
    from engine.models_hub import resolve_model
    from engine.model import ModelArch

    counts = [int(c) for c in args.counts.split(",")]
    root = Path(args.out).parent / "lora-adapters"
    if args.model_shape:
        from benchmarks.models import make_shaped_model_dir

        model = str(make_shaped_model_dir(root / "base", args.model_shape, args.dtype, args.device))
    else:
        model = str(resolve_model(args.model))
    arch = ModelArch.from_dir(Path(model))
    adapters = {f"a{i}": str(write_adapter(root / f"a{i}", arch, args.rank, i)) for i in range(max(counts))}
    common = dict(dtype=args.dtype, device=args.device, max_num_seqs=args.slots, enforce_eager=not args.compiled,
                  max_model_len=1024, kv_cache_memory_gb=0.5 if args.device == "cpu" else 4)
    base = LLM(model, **common)
    if args.model_shape:
        vocab = min(arch.vocab_size, 1000)
        prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(48 + i % 32)] for i in range(args.requests)]
    else:
        chat = base.tokenizer.apply_chat_template
        prompts = [chat([{"role": "user", "content": ASK.format(i=i)}]) for i in range(args.requests)]
    with_slots = {k: LLM(model, **common, lora=dict(adapters={n: adapters[n] for n in list(adapters)[:k]},
                                                         max_loras=k, max_lora_rank=args.rank)) for k in counts}
    no_adapter = [None] * len(prompts)
    runs = [("base", base, no_adapter), ("slots, no adapter", with_slots[max(counts)], no_adapter)]
    runs += [(f"{k} adapter{'s' * (k > 1)}", with_slots[k], [f"a{i % k}" for i in range(len(prompts))]) for k in counts]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    _run(base, prompts[:2], [None, None], 4)  # warm the kernels
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, llm, names in runs:
            results[name].append(_run(llm, prompts, names, args.max_tokens))
    base_tok_s = sum(r["tok_s"] for r in results["base"]) / args.rounds
    print("| run | tok/s per round | step ms | vs base |\n| --- | ---: | ---: | ---: |")
    for name, rs in results.items():
        mean = sum(r["tok_s"] for r in rs) / len(rs)
        per_round = " / ".join(f"{r['tok_s']:.1f}" for r in rs)
        print(f"| {name} | {per_round} | "
              f"{sum(r['step_ms'] for r in rs) / len(rs):.1f} | {mean / base_tok_s:.2f}x |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
