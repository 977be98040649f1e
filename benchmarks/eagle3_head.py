"""A random EAGLE-3 head of a target's shapes, in the published checkpoint layout, for measuring
what the head and verification cost (trained heads decide acceptance; random ones accept almost
nothing, so speed-ups need a trained head):

    python -m benchmarks.eagle3_head smollm2-135m bench-out/eagle3-head
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def write_random_head(target: str, out: Path, draft_vocab: int = 32000, seed: int = 0) -> Path:
    """Write a head for ``target`` (a model name or directory): its hidden size, heads and vocabulary,
    one decoder layer, ``draft_vocab`` draft tokens (32000, as published Llama heads have)."""
    from safetensors.torch import save_file

    from engine.models_hub import resolve_model

    cfg = json.loads((Path(resolve_model(target)) / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d, inter = cfg.get("head_dim") or h // heads, cfg["intermediate_size"]
    draft_vocab = min(draft_vocab, vocab)
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc": (h, 3 * h), "lm_head": (draft_vocab, h), "midlayer.self_attn.q_proj": (heads * d, 2 * h),
              "midlayer.self_attn.k_proj": (kv_heads * d, 2 * h), "midlayer.self_attn.v_proj": (kv_heads * d, 2 * h),
              "midlayer.self_attn.o_proj": (h, heads * d), "midlayer.mlp.gate_proj": (inter, h),
              "midlayer.mlp.up_proj": (inter, h), "midlayer.mlp.down_proj": (h, inter)}
    weights = {f"{name}.weight": torch.randn(*shape, generator=g) / shape[1] ** 0.5 for name, shape in shapes.items()}
    for norm in ("norm", "midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm"):
        weights[f"{norm}.weight"] = torch.ones(h)
    chosen = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    weights["d2t"] = chosen - torch.arange(draft_vocab)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
              str(out / "model.safetensors"))
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling")
    head_cfg = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    head_cfg |= {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": draft_vocab}
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("out", type=Path)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    args = ap.parse_args(argv)
    print(write_random_head(args.target, args.out, args.draft_vocab))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
