"""The model every system loads: a tiny random Llama for quick runs, random weights of a real
model's shape (``--model-shape``: no hub, no tokenizer; throughput does not depend on the
weights' values), or the default model."""

from __future__ import annotations

import json
from pathlib import Path

TINY_MODEL_SHAPE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
}
# Sizes of public checkpoints; positions capped at 8192, which every workload and the profile fit.
MODEL_SHAPES: dict[str, tuple[str, dict]] = {
    "tiny": ("llama", {**TINY_MODEL_SHAPE, "tie_word_embeddings": False}),
    "smollm2-135m": ("llama", {  # SmolLM2-135M-Instruct, the served default model
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}),
    "qwen2-0.5b": ("qwen2", {  # Qwen2.5-0.5B
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "llama-1b": ("llama", {  # Llama-3.2-1B
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "llama-8b": ("llama", {  # Llama-3.1-8B
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
}
SHARD_BYTES = 2 << 30
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def make_shaped_model_dir(path: str | Path, shape: str, dtype: str = "bfloat16", device: str = "cpu",
                          seed: int = 0) -> Path:
    """Write config.json and random safetensors weights of ``shape`` (MODEL_SHAPES) to ``path``.

    Names and sizes come from transformers' own model built on the meta device; matrices are
    drawn N(0, 0.02) on ``device`` (fast on a GPU), norms are ones. Sharded like a hub checkpoint."""
    import torch
    import transformers
    from safetensors.torch import save_file

    if shape not in MODEL_SHAPES:
        raise ValueError(f"model shape must be one of {', '.join(MODEL_SHAPES)}, got {shape!r}")
    arch, fields = MODEL_SHAPES[shape]
    config_name, model_name = _CLASSES[arch]
    config = getattr(transformers, config_name)(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.dtype, config.architectures = dtype, [model_name]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    with torch.device("meta"):
        names = {n: tuple(t.shape) for n, t in getattr(transformers, model_name)(config).state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    torch_dtype = getattr(torch, dtype)
    size = torch.empty((), dtype=torch_dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, dims in names.items():
        nbytes = size * int(torch.Size(dims).numel())
        if shards[-1] and used + nbytes > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    gen = torch.Generator(device).manual_seed(seed)
    weight_map = {}
    for i, group in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in group:
            t = torch.empty(names[name], dtype=torch_dtype, device=device)
            t = t.fill_(1.0) if t.dim() == 1 and "norm" in name else t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()
            weight_map[name] = file
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(size * int(torch.Size(d).numel()) for d in names.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return path


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
