"""Copy-heavy requests for `vllm bench serve` (its ``custom`` dataset: one ``{"prompt": ...}`` a line):
prompts whose answers quote them, as editing, extraction and quoting requests do.

The quoted texts are the model's own greedy paragraphs, so the copies it makes are in its own words
and a draft that proposes them is accepted as often as the model really copies. Each passage is two
paragraphs (140-190 tokens), so its copy fills the 128 tokens that `vllm bench serve --ignore-eos` asks
for: after one paragraph (70-96 tokens) the model's EOS came early, and what it wrote on past the
ignored EOS (a made-up next conversation) is no copy.

    python -m benchmarks.copy_dataset bench-out/copy.jsonl
    DATASET_ARGS="--dataset-name custom --dataset-path bench-out/copy.jsonl --custom-output-len 128" \\
        SYSTEMS=slotserve bash benchmarks/served_vs_vllm.sh
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOPICS = ["the sea", "a city library", "bread baking", "the moon", "trains", "gardening in spring", "bees",
          "mountain hiking", "the history of maps", "rain", "a village market", "chess", "volcanoes",
          "paper", "owls", "bicycles"]
TASKS = ["Repeat this paragraph exactly, then stop:\n\n{text}",
         "Copy the following text word for word:\n\n{text}",
         "Here is a note. Return it unchanged:\n\n{text}",
         "Quote this passage in full:\n\n{text}"]


def paragraphs(model: str, max_tokens: int) -> list[str]:
    """The model's greedy paragraph on each of ``TOPICS``."""
    from engine import LLM, SamplingParams

    llm = LLM(model)
    asks = [{"prompt_token_ids": llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a short paragraph about {topic}."}])} for topic in TOPICS]
    outs = llm.generate(asks, SamplingParams(temperature=0, max_tokens=max_tokens))
    llm.shutdown()
    return [o.outputs[0].text.strip() for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--paragraph-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    texts = paragraphs(args.model, args.paragraph_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for i, text in enumerate(texts):
            passage = f"{text}\n\n{texts[(i + 1) % len(texts)]}"
            for j in range(len(TASKS)):  # every task over every passage, interleaved
                f.write(json.dumps({"prompt": TASKS[(i + j) % len(TASKS)].format(text=passage)}) + "\n")
    print(f"wrote {len(texts) * len(TASKS)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
