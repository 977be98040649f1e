"""Speculative decoding: time per output token with and without drafts, by the number of requests
running, on prompts whose answers quote them ("copy") and on open-ended ones ("free"), in one
process, one engine after the other:

    python -m benchmarks.speculative --levels 1,4,8,16
    python -m benchmarks.speculative --methods off,draft --levels 1 --k 1,2,3,4,5 --always  # by k
    python -m benchmarks.speculative --device cuda --dtype bfloat16 --model-shape llama-1b \
        --methods off,eagle3 --k 1,2,3,4,5 --levels 1,16 --always  # a GPU's verification cost by k

Methods: ``off``; ``ngram`` (prompt lookup); ``draft`` (``draft_model``: the model's own GGUF file
as the draft of its de-quantized weights, so the draft reads ~5x fewer bytes a step and agrees
with the target nearly always); ``eagle3`` (the head ``--eagle3-head`` names, by default a random
head of the model's shapes from benchmarks.eagle3_head: it accepts almost nothing, so with
``--always`` the figures are what the head and verifying k drafts cost). ``disable_by_batch_size`` is unset at every level, so the cost
model alone decides when to draft (engine.spec_cost); ``--always`` turns it off, which shows
where drafts stop paying.

Each cell is the best of ``--rounds`` runs after an untimed one: the wall time over the tokens
of one request, the draft tokens accepted, and whether every output equals ``off``'s. The JSON
names the host's CPU features; a PNG plots the time per token against the requests running.
``--model-shape`` serves random weights of a real model's shape (benchmarks.models: no tokenizer),
on prompts of random token ids (workload ``ids``): with a random EAGLE-3 head and ``--always``, each
output token costs one step verifying k rejected drafts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

COPY = [
    "Repeat this paragraph exactly, then stop: The council met on Tuesday to discuss the new library. "
    "Members agreed that the building needs more light, more seats and longer opening hours. The vote "
    "was postponed to the next meeting, when the budget will be known.",
    "Rewrite the text with 'council' replaced by 'board': The council approved the plan for the park. "
    "The council asked for a report on costs. The council will meet again in May to review the report.",
    "Copy the list, one item per line: apples, pears, plums, cherries, grapes, lemons, limes, melons, "
    "peaches, figs.",
    "Return this JSON unchanged: {\"name\": \"Ada\", \"role\": \"engineer\", \"team\": \"serving\", "
    "\"languages\": [\"python\", \"c++\"], \"active\": true}",
]
FREE = ["Write a short poem about the sea.", "Explain gravity simply.", "Tell a story about a robot.",
        "Why do leaves change color in autumn?"]
WORKLOADS = {"copy": COPY, "free": FREE}


def _methods(names: list[str], model: str, ks: list[int], cost_model: bool, head: str) -> dict[str, dict | None]:
    """Each method's speculative_config by its label: ``off`` once, the others once per k (labelled
    ``draft k=2`` and so on when several k are swept)."""
    runs: dict[str, dict | None] = {}
    for name in names:
        for k in ([0] if name == "off" else ks):
            spec = {"num_speculative_tokens": k, "disable_by_batch_size": None, "cost_model": cost_model}
            known = {"off": None, "ngram": {"method": "ngram", **spec},
                     "draft": {"method": "draft_model", "model": model, "quantization": "gguf", **spec},
                     "eagle3": {"method": "eagle3", "model": head, **spec}}
            runs[name if name == "off" or len(ks) == 1 else f"{name} k={k}"] = known[name]
    return runs


def _token_prompts(vocab: int, length: int, count: int = 4) -> list[dict]:
    import random
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(count)]


def _chat(llm, prompts: list[str]) -> list[dict]:
    tok = llm.tokenizer
    return [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p}])} for p in prompts]


def _measure(llm, prompts: list, level: int, max_tokens: int, rounds: int) -> dict:
    from engine import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    batch = (prompts * level)[:level]
    llm.generate(batch, params)  # untimed: the first steps of a shape
    stats0 = llm.engine.stats()
    best, outs = float("inf"), None
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = llm.generate(batch, params)
        best = min(best, (time.perf_counter() - t0) / max_tokens * 1e3)
    stats = llm.engine.stats()
    drafted = stats.spec_decode_num_draft_tokens - stats0.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - stats0.spec_decode_num_accepted_tokens
    return {"ms_per_token": round(best, 2), "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(next(iter(report["results"].values())))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, workload in zip(axes, workloads):
        for method, cells in report["results"].items():
            levels = sorted(int(level) for level in cells[workload])
            ax.plot(levels, [cells[workload][str(level)]["ms_per_token"] for level in levels], marker="o",
                    label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests running")
        ax.set_title(f"{workload} prompts")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms per output token (one request's view)")
    axes[0].legend()
    when = "cost model on" if report["cost_model"] else "drafting whenever found"
    host = report["environment"]["host_cpu"]
    device = report["environment"]["device"]
    where = device if device != "cpu" else f"{host['cpu']}, {host['cores']} cores, {host['kernel_isa']}"
    model = report["model_shape"] or report["model"]
    fig.suptitle(f"Speculative decoding, {model} {report['dtype']}, k={report['k']}, {when}; {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _device_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--methods", default="off,ngram,draft")
    ap.add_argument("--k", default="4", help="num_speculative_tokens, or several to sweep (1,2,3,4,5)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default=None, choices=["gguf", "int8"],
                    help="the target's weights (what `slotserve serve` runs is gguf)")
    ap.add_argument("--always", action="store_true", help="cost_model off: draft all k whenever a draft is found")
    ap.add_argument("--eagle3-head", default=None, help="an EAGLE-3 head for the model (default: a random one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-shape", default=None, help="random weights of this shape (benchmarks.models) as --model")
    ap.add_argument("--prompt-len", type=int, default=128, help="with --model-shape: random prompt tokens")
    ap.add_argument("--out", default="bench-out/speculative.json")
    args = ap.parse_args(argv)
    if args.model_shape is not None:
        from benchmarks.models import make_shaped_model_dir
        args.model = str(make_shaped_model_dir(Path(args.out).parent / f"shape-{args.model_shape}", args.model_shape,
                                               args.dtype, args.device if args.device == "cuda" else "cpu"))
    head = args.eagle3_head
    if head is None and "eagle3" in args.methods.split(","):
        from benchmarks.eagle3_head import write_random_head
        head = str(write_random_head(args.model, Path(args.out).parent / "eagle3-head"))
    from engine import LLM
    from engine.cpu_features import host_cpu

    levels = [int(v) for v in args.levels.split(",")]
    ks = [int(v) for v in args.k.split(",")]
    report = {"environment": {"host_cpu": host_cpu(), "device": _device_name(args.device)}, "model": args.model,
              "model_shape": args.model_shape, "k": args.k, "dtype": args.dtype,
              "quantization": args.quantization,
              "eagle3_head": head,
              "max_tokens": args.max_tokens, "cost_model": not args.always, "results": {}}
    for method, spec in _methods(args.methods.split(","), args.model, ks, not args.always, head).items():
        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(levels),
                  speculative_config=spec, device=args.device)
        cells = report["results"][method] = {}
        workloads = ({"ids": _token_prompts(llm.engine.vocab_size, args.prompt_len)} if args.model_shape
                     else {name: _chat(llm, prompts) for name, prompts in WORKLOADS.items()})
        for workload, chat in workloads.items():
            cells[workload] = {}
            for level in levels:
                cell = cells[workload][str(level)] = _measure(llm, chat, level, args.max_tokens, args.rounds)
                base = report["results"].get("off", {}).get(workload, {}).get(str(level))
                if base is not None:
                    cell["same_as_off"] = cell["outputs"] == base["outputs"]
                    cell["speedup"] = round(base["ms_per_token"] / cell["ms_per_token"], 2)
                print(f"{method:>10} {workload}: {level:>2} running: {cell['ms_per_token']:7.1f} ms/token"
                      f"  speed-up {cell.get('speedup', 1.0):.2f}x  acceptance {cell['acceptance']}"
                      f"  same output {cell.get('same_as_off', True)}", flush=True)
        llm.shutdown()
    for cells in report["results"].values():
        for by_level in cells.values():
            for cell in by_level.values():
                cell.pop("outputs")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    _plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
