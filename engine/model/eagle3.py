"""EAGLE-3 draft heads: one decoder layer that reads the target's own hidden states.

The published checkpoint layout (EAGLE-3's own, as vLLM and SGLang load it; speculators' nested
``transformer_layer_config`` too): ``fc`` maps three of the target's residual streams (the inputs of
layers ``eagle_aux_hidden_state_layer_ids``, by default 2, L/2 and L-3), concatenated, to the head's
width; the layer's attention takes ``[input_layernorm(embedding of the next token), hidden_norm(hidden)]``
(twice the width) and adds to ``hidden``; ``lm_head`` scores a smaller draft vocabulary, and
``d2t[i]`` turns draft token i into target token ``i + d2t[i]``. The token embedding is the
target's unless the checkpoint ships one.

At position i the head reads (token i + 1, the target's streams at i) and predicts token i + 2;
its next drafts chain its own pre-norm output in place of the target's streams (engine.spec_eagle).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.errors import ModelLoadError
from engine.model.arch import ModelArch
from engine.model.layers import ColumnParallelLinear, LinearBase, QKVParallelLinear, RMSNorm, VocabParallelEmbedding
from engine.model.llama import MLP, PACKED, Attention
from engine.model.loader import _default_dtype, checkpoint_files
from engine.model.rotary import RotaryEmbedding
from engine.parallel import ParallelGroup

logger = logging.getLogger(__name__)

LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")
"""Where checkpoints keep the head's one decoder layer (EAGLE-3's name first, then Llama's)."""


@dataclass(frozen=True)
class Eagle3Arch:
    layer: ModelArch
    """The head's decoder layer (its ``vocab_size`` is the target's: the embedding's rows)."""
    target_hidden_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    """The target layers whose inputs (the residual stream) ``fc`` reads, in order."""
    norm_before_residual: bool

    @classmethod
    def from_dir(cls, path: Path, target: ModelArch) -> "Eagle3Arch":
        source = path / "config.json"
        try:
            cfg = json.loads(source.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"EAGLE-3 head {path}: no readable config.json ({exc})") from exc
        archs = [a for a in cfg.get("architectures") or [] if "eagle3" in a.lower()]
        if not archs and cfg.get("speculators_model_type") != "eagle3":
            raise ModelLoadError(f"{source} is not an EAGLE-3 head: its architectures are "
                                 f"{cfg.get('architectures')!r} (expected e.g. 'LlamaForCausalLMEagle3')")
        layer_cfg = {**cfg, **(cfg.get("transformer_layer_config") or {})}
        if int(layer_cfg.get("num_hidden_layers", 1)) != 1:
            raise ModelLoadError(f"{source}: num_hidden_layers is {layer_cfg['num_hidden_layers']}; "
                                 "EAGLE-3 heads with one decoder layer are supported")
        layer = ModelArch.from_dict({**layer_cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1},
                                    source=str(source))
        if layer.vocab_size != target.vocab_size:
            raise ModelLoadError(f"{source}: vocab_size {layer.vocab_size} is not the target's "
                                 f"({target.vocab_size}): the head must be trained for this target")
        target_hidden = int(cfg.get("target_hidden_size") or layer.hidden_size)
        if target_hidden != target.hidden_size:
            raise ModelLoadError(f"{source}: target_hidden_size {target_hidden} is not the target's hidden_size "
                                 f"({target.hidden_size})")
        aux = (cfg.get("eagle_aux_hidden_state_layer_ids")
               or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        n = target.num_layers
        aux = tuple(int(i) for i in aux) if aux else (2, n // 2, n - 3)
        if len(aux) != 3 or any(not 0 <= i < n for i in aux):
            raise ModelLoadError(f"{source}: eagle_aux_hidden_state_layer_ids {list(aux)} must name 3 layers of "
                                 f"the target's {n} (0 to {n - 1})")
        return cls(layer=layer, target_hidden_size=target_hidden,
                   draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.vocab_size), aux_layers=aux,
                   norm_before_residual=bool(cfg.get("norm_before_residual", False)))


class Eagle3Layer(nn.Module):
    def __init__(self, arch: ModelArch, group: ParallelGroup, backend: AttentionBackend, rotary: RotaryEmbedding,
                 norm_before_residual: bool) -> None:
        super().__init__()
        h = arch.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, arch.rms_norm_eps)
        self.self_attn = Attention(arch, group, backend, rotary)
        # Its queries, keys and values read the embedding and the hidden state side by side.
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, arch.head_dim, arch.num_heads, arch.num_kv_heads,
                                                    arch.qkv_bias, group)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps)
        self.mlp = MLP(arch, group)

    def forward(self, embeds, hidden, positions, kv_cache, meta: AttentionMetadata):
        if self.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        x = residual + self.self_attn(x, positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    def __init__(self, ea: Eagle3Arch, backend: AttentionBackend, max_positions: int, own_embedding: bool) -> None:
        super().__init__()
        arch, group = ea.layer, ParallelGroup()
        self.ea = ea
        self.fc = ColumnParallelLinear(3 * ea.target_hidden_size, arch.hidden_size, False, group)
        self.rotary = RotaryEmbedding(arch, max_positions)
        self.midlayer = Eagle3Layer(arch, group, backend, self.rotary, ea.norm_before_residual)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(arch.hidden_size, ea.draft_vocab_size, False, group)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, group) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(ea.draft_vocab_size, dtype=torch.int64), persistent=False)

    def forward(self, input_ids, hidden, positions, kv_cache, meta, embed: nn.Module) -> torch.Tensor:
        """The layer's output (before the final norm) for every token; ``hidden``: the target's three
        streams side by side (3 x its width, through ``fc``) or the head's own earlier output."""
        if hidden.shape[-1] != self.ea.layer.hidden_size:
            hidden = self.fc(hidden)
        embeds = (self.embed_tokens or embed)(input_ids)
        return self.midlayer(embeds, hidden.to(embeds.dtype), positions, kv_cache, meta)

    def prepack(self, batch_hint: int, amx: bool = False) -> None:
        """Pack its linear weights for the CPU GEMM, as the target's are (DecoderForCausalLM.prepack)."""
        for module in (self.fc, self.lm_head, *self.midlayer.modules()):
            if isinstance(module, LinearBase):
                module.prepack(batch_hint, amx)

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The greedy next token (a target token id) of each row of ``forward``'s output."""
        best = self.lm_head(self.norm(out)).argmax(dim=-1)
        return best + self.d2t[best]

    def parameter_for(self, name: str) -> tuple[str, object] | None:
        if name == "t2d":  # the reverse map: drafts only need d2t
            return None
        for prefix in LAYER_PREFIXES:
            if name.startswith(prefix):
                name = "midlayer." + name[len(prefix):]
                for ckpt, (fused, part) in PACKED.items():
                    if f".{ckpt}." in name:
                        return name.replace(ckpt, fused), part
                return name, None
        return name.removeprefix("model."), None


def load_eagle3(path: Path, ea: Eagle3Arch, backend: AttentionBackend, dtype: torch.dtype,
                device: torch.device, max_positions: int) -> Eagle3Head:
    """The head of checkpoint ``path`` (of shape ``ea``, from ``Eagle3Arch.from_dir``), weights in ``dtype``."""
    from safetensors import SafetensorError, safe_open

    files = checkpoint_files(path)
    try:
        names = {n: file for file in files for n in safe_open(str(file), framework="pt").keys()}
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"cannot read the EAGLE-3 head in {path}: {exc}") from exc
    own_embedding = any(n.removeprefix("model.") == "embed_tokens.weight" for n in names)
    with _default_dtype(dtype), torch.device(device):
        head = Eagle3Head(ea, backend, max_positions, own_embedding)
    params = dict(head.named_parameters())
    expected = {(n, p) for n in params for p in ({"q", "k", "v"} if "qkv_proj" in n else
                                                 {0, 1} if "gate_up_proj" in n else {None})}
    if ea.draft_vocab_size != ea.layer.vocab_size:
        expected.add(("d2t", None))
    loaded = set()
    for name, file in names.items():
        target_name = head.parameter_for(name)
        if target_name is None:
            continue
        pname, part = target_name
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                if pname == "d2t":
                    _load_d2t(head, f.get_tensor(name), ea)
                elif pname in params:
                    params[pname].weight_loader(params[pname], f.get_slice(name), part)
                else:
                    logger.debug("EAGLE-3 head: ignoring checkpoint tensor %s", name)
                    continue
        except ValueError as exc:
            raise ModelLoadError(f"EAGLE-3 head {path.name}: {name}: {exc}") from exc
        loaded.add((pname, part))
    missing = sorted(f"{n}[{p}]" if p is not None else n for n, p in expected - loaded)
    if missing:
        raise ModelLoadError(f"EAGLE-3 head {path} lacks weights for: {', '.join(missing[:10])}")
    return head.eval()


def _load_d2t(head: Eagle3Head, d2t: torch.Tensor, ea: Eagle3Arch) -> None:
    if tuple(d2t.shape) != (ea.draft_vocab_size,) or d2t.dtype.is_floating_point:
        raise ValueError(f"d2t must be {ea.draft_vocab_size} integers (draft_vocab_size), got "
                         f"{tuple(d2t.shape)} {d2t.dtype}")
    target = torch.arange(ea.draft_vocab_size) + d2t.long()
    if int(target.min()) < 0 or int(target.max()) >= ea.layer.vocab_size:
        raise ValueError(f"d2t maps draft tokens outside the target's vocabulary (0 to {ea.layer.vocab_size - 1})")
    head.d2t.copy_(d2t)
