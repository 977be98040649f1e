"""The model every system loads: a tiny random Llama for quick runs, the default model otherwise."""

from __future__ import annotations

import json
from pathlib import Path

TINY_MODEL_SHAPE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
}


def make_tiny_model_dir(path: str | Path, seed: int = 0) -> Path:
    """Write a small random LlamaForCausalLM (config.json + safetensors) to ``path``; reused if already there."""
    path = Path(path)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_MODEL_SHAPE, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def resolve_default_model(name: str) -> Path:
    """A local HF directory as is; a built-in name (e.g. ``smollm2-135m``) through engine.models_hub."""
    if Path(name).is_dir():
        return Path(name)
    from engine.models_hub import resolve_model

    return Path(resolve_model(name))


def default_model_name() -> str:
    try:
        from engine.models_hub import DEFAULT_MODEL
    except ImportError:
        return "smollm2-135m"
    return DEFAULT_MODEL


def model_vocab_size(model_dir: str | Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config", config)
    return int(text["vocab_size"])


def model_max_len(model_dir: str | Path) -> int | None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config).get("max_position_embeddings")
