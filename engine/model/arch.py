"""What the decoder needs to know about a checkpoint, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

# architecture -> (qkv bias, q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArch":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{cfg_path} is not valid JSON: {exc}") from exc
        return cls.from_dict(cfg, source=str(cfg_path))

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> "ModelArch":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(f"unsupported architecture {archs or cfg.get('model_type')!r} in {source}; "
                                 f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if cfg.get("attention_bias"):
            qkv_bias = True
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            rope = _rope_parameters(cfg)
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.pop("rope_theta", 10000.0)),
                rope_scaling=tuple(sorted(rope.items())),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                qk_norm=qk_norm,
                sliding_window=int(window) if window else None,
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source} lacks required field {exc.args[0]!r}") from exc


def _rope_parameters(cfg: dict) -> dict:
    """transformers 5 writes ``rope_parameters``; older checkpoints ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        if cfg.get("rope_theta") is not None:
            params["rope_theta"] = cfg["rope_theta"]
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if params["rope_type"] not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope_type {params['rope_type']!r}; supported: {', '.join(ROPE_TYPES)}")
    return params
