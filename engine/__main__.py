"""``python -m engine generate "prompt"``: offline generation from the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from engine.models_hub import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m engine", description="slotserve engine, offline")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (one or more)")
    gen.add_argument("--model", default=DEFAULT_MODEL, help=f"local HF directory or built-in name (default {DEFAULT_MODEL})")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="devices (CPU: processes) to shard the model over (default 1)")
    gen.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")

    from engine import LLM

    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size)
    try:
        return _generate(llm, args)
    finally:
        llm.shutdown()


def _generate(llm, args) -> int:
    from engine import SamplingParams

    prompts = args.prompts
    if args.chat:
        prompts = [{"prompt": p, "prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])}
                   for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    total = 0
    for prompt, out in zip(args.prompts, outs):
        comp = out.outputs[0]
        total += len(comp.token_ids)
        print(f"--- {prompt!r} ({len(comp.token_ids)} tokens, {comp.finish_reason})")
        print(comp.text)
    print(f"--- {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
