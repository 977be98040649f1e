"""What structured outputs cost: the same requests with 0 %, 50 % and 100 % of them under a JSON schema.

    python -m benchmarks.structured [--model smollm2-135m] [--requests 32] [--slots 16] [--rounds 2]

One engine, in one process; the shares run in turn (0, 50, 100 %, repeated ``--rounds`` times, so
a drifting host shows as a spread rather than a trend). For each run: output tokens per second,
the mean time per engine step, the time the grammar masks took, and the mean inter-token time of
the requests that had no schema, the figure the issue bounds (a request without a grammar should
lose at most 3 % when others use one).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}}}
ASK = "Describe a made-up person {i} as JSON with their name, age and hobbies."


def _run(llm, prompts: list[list[int]], share: float, max_tokens: int) -> dict:
    from engine import SamplingParams
    import engine.sampler as sampler

    constrained = set(range(0, len(prompts), 2)) if share == 0.5 else set(range(len(prompts))) if share else set()
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, ignore_eos=i not in constrained,
                             structured_outputs={"json": SCHEMA} if i in constrained else None)
              for i in range(len(prompts))]
    mask_s = [0.0]
    real_mask = sampler.mask_logits

    def timed_mask(logits, requests):
        t = time.perf_counter()
        masked = real_mask(logits, requests)
        mask_s[0] += time.perf_counter() - t
        return masked

    sampler.mask_logits = timed_mask
    engine = llm.engine
    steps0 = engine.stats().num_steps
    stamps: dict[str, list[float]] = {}
    try:
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    stamps.setdefault(out.request_id, []).append(time.perf_counter())
        wall = time.perf_counter() - t0
    finally:
        sampler.mask_logits = real_mask
    steps = engine.stats().num_steps - steps0
    tokens = sum(len(s) for s in stamps.values())
    free = [ids[i] for i in range(len(ids)) if i not in constrained]
    gaps = [b - a for rid in free for a, b in zip(stamps[rid], stamps[rid][1:])]
    return {"share": share, "tok_s": tokens / wall, "step_ms": 1e3 * wall / steps, "mask_ms_per_step": 1e3 * mask_s[0] / steps,
            "free_itl_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None, "tokens": tokens, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench-out/structured.json")
    args = ap.parse_args(argv)
    from engine import LLM

    llm = LLM(args.model, dtype="float32", max_num_seqs=args.slots, enforce_eager=True, max_model_len=2048)
    chat = llm.tokenizer.apply_chat_template
    prompts = [chat([{"role": "user", "content": ASK.format(i=i)}]) for i in range(args.requests)]
    _run(llm, prompts[:2], 1.0, 8)  # warm-up: kernels, the tokenizer the grammars read
    runs = []
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for share in (0.0, 0.5, 1.0):
            runs.append(_run(llm, prompts, share, args.max_tokens))
    print("| schema share | output tok/s | ms / step | of which masks | ITL of requests without a schema |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        itl = "-" if r["free_itl_ms"] is None else f"{r['free_itl_ms']:.1f} ms"
        print(f"| {r['share']:.0%} | {r['tok_s']:.1f} | {r['step_ms']:.1f} | {r['mask_ms_per_step']:.2f} | {itl} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
