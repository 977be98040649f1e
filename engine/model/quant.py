"""Linear layers served from a GGUF file's quantized blocks (``quantization: gguf``, CPU).

A decode step reads every weight once, so its floor is the weights' bytes over the memory
bandwidth: the default model's Q4_1 file holds its linear layers in 5 bits a weight, against
the 32 of the float32 model the converted checkpoint holds. With ``quantization: gguf`` the
checkpoint still supplies the configuration, norms and embedding rows; each linear layer (and
the LM head) instead keeps the file's blocks as they are and multiplies them in place
(engine/csrc/gguf_linear.cpp). The weights served are the file's values exactly (the built-in
model's converted checkpoint holds them rounded to bfloat16).

Inputs of up to ``QUANT_MAX_ROWS`` rows (decode steps) go through the kernel; larger ones
(prefill chunks) de-quantize the layer's weight for the one GEMM (a few hundred microseconds
for a layer of the default model, small beside a GEMM of that many rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

KERNEL_TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
"""GGUF quant types multiplied in place: name -> (ggml type id, bytes per 32-weight block)."""

QUANT_MAX_ROWS = 32
"""Inputs of at most this many rows use the block kernel; larger ones de-quantize the layer for one
GEMM. One 1536x576 Q4_1 layer on the 2-core AVX-512 VNNI host: the kernel takes 0.12 / 0.71 / 2.5 ms
at 1 / 16 / 64 rows, de-quantizing and the GEMM 0.4 / 1.4-2.2 / 1.5-1.9 ms."""

_lib = torch.library.Library("slotserve", "FRAGMENT")
_lib.define("gguf_linear(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor")


def _gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    x32 = x.float().contiguous()
    if x.shape[0] <= QUANT_MAX_ROWS:
        out = x32.new_empty(x.shape[0], blocks.shape[0])
        torch.ops.slotserve_cpu.gguf_linear(out, x32, blocks, qtype)
    else:
        out = F.linear(x32, torch.ops.slotserve_cpu.gguf_dequantize(blocks, qtype, in_features))
    return out if x.dtype == torch.float32 else out.to(x.dtype)


_lib.impl("gguf_linear", _gguf_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("slotserve::gguf_linear", lib=_lib)
def _gguf_linear_shape(x, blocks, qtype, in_features):
    return x.new_empty(x.shape[0], blocks.shape[0])


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ W.T`` for a weight held as GGUF blocks (``attach_gguf``)."""
    return torch.ops.slotserve.gguf_linear(x, blocks, qtype, x.shape[-1])


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str
    rows: np.ndarray
    """``[out_features, bytes]`` for a quantized tensor (one row of blocks per output feature)."""


def _reverse_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two rotary halves of each Llama head's q/k rows; the
    checkpoint (and the rotary code) keeps them in halves. Whole rows move: blocks stay intact."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(n, -1)


class GGUFFile:
    def __init__(self, path: Path) -> None:
        import gguf
        try:
            self.reader = gguf.GGUFReader(path)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}
        field = self.reader.get_field("general.architecture")
        self.architecture = bytes(field.parts[-1]).decode() if field is not None else None

    def quantized(self, name: str, out_features: int, in_features: int, heads: int | None = None) -> GGUFTensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path.name} has no tensor {name}")
        type_name = tensor.tensor_type.name
        if type_name not in KERNEL_TYPES:
            raise ModelLoadError(f"{self.path.name}: {name} is {type_name}; quantization gguf multiplies "
                                 f"{', '.join(KERNEL_TYPES)} in place")
        block_bytes = KERNEL_TYPES[type_name][1]
        rows = np.asarray(tensor.data)
        expected = (out_features, in_features // 32 * block_bytes)
        if in_features % 32 or rows.shape != expected:
            raise ModelLoadError(f"{self.path.name}: {name} ({type_name}) holds {tuple(int(d) for d in tensor.shape)}"
                                 f" weights; the model expects [{out_features}, {in_features}]")
        if heads is not None and self.architecture == "llama":
            rows = _reverse_permute(rows, heads)
        return GGUFTensor(name, type_name, rows)


def _attach(layer, parts: list[GGUFTensor]) -> None:
    kinds = {p.type_name for p in parts}
    if len(kinds) != 1:
        raise ModelLoadError(f"{', '.join(p.name for p in parts)} have different types ({', '.join(sorted(kinds))}); "
                             "a fused layer needs one")
    layer.qtype = KERNEL_TYPES[kinds.pop()][0]
    # A buffer (engine.model.layers registers it), so a compiled graph takes the blocks as an input.
    layer.qweight = torch.from_numpy(np.concatenate([p.rows for p in parts]))
    layer.weight.data = layer.weight.data.new_empty(0)


def attach_gguf(model, path: Path) -> dict[str, int]:
    """Give every linear layer of ``model`` (and its LM head) the blocks of ``path``; returns the
    count of tensors per GGUF type."""
    if model.embed_tokens.group.world_size > 1:
        raise ModelLoadError("quantization gguf needs tensor_parallel_size 1 (sharding blocks is not built yet)")
    from engine.cpu_kernels import compiler_problem, load_kernel
    problem = compiler_problem()
    if problem is not None:
        raise ModelLoadError(f"quantization gguf needs the CPU kernel library: {problem}")
    load_kernel()
    file, arch = GGUFFile(path), model.arch
    d, hidden, inter = arch.head_dim, arch.hidden_size, arch.intermediate_size
    types: dict[str, int] = {}

    def take(name, out_features, in_features, heads=None):
        tensor = file.quantized(name, out_features, in_features, heads)
        types[tensor.type_name] = types.get(tensor.type_name, 0) + 1
        return tensor

    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        _attach(attn.qkv_proj, [take(f"blk.{i}.attn_q.weight", arch.num_heads * d, hidden, arch.num_heads),
                                take(f"blk.{i}.attn_k.weight", arch.num_kv_heads * d, hidden, arch.num_kv_heads),
                                take(f"blk.{i}.attn_v.weight", arch.num_kv_heads * d, hidden)])
        _attach(attn.o_proj, [take(f"blk.{i}.attn_output.weight", hidden, arch.num_heads * d)])
        _attach(mlp.gate_up_proj, [take(f"blk.{i}.ffn_gate.weight", inter, hidden),
                                   take(f"blk.{i}.ffn_up.weight", inter, hidden)])
        _attach(mlp.down_proj, [take(f"blk.{i}.ffn_down.weight", hidden, inter)])
    head = "output.weight" if "output.weight" in file.tensors else "token_embd.weight"
    lm_head = model.lm_head
    tied = lm_head.weight is model.embed_tokens.weight
    try:
        tensor = take(head, arch.vocab_size, hidden)
    except ModelLoadError as exc:  # an LM head in a type without a kernel stays dense
        logger.info("LM head stays dense: %s", exc)
    else:
        lm_head.qtype = KERNEL_TYPES[tensor.type_name][0]
        lm_head.qweight = torch.from_numpy(np.array(tensor.rows))  # a copy: the reader maps the file
        if not tied:
            lm_head.weight.data = lm_head.weight.data.new_empty(0)
    return types
