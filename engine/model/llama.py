"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens of all requests in a step are packed along one dimension (no padding, no batch
dimension); attention goes through the backend with the step's metadata. Checkpoint names
that pack into fused parameters are declared in ``PACKED``; their loaders place each part.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.model.arch import ModelArch
from engine.model.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                                 RowParallelLinear, VocabParallelEmbedding, silu_and_mul)
from engine.model.rotary import RotaryEmbedding
from engine.parallel import ParallelGroup, check_tp_shapes

# checkpoint projection name -> (fused parameter, part)
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    compiled_op = None
    """The op a compiled graph calls (engine.model.compiled sets it): ``slotserve::attention``, or the
    kernel library's C++ twin of it."""

    def __init__(self, arch: ModelArch, group: ParallelGroup, backend: AttentionBackend, rotary: RotaryEmbedding):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads,
                                          arch.qkv_bias, group)
        heads = self.qkv_proj.heads
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, False, group,
                                        in_shard=(heads.q_start * arch.head_dim, heads.q_count * arch.head_dim))
        self.num_heads = self.qkv_proj.local_heads
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.head_dim = arch.head_dim
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.backend = backend
        self.rotary = rotary

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata):
        d = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = q.view(-1, self.num_heads, d)
        k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if meta is None:  # compiled: the step's metadata reaches the op out of band
            out = self.compiled_op(q, k, v, kv_cache[0], kv_cache[1])
        else:
            out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, group: ParallelGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [arch.intermediate_size] * 2, False, group)
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, False, group)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch, group, backend, rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, group, backend, rotary)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, group)

    def forward(self, x, positions, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderForCausalLM(nn.Module):
    aux_layers: tuple[int, ...] = ()
    """Layers whose input (the residual stream) ``hidden_states`` also returns, side by side: what an
    EAGLE-3 head reads (engine.spec_eagle). Set before the model is compiled; never changed after."""
    aux_out: torch.Tensor | None = None
    """The last forward's ``aux_layers`` streams ``[tokens, 3 x hidden]`` (None without aux layers)."""

    def __init__(self, arch: ModelArch, group: ParallelGroup, backend: AttentionBackend, max_positions: int):
        super().__init__()
        check_tp_shapes(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, arch.vocab_size, group.world_size)
        self.arch = arch
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, group)
        rotary = RotaryEmbedding(arch, max_positions)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(arch, group, backend, rotary) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, group)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[len(logits_indices), vocab]`` for the selected token rows only (on rank 0;
        other tensor-parallel ranks compute their vocabulary slice and get None)."""
        return self.logits(self.keep_aux(self.hidden_states(input_ids, positions, kv_caches, meta)), logits_indices)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                      meta: AttentionMetadata | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output for every token (and with ``aux_layers``, their streams too).
        ``meta`` None: attention goes through ``slotserve::attention`` (engine.model.compiled), which
        reads the step context."""
        x = self.embed_tokens(input_ids)
        streams = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_layers:
                streams[i] = x
            x = layer(x, positions, kv_cache, meta)
        if not self.aux_layers:
            return x
        return x, torch.cat([streams[i] for i in self.aux_layers], dim=-1)

    def keep_aux(self, out) -> torch.Tensor:
        """``hidden_states``' last-layer output; its aux streams, if any, go to ``aux_out``."""
        if isinstance(out, tuple):
            out, self.aux_out = out
        return out

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(self.norm(hidden.index_select(0, logits_indices)))
        return None if logits is None else logits.float()

    def prepack(self, batch_hint: int, amx: bool = False) -> None:
        """Pack every linear weight for oneDNN's CPU GEMM (engine.model.layers.pack_weight) and, with
        ``amx``, for the AMX kernel too (``pack_amx``)."""
        for module in self.modules():
            if hasattr(module, "prepack") and module is not self:
                module.prepack(batch_hint, amx)

    def parameter_for(self, checkpoint_name: str) -> tuple[str, object] | None:
        """Map a checkpoint tensor name to (our parameter name, shard id); None to skip it."""
        name = checkpoint_name
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb" in name:
            return None
        if name.startswith("lm_head") and self.arch.tie_word_embeddings:
            return None
        for ckpt, (fused, part) in PACKED.items():
            if f".{ckpt}." in name:
                return name.replace(ckpt, fused), part
        return name, None
