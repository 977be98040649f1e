"""PEFT LoRA adapters: read one from disk and check it against the base model.

An adapter is a directory with ``adapter_config.json`` and ``adapter_model.safetensors``, as
``peft``'s ``save_pretrained`` writes it. Only plain LoRA on the decoder's projections is
served; every PEFT option that would change the computation (DoRA, biases, per-module ranks,
extra trained modules) is refused by name rather than ignored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import AdapterLoadError
from engine.kv.hashing import ROOT_HASH
from engine.model.arch import ModelArch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# PEFT options that change what the adapter computes: refused unless at their no-op value.
_NO_OP = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
          "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
          "target_parameters": None, "trainable_token_indices": None, "layer_replication": None}


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: Path
    rank: int
    scaling: float
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA): folded into B when the weights are read."""
    modules: frozenset[str]
    digest: bytes
    """sha256 of the weights file: an adapter replaced under the same name is another adapter to
    the prefix cache and the host cache."""

    @functools.cached_property
    def root_hash(self) -> bytes:
        """The parent of a request's first KV block: two adapters never share cached KV."""
        return hashlib.sha256(ROOT_HASH + b"lora" + self.digest).digest()

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "path": str(self.path), "rank": self.rank, "scaling": self.scaling,
                           "modules": sorted(self.modules), "digest": self.digest.hex()})

    @classmethod
    def from_json(cls, text: str) -> "AdapterInfo":
        d = json.loads(text)
        return cls(d["name"], Path(d["path"]), d["rank"], d["scaling"], frozenset(d["modules"]),
                   bytes.fromhex(d["digest"]))


def full_shape(arch: ModelArch, module: str, which: str, rank: int) -> tuple[int, int]:
    """Unsharded shape of a module's ``lora_A`` ([rank, in]) or ``lora_B`` ([out, rank])."""
    q, kv, h, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, \
        arch.intermediate_size
    in_out = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}[module]
    return (rank, in_out[0]) if which == "A" else (in_out[1], rank)


def _config(path: Path, max_rank: int) -> tuple[int, float, frozenset[str]]:
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except OSError as exc:
        raise AdapterLoadError(f"{path}: cannot read {CONFIG_FILE}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise AdapterLoadError(f"{path / CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(f"{path}: peft_type must be 'LORA', got {cfg.get('peft_type')!r}"
                               if isinstance(cfg, dict) else f"{path / CONFIG_FILE} must hold an object")
    for key, no_op in _NO_OP.items():
        if cfg.get(key, no_op) not in (no_op, None) and not (no_op == {} and cfg.get(key) == {}):
            raise AdapterLoadError(f"{path}: {key}={cfg[key]!r} is not supported (only {no_op!r})")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterLoadError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterLoadError(f"{path}: rank {rank} is above max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterLoadError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets or any(t not in MODULES for t in targets):
        raise AdapterLoadError(f"{path}: target_modules must name some of {', '.join(MODULES)}, got "
                               f"{cfg.get('target_modules')!r}")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    return rank, scaling, frozenset(targets)


def _digest(file: Path) -> bytes:
    h = hashlib.sha256()
    with file.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.digest()


def read_adapter(name: str, path: str | Path, arch: ModelArch, max_rank: int) -> AdapterInfo:
    """Check an adapter directory against ``arch`` without loading its weights."""
    from safetensors import SafetensorError, safe_open

    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise AdapterLoadError(f"adapter {name!r}: {path} is not a directory")
    rank, scaling, modules = _config(path, max_rank)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterLoadError(f"adapter {name!r}: {path} has no {WEIGHTS_FILE}")
    seen = set()
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            for key in f.keys():
                layer, module, which = _parse_key(key, arch.num_layers, modules, path)
                shape, want = tuple(f.get_slice(key).get_shape()), full_shape(arch, module, which, rank)
                if shape != want:
                    raise AdapterLoadError(f"{path}: {key} has shape {list(shape)}, this base model needs "
                                           f"{list(want)} (an adapter of another model?)")
                seen.add((layer, module, which))
    except SafetensorError as exc:
        raise AdapterLoadError(f"{path}: cannot read {WEIGHTS_FILE}: {exc}") from None
    missing = [f"layer {i} {m}.lora_{w}" for i in range(arch.num_layers) for m in sorted(modules) for w in "AB"
               if (i, m, w) not in seen]
    if missing:
        raise AdapterLoadError(f"{path}: {WEIGHTS_FILE} lacks {', '.join(missing[:4])}"
                               f"{' ...' if len(missing) > 4 else ''}")
    return AdapterInfo(name, path, rank, scaling, modules, _digest(weights))


def _parse_key(key: str, num_layers: int, modules: frozenset[str], path: Path) -> tuple[int, str, str]:
    m = _KEY.fullmatch(key)
    if m is None or m.group(3) not in modules or int(m.group(1)) >= num_layers:
        raise AdapterLoadError(f"{path}: unexpected tensor {key!r} (served: lora_A/lora_B of "
                               f"{', '.join(sorted(modules))} in layers 0..{num_layers - 1})")
    return int(m.group(1)), m.group(3), m.group(4)


def read_weights(info: AdapterInfo) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B * scaling [out, r]), whole (each rank cuts its part).

    The file must still be the one ``read_adapter`` checked (its digest): one changed or removed
    since is an AdapterLoadError, never weights of other shapes or another adapter's."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        data = (info.path / WEIGHTS_FILE).read_bytes()
        if hashlib.sha256(data).digest() != info.digest:
            raise AdapterLoadError(f"adapter {info.name!r}: {info.path / WEIGHTS_FILE} changed since it was "
                                   "loaded; load it again")
        tensors = load(data)
    except (OSError, SafetensorError) as exc:
        raise AdapterLoadError(f"adapter {info.name!r}: cannot read {info.path / WEIGHTS_FILE}: {exc}") from None
    out = {}
    for key, a in tensors.items():
        layer, module, which = _parse_key(key, 1 << 30, info.modules, info.path)  # checked by read_adapter
        if which == "A":
            b = tensors[key[:-len("lora_A.weight")] + "lora_B.weight"]
            out[layer, module] = (a.float(), b.float() * info.scaling)
    return out

