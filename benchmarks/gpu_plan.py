"""What a served-size engine makes of one GPU: the attention kernel, the gather buffer (none for
kernels that read the paged cache in place), the captured decode graphs and the KV pool the
memory budget leaves, then a short decode of many long contexts through those graphs.

    python -m benchmarks.gpu_plan --model-shape llama-1b --slots 256 --max-model-len 8192
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", default="llama-1b")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--device", default="cuda", help="cpu runs it too (no graphs, no memory budget)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")

    import torch

    from benchmarks import models
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = models.make_shaped_model_dir(tmp, args.model_shape, "bfloat16", args.device)
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig.from_options(
            str(model_dir), max_num_seqs=args.slots, max_num_batched_tokens=args.max_model_len, block_size=16,
            dtype="bfloat16", device=args.device, max_model_len=args.max_model_len))
        r = engine.runner
        graphs = r.graphs
        print(f"ready in {time.perf_counter() - t0:.1f} s (compile {r.compile_s or 0:.1f} s); "
              f"kernel {r.backend.name}; gather buffer {r.backend.scratch_bytes(r.max_context_tokens, r.dtype)} bytes; "
              f"decode graphs {0 if graphs is None else len(graphs.keys)}; KV pool {r.num_blocks} blocks "
              f"({r.num_blocks * r.block_size} tokens)"
              + (f"; torch holds {torch.cuda.memory_reserved() / 2**30:.1f} GiB" if args.device == "cuda" else ""))
        # One shared 1,000-token prompt: the prefix cache computes it once.
        prompt = [10 + i % (engine.vocab_size - 10) for i in range(1000)]
        for _ in range(args.requests):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        t1, tokens = time.perf_counter(), 0
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        print(f"{args.requests} requests x 64 tokens over 1,000-token contexts: {tokens} tokens in "
              f"{time.perf_counter() - t1:.2f} s")


if __name__ == "__main__":
    main()
