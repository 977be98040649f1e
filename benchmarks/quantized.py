"""Decode time per step with the model's GGUF blocks (``quantization: gguf``) and with int8 blocks made
at load (``quantization: int8``) against its de-quantized weights, one engine after the other in one
process, at a few numbers of running requests:

    python -m benchmarks.quantized --levels 1,16

Each level generates ``--max-tokens`` tokens (EOS ignored) for that many requests at once, after one
untimed round; the step time is the wall time over the tokens of one request. The JSON names the
host's CPU features and each engine's weight bytes.

Quality, for every weight format: the perplexity of a fixed text (QUALITY_TEXT, teacher-forced) and
the greedy texts of 32 chat prompts (QUALITY_PROMPTS, 48 tokens each), compared.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France?", "List three colors.",
           "Explain gravity simply."]


QUALITY_TEXT = (
    "A serving system takes requests from many users at once and answers each of them as fast as it can. "
    "Every answer is made one token at a time: the model reads its weights, looks back over what it has "
    "written, and picks the next word. When one person asks a question, most of that time goes to reading "
    "the weights from memory, so smaller weights give faster answers. When many people ask at once, their "
    "requests share each pass over the weights, and the time goes to arithmetic instead. A good engine "
    "keeps both cases in mind. It groups the requests that are waiting, gives each a slot, and frees the "
    "slot as soon as the answer is complete. It keeps a cache of what each request has already read, in "
    "blocks of a fixed size, so that a long conversation does not have to be read again from the start. "
    "When two requests begin with the same words, they can share those blocks. The operators who run such "
    "a system watch how full the slots are, how long the first word takes to arrive, and how steady the "
    "words come after it. They add machines when the slots stay full and remove them when they stay empty.")
QUALITY_PROMPTS = [f"Write two sentences about {topic}." for topic in (
    "the sea", "a city at night", "gravity", "photosynthesis", "the moon", "rain", "a library", "trains",
    "coffee", "mountains", "a robot", "autumn", "the internet", "bees", "a lighthouse", "snow")] + [
    f"What is {a} plus {b}? Explain briefly." for a, b in zip(range(3, 19), range(7, 23))]


def _quality(llm) -> dict:
    """Perplexity of QUALITY_TEXT and the greedy texts of QUALITY_PROMPTS (as chat turns where the
    tokenizer has a template)."""
    from engine import SamplingParams
    out = llm.generate([QUALITY_TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    logprobs = [scores[token] for scores, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    tokenizer = llm.tokenizer
    prompts = [{"prompt_token_ids": tokenizer.apply_chat_template([{"role": "user", "content": p}])}
               if tokenizer.has_chat_template else p for p in QUALITY_PROMPTS]
    texts = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0))]
    return {"perplexity": round(math.exp(-sum(logprobs) / len(logprobs)), 4), "text_tokens": len(logprobs),
            "greedy_texts": texts}


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
    result["quality"] = _quality(llm)
    llm.shutdown()
    return result


def _compare(report: dict, name: str, levels: list[int]) -> None:
    """Speed-up and quality of format ``name`` against the de-quantized weights, into ``report``."""
    base, dense = report["systems"]["dequantized"], report["systems"][name]
    speedup = {level: round(base["levels"][level]["ms_per_step"] / dense["levels"][level]["ms_per_step"], 2)
               for level in levels}
    same = sum(a == b for a, b in zip(base["quality"]["greedy_texts"], dense["quality"]["greedy_texts"]))
    report["speedup"][name] = speedup
    report["quality"][name] = {"perplexity_ratio": round(dense["quality"]["perplexity"] / base["quality"]["perplexity"], 4),
                               "identical_greedy_texts": same, "prompts": len(QUALITY_PROMPTS)}
    print(f"{name}: speed-up over de-quantized weights, per level: {speedup}; perplexity "
          f"{dense['quality']['perplexity']} (de-quantized {base['quality']['perplexity']}); identical greedy "
          f"texts: {same} of {len(QUALITY_PROMPTS)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--formats", default="gguf,int8", help="quantization values to measure beside the dense weights")
    ap.add_argument("--eager", action="store_true", help="every engine eager (enforce_eager), not compiled")
    ap.add_argument("--out", default="bench-out/quantized.json")
    args = ap.parse_args(argv)
    from engine.cpu_features import host_cpu
    levels = [int(v) for v in args.levels.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    common = {"dtype": args.dtype, "max_num_seqs": max(levels), "enforce_eager": args.eager}
    report = {"environment": {"host_cpu": host_cpu()}, "systems": {}, "speedup": {}, "quality": {}}
    for name in ("dequantized", *formats):
        print(f"{name}:", flush=True)
        extra = {} if name == "dequantized" else {"quantization": name}
        report["systems"][name] = _measure({**common, **extra}, args.model, levels, args.max_tokens, args.rounds)
    for name in formats:
        _compare(report, name, levels)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
