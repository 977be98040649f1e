"""Batched LoRA: one computation per projection for a step that mixes adapters and the base model.

Each fused projection (qkv, o, gate_up, down) holds every slot's A and B stacked,
A ``[slots * parts * rank, in]`` and B.T ``[slots * parts * rank, out]``, where B is zero
outside its part's outputs (q's B writes only q's). For a step's tokens ``x``::

    y += ((x @ A.T) * mask) @ B.T

``mask[t]`` is 1 on the columns of token t's slot and 0 elsewhere (all 0 for the base model).
Two dense matmuls and a multiply: no loop over adapters, no per-token weight gather. The cost
is ``n * parts * rank * (in + out)`` per token, against ``in * out`` for the base weight, where
``n`` is one past the highest slot the step uses (the manager fills low slots first): it grows
with the adapters a replica holds at once, not with the requests. Ranks below
``max_lora_rank`` are zero-padded and the scaling is folded into B.

A compiled model reaches ``delta`` through an opaque op, and a decode CUDA graph of steps with an
adapter row captures it with ``n`` = every slot and the token -> slot map in the graph's input
buffer (engine.cuda_graphs; steps with no adapter row have graphs without LoRA): slots are
written in place, so a replay reads whatever adapters the slots hold now.

Tensor parallelism cuts A and B with the base layer's own loaders: column-parallel projections
keep A whole and split B's rows like their weight; row-parallel ones split A's columns like
their weight and keep B whole, and their partial products join the base's partial output
before its all-reduce (the sum is linear).
"""

from __future__ import annotations

import collections

import torch

from engine.lora.adapter import AdapterInfo, read_weights
from engine.model.layers import LinearBase, RowParallelLinear

PARTS = {
    "self_attn.qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "self_attn.o_proj": (("o_proj", None),),
    "mlp.gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    "mlp.down_proj": (("down_proj", None),),
}
"""Our fused projection -> its PEFT modules in part order, each with the base loader's shard id."""

Shards = dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]]
"""(layer, projection) -> per part, this rank's (A, B) or None where the adapter has no weights."""


class LoRAStep:
    """The running step's token -> slot map (-1: the base model), shared by every projection."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.slots: torch.Tensor | None = None
        self.num_slots = 0
        """Slots this step's LoRA reads: one past the highest one it uses (every slot in a CUDA graph)."""
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def set(self, slots: torch.Tensor | None, num_slots: int = 0) -> None:
        """``slots``: one per token of the step, or None when no token uses an adapter."""
        self.slots, self.num_slots, self._masks = slots, num_slots, {}

    def mask(self, parts: int, dtype: torch.dtype) -> torch.Tensor:
        key = (parts, dtype)
        if key not in self._masks:
            width = parts * self.max_rank
            column_slot = torch.arange(self.num_slots * width, device=self.slots.device) // width
            self._masks[key] = (column_slot[None, :] == self.slots[:, None]).to(dtype)
        return self._masks[key]


class LoRAWeights:
    """Every slot's A and B for one projection; ``delta(x)`` is what the step's adapters add."""

    index = -1
    """This projection's number among the compiled model's LoRA projections (engine.model.compiled)."""

    def __init__(self, layer: LinearBase, parts: tuple, step: LoRAStep) -> None:
        self.layer, self.parts, self.step = layer, parts, step
        self.row_parallel = isinstance(layer, RowParallelLinear)
        width = step.max_loras * len(parts) * step.max_rank
        dtype, device = layer.weight.dtype, layer.weight.device
        self.a = torch.zeros(width, layer.in_features, dtype=dtype, device=device)
        self.b_t = torch.zeros(width, layer.out_features, dtype=dtype, device=device)

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.step.slots is None:
            return None
        n = self.step.num_slots * len(self.parts) * self.step.max_rank
        return ((x @ self.a[:n].T) * self.step.mask(len(self.parts), x.dtype)) @ self.b_t[:n]

    def cut(self, weights: dict) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """This rank's (A, B) of each part from whole tensors (``weights``: module -> (A, B))."""
        out = []
        for module, shard_id in self.parts:
            if module not in weights:
                out.append(None)
                continue
            a, b = weights[module]
            rank = a.shape[0]
            if self.row_parallel:
                a_cut, b_cut = torch.zeros(rank, self.layer.in_features), b
                self.layer.weight_loader(a_cut, a, shard_id)
            else:
                a_cut, b_cut = a, torch.zeros(self.layer.out_features, rank)
                self.layer.weight_loader(b_cut, b, shard_id)
            out.append((a_cut.to(self.a.dtype), b_cut.to(self.a.dtype)))
        return out

    def set_slot(self, slot: int, parts: list | None) -> None:
        width = len(self.parts) * self.step.max_rank
        self.a[slot * width:(slot + 1) * width].zero_()
        self.b_t[slot * width:(slot + 1) * width].zero_()
        for p, part in enumerate(parts or ()):
            if part is not None:
                a, b = part
                start = slot * width + p * self.step.max_rank
                self.a[start:start + a.shape[0]].copy_(a)
                self.b_t[start:start + b.shape[1]].copy_(b.T)


class LoRAModel:
    """The LoRA side of one rank's model: its slots, and the adapters read so far (host LRU)."""

    def __init__(self, model, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        self.step = LoRAStep(max_loras, max_rank)
        self.layers: dict[tuple[int, str], LoRAWeights] = {}
        for i, layer in enumerate(model.layers):
            for name, parts in PARTS.items():
                linear = layer.get_submodule(name)
                linear.lora = self.layers[i, name] = LoRAWeights(linear, parts, self.step)
        self.max_cpu_loras = max_cpu_loras
        self._host: collections.OrderedDict[bytes, Shards] = collections.OrderedDict()

    def activate(self, slot: int, info: AdapterInfo) -> None:
        """Put ``info``'s weights in ``slot`` (from host memory when they were read before)."""
        shards = self._host.pop(info.digest, None)
        if shards is None:
            shards = self._cut(read_weights(info))
        self._host[info.digest] = shards
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        for key, weights in self.layers.items():
            weights.set_slot(slot, shards.get(key))

    def _cut(self, whole: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> Shards:
        by_layer: dict[int, dict] = collections.defaultdict(dict)
        for (layer, module), ab in whole.items():
            by_layer[layer][module] = ab
        return {(i, name): w.cut(by_layer[i]) for (i, name), w in self.layers.items() if by_layer.get(i)}

    def set_step(self, chunks: list, device: torch.device) -> None:
        """The token -> slot map of a step's chunks, in the order the runner packs their tokens."""
        if all(c.lora_slot < 0 for c in chunks):
            self.step.set(None)
            return
        counts = torch.tensor([c.num_tokens for c in chunks])
        slots = torch.tensor([c.lora_slot for c in chunks]).repeat_interleave(counts)
        self.step.set(slots.to(device, non_blocking=True), 1 + max(c.lora_slot for c in chunks))
