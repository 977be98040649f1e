"""Linear layers served from a GGUF file's quantized blocks (``quantization: gguf``, CPU).

A decode step reads every weight once, so its floor is the weights' bytes over the memory
bandwidth: the default model's Q4_1 file holds its linear layers in 5 bits a weight, against
the 32 of the float32 model the converted checkpoint holds. With ``quantization: gguf`` the
checkpoint still supplies the configuration, norms and embedding rows; each linear layer (and
the LM head) instead holds the file's blocks and multiplies them in place:

- every type of ``KERNEL_TYPES``, where the CPU has AVX-512 VNNI or AVX2: packed once at load
  (``pack_int8``) in groups of 16 output columns for int8 dot products with activations quantized
  per 32-block, as llama.cpp does (engine/csrc/gguf_linear_int8.cpp; both instruction sets give the
  same outputs), at every step size; a tensor whose rows are no multiple of 16 keeps its blocks;
- otherwise, the file's blocks as they are, widened to float32 in registers beside the FMAs
  (engine/csrc/gguf_linear.cpp): exactly the file's values, summed in another order.

The built-in model's converted checkpoint holds the file's values rounded to bfloat16; the blocks
are the values themselves. On the float32 kernel, steps of more than ``QUANT_MAX_ROWS`` rows
(prefill chunks) de-quantize the layer's weight for one GEMM: a few hundred microseconds a layer of
the default model, small beside a GEMM of that many rows (in a model with int8 layers, dense tiles
summed as the block kernel sums instead: ``make_batch_invariant``). The int8 kernel beats that GEMM
at every size measured and takes every step.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

KERNEL_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
                "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}
"""GGUF quant types multiplied in place: name -> (ggml type id, weights per block, bytes per block).
Q4_K_M, the most common download, is Q4_K with Q6_K for some layers (and the head); where a row is no
multiple of 256 weights, llama.cpp's quantizer writes Q5_0 for Q4_K and Q8_0 for Q6_K."""

INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")
"""Types ``pack_int8`` lays out for the int8 kernel: every type of ``KERNEL_TYPES``."""

PACKED_AS = {"Q4_K": "Q4_1", "Q5_0": "Q8_0"}
"""Types the int8 kernel reads in another type's packed form (the kernel's ``qtype``)."""

DENSE_TYPES = ("F32", "F16", "BF16")
"""Unquantized tensors: their layers keep the checkpoint's dense weights (the same values)."""

QUANT_MAX_ROWS = 32
"""Inputs of at most this many rows use the float32 block kernel; larger ones de-quantize the layer
for one GEMM. One 1536x576 Q4_1 layer, weights in cache, on the 2-core AVX-512 VNNI host: the float32
kernel takes 0.07-0.12 / 0.41-0.71 / 0.75-0.91 / 1.6-2.5 ms at 1 / 16 / 32 / 64 rows, de-quantizing
and the GEMM 0.4 / 1.3-2.2 / - / 1.5-1.9 ms."""

INT8_MAX_ROWS = 1 << 16
"""Packed layers run the int8 kernel up to this many rows, that is every step a token budget allows:
it beat de-quantizing for one GEMM at every size measured (32-1024 rows; at 1024 rows of a 3072x576
Q4_1 layer, 15.5 ms against 26.8 ms, and 23.9 ms for the float32 layer's own GEMM; 2-core AVX-512
VNNI host)."""

INT8_ACTIVATIONS = True
"""Where the CPU has AVX-512 VNNI or AVX2: weights packed at load (``pack_int8``) and every step
multiplied with activations quantized per block to int8
(engine/csrc/gguf_linear_int8.cpp); False keeps the file's blocks and widens them to float32."""


def quant_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """``x @ W.T`` for a layer that holds GGUF blocks (``attach_gguf``), in ``x``'s dtype."""
    if layer.qparts is not None:  # a fused layer whose parts differ in type: one product each
        return torch.cat([quant_linear(x, part) for part in layer.qparts], dim=-1)
    if layer.qindex >= 0 and torch.compiler.is_compiling():
        # The graph names the layer; its blocks are bound once a step (engine/csrc/gguf_layers.cpp).
        return torch.ops.slotserve_cpu.gguf_layer(x, layer.qindex, layer.qout)
    if layer.qscale is not None:
        return torch.ops.slotserve_cpu.gguf_mm_packed(x, layer.qweight, layer.qscale, layer.qmin, layer.qtype,
                                                      INT8_MAX_ROWS)
    return torch.ops.slotserve_cpu.gguf_mm(x, layer.qweight, layer.qtype, QUANT_MAX_ROWS, layer.qexact)


def make_batch_invariant(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` runs the int8 kernel. Its rounding of inputs to int8 turns a float32
    ulp upstream into a whole step, which grows layer by layer into percent-sized differences (issue 47:
    a prefix hit changed greedy text). If so, float32-kernel layers sum steps of any size as their block
    kernel does (``qexact``), so a row gets the same bits in any batch; the runner has attention do the
    same (CpuAttentionBackend.batch_invariant). Without int8 layers, ulps stay ulps: the GEMM stays."""
    exact = any(getattr(m, "qscale", None) is not None for m in model.modules())
    for module in model.modules():
        if getattr(module, "qtype", None) is not None:
            module.qexact = exact
    return exact


def quant_rows(ids: torch.Tensor, layer) -> torch.Tensor:
    """Rows ``ids`` of a layer's GGUF weight, de-quantized to float32 (an embedding's lookup)."""
    hidden = layer.hidden
    if layer.qscale is not None:
        packed = (layer.qweight, layer.qscale, layer.qmin, layer.qtype)
        return torch.ops.slotserve_cpu.gguf_take_packed(*packed, hidden, ids)
    return torch.ops.slotserve_cpu.gguf_dequantize(layer.qweight[ids], layer.qtype, hidden)


def _q4k_blocks(rows: np.ndarray, n: int, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks as 32-weight blocks of Q4_1's form: (quants [n, nb, 32] in order, float16
    scales d sc, float16 minimums -dmin m [n, nb]). The float16 products round what the file's float32
    ones keep (a relative 2^-11, an eighth of the activations' int8 step)."""
    blocks = rows.reshape(n, nb // 8, 144)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, nb / 8, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    s = blocks[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(n, nb // 8, 4, 1, 32)
    quants = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, nb, 32)
    return (quants, (d * sc).astype(np.float16).reshape(n, nb), (-(dmin * m)).astype(np.float16).reshape(n, nb))


def _q5_blocks(rows: np.ndarray, type_name: str, n: int, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q5_0 / Q5_1 blocks as (unsigned quants [n, nb, 32] in order, float16 scales [n, nb], float16
    minimums [n, nb] for Q5_1, else None): the 5-bit values fit a byte, so the kernel reads 8.5 or 9
    bits a weight instead of 5.5 or 6."""
    blocks = rows.reshape(n, nb, KERNEL_TYPES[type_name][2])
    start = 4 if type_name == "Q5_1" else 2
    scales = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    mins = blocks[:, :, 2:4].copy().view(np.float16)[..., 0] if type_name == "Q5_1" else None
    high = blocks[:, :, start:start + 4].copy().view("<u4")  # bit j: weight j's fifth bit
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    nibbles = blocks[:, :, start + 4:start + 20]
    return np.concatenate([nibbles & 15, nibbles >> 4], axis=2) | (fifth << 4), scales, mins


def _q6k_blocks(rows: np.ndarray, n: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks as 32-weight blocks of signed quants q - 32 [n, nb, 32] int8 and their float16
    scales d sc, one per 16 weights [n, nb, 2] (the product rounded as Q4_K's are)."""
    blocks = rows.reshape(n, nb // 8, 210)
    ql = blocks[..., :128].reshape(n, nb // 8, 2, 2, 32)  # [half of 128, low/high 32 bytes, 32]
    qh = blocks[..., 128:192].reshape(n, nb // 8, 2, 32)
    # Weights 32j..32j+31 of each half: ql's low nibbles (j = 0, 1) then high ones (2, 3), with two bits of qh each.
    q = np.stack([(ql[..., j % 2, :] >> (4 * (j // 2)) & 15) | ((qh >> (2 * j)) & 3) << 4 for j in range(4)], axis=3)
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)  # [n, nb / 8, 1]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)  # a scale per 16 weights, in order
    return ((q.astype(np.int16) - 32).astype(np.int8).reshape(n, nb, 32),
            (d * sc).astype(np.float16).reshape(n, nb, 2))


def _q4_blocks(rows: np.ndarray, type_name: str, n: int, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 / Q4_1 blocks as (quants [n, nb, 32] in order, float16 scales, float16 minimums [n, nb])."""
    blocks = rows.reshape(n, nb, KERNEL_TYPES[type_name][2])
    scales = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    start = 4 if type_name == "Q4_1" else 2
    packed = blocks[:, :, start:start + 16]
    # Q4_0's offset, -8 x its scale, is exact in float16 (a power of two times a float16).
    mins = blocks[:, :, 2:4].copy().view(np.float16)[..., 0] if type_name == "Q4_1" else -8 * scales
    return np.concatenate([packed & 15, packed >> 4], axis=2), scales, mins


def pack_int8(rows: np.ndarray, type_name: str, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensor's blocks as the int8 kernel reads them (engine/csrc/gguf_linear_int8.cpp), per group of 16
    output columns: quants [N/16, blocks x 256 (nibbles) or 512 (bytes)], float16 scales [N/16, blocks
    x 16; Q6_K: x 32, one per 16 weights] and minimums [N/16, blocks x 16]. A block's operand s holds
    weights 4s..4s+3 of column c in bytes 4c..4c+3. Nibble operands 0-3 sit in the low nibbles, 4-7 in
    the high ones. Signed bytes (Q8_0, Q5_0, Q6_K) have their sign bit flipped; Q5_0's values are
    shifted to signed, Q5_1's stay unsigned with their minimum. Q4_K's 32-weight sub-blocks become
    blocks of Q4_1's form, Q5_0's Q8_0's (``PACKED_AS``). N must be a multiple of 16."""
    n, nb = rows.shape[0], in_features // 32
    kind = PACKED_AS.get(type_name, type_name)
    if kind == "Q8_0" or kind == "Q6_K":
        if type_name == "Q5_0":
            unsigned, scales, _ = _q5_blocks(rows, type_name, n, nb)
            signed = (unsigned.astype(np.int16) - 16).astype(np.int8)
        elif type_name == "Q6_K":
            signed, scales = _q6k_blocks(rows, n, nb)
        else:
            blocks = rows.reshape(n, nb, KERNEL_TYPES[type_name][2])
            signed, scales = blocks[:, :, 2:].view(np.int8), blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
        values = signed.view(np.uint8) ^ np.uint8(0x80)
        mins = np.zeros((n, nb), np.float16)
    elif kind == "Q5_1":
        values, scales, mins = _q5_blocks(rows, type_name, n, nb)
    else:
        values, scales, mins = (_q4k_blocks(rows, n, nb) if type_name == "Q4_K"
                                else _q4_blocks(rows, type_name, n, nb))
    # [group, column, block, operand, byte] -> [group, block, operand, column, byte]
    ops = values.reshape(n // 16, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4)
    if kind in ("Q4_0", "Q4_1"):
        ops = ops[:, :, :4] | (ops[:, :, 4:] << 4)
    quants = np.ascontiguousarray(ops).reshape(n // 16, -1)

    def by_group(per_block: np.ndarray) -> torch.Tensor:  # [n, nb(, halves)] -> [group, block(, half), column]
        grouped = per_block.reshape(n // 16, 16, nb, -1).transpose(0, 2, 3, 1)
        return torch.from_numpy(np.ascontiguousarray(grouped).reshape(n // 16, -1))
    return torch.from_numpy(quants), by_group(scales), by_group(mins)


@functools.cache
def load_ops() -> None:
    """The kernel library, with the shape function a compiled graph traces ``gguf_mm`` with."""
    from engine.cpu_kernels import compiler_problem, load_kernel
    problem = compiler_problem()
    if problem is not None:
        raise ModelLoadError(f"quantization gguf and int8 need the CPU kernel library: {problem}")
    load_kernel()

    @torch.library.register_fake("slotserve_cpu::gguf_mm")
    def _(x, blocks, qtype, max_rows, exact=False):
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("slotserve_cpu::gguf_mm_packed")
    def _(x, quants, scales, mins, qtype, max_rows):
        return x.new_empty(x.shape[0], scales.shape[0] * 16)

    @torch.library.register_fake("slotserve_cpu::gguf_layer")
    def _(x, index, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("slotserve_cpu::gguf_dequantize")
    def _(blocks, qtype, k):
        return blocks.new_empty(blocks.shape[0], k, dtype=torch.float32)

    @torch.library.register_fake("slotserve_cpu::gguf_dequantize_packed")
    def _(quants, scales, mins, qtype, k):
        return quants.new_empty(scales.shape[0] * 16, k, dtype=torch.float32)

    @torch.library.register_fake("slotserve_cpu::gguf_take_packed")
    def _(quants, scales, mins, qtype, k, ids):
        return quants.new_empty(*ids.shape, k, dtype=torch.float32)


def _int8() -> bool:
    return INT8_ACTIVATIONS and torch.ops.slotserve_cpu.gguf_int8_ready()


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str
    rows: np.ndarray | None
    """``[out_features, bytes]`` for a quantized tensor (one row of blocks per output feature); None for
    an unquantized one (``DENSE_TYPES``)."""

    def output_slice(self, start: int, size: int) -> GGUFTensor:
        """Output features [start, start + size): a column-parallel rank's rows, blocks whole."""
        return self if self.rows is None else GGUFTensor(self.name, self.type_name, self.rows[start:start + size])

    def input_slice(self, start: int, size: int) -> GGUFTensor:
        """Input features [start, start + size): a row-parallel rank's blocks of every row; the split must
        fall between blocks."""
        if self.rows is None:
            return self
        _, per_block, block_bytes = KERNEL_TYPES[self.type_name]
        if start % per_block or size % per_block:
            raise ModelLoadError(f"{self.name} ({self.type_name}): tensor parallelism splits its input features at "
                                 f"{start}, {start + size}, inside its {per_block}-weight blocks")
        return GGUFTensor(self.name, self.type_name,
                          self.rows[:, start // per_block * block_bytes:(start + size) // per_block * block_bytes])


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

    def type_of(self, name: str) -> str | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.tensor_type.name

    def quantized(self, name: str, out_features: int, in_features: int, heads: int | None = None) -> GGUFTensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path.name} has no tensor {name}")
        type_name = tensor.tensor_type.name
        if type_name in DENSE_TYPES:
            return GGUFTensor(name, type_name, None)
        if type_name not in KERNEL_TYPES:
            raise ModelLoadError(f"{self.path.name}: {name} is {type_name}; quantization gguf multiplies "
                                 f"{', '.join(KERNEL_TYPES)} in place and keeps {', '.join(DENSE_TYPES)} dense")
        _, per_block, block_bytes = KERNEL_TYPES[type_name]
        rows = np.asarray(tensor.data)
        expected = (out_features, in_features // per_block * block_bytes)
        if in_features % per_block or rows.shape != expected:
            raise ModelLoadError(f"{self.path.name}: {name} ({type_name}) holds {tuple(int(d) for d in tensor.shape)}"
                                 f" weights; the model expects [{out_features}, {in_features}]")
        if heads is not None and self.architecture == "llama":
            rows = _reverse_permute(rows, heads)
        return GGUFTensor(name, type_name, rows)


class QuantPart(torch.nn.Module):
    """One part of a fused layer (q, k, v; gate, up) whose GGUF type differs from the others'."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("qweight", "qscale", "qmin"):
            self.register_buffer(name, None, persistent=False)
        self.qtype, self.qparts, self.qexact = None, None, False
        self.qindex, self.qout = -1, 0


def hold_blocks(module, parts: list[GGUFTensor], in_features: int) -> None:
    """Give ``module`` the tensors' blocks (packed for the int8 kernel where it runs), as buffers so that
    a compiled graph takes them as inputs, like weights; parts of different types each get a
    ``QuantPart``."""
    kinds = {p.type_name for p in parts}
    if len(kinds) > 1:
        module.qparts = torch.nn.ModuleList(QuantPart() for _ in parts)
        for part, tensor in zip(module.qparts, parts):
            hold_blocks(part, [tensor], in_features)
        module.qtype = -1  # quantized, in parts
        return
    kind = kinds.pop()
    module.qtype = KERNEL_TYPES[kind][0]
    rows = np.concatenate([p.rows for p in parts]) if len(parts) > 1 else np.array(parts[0].rows)
    module.qout = rows.shape[0]
    if _int8() and kind in INT8_TYPES and rows.shape[0] % 16 == 0:
        module.qweight, module.qscale, module.qmin = pack_int8(rows, kind, in_features)
        module.qtype = KERNEL_TYPES[PACKED_AS.get(kind, kind)][0]
    else:
        module.qweight = torch.from_numpy(rows)


def _attach(layer, parts: list[GGUFTensor]) -> None:
    dense = [p.name for p in parts if p.rows is None]
    if len(dense) == len(parts):  # unquantized in the file: the checkpoint's weights are the same values
        return
    if dense:
        quantized = ", ".join(p.name for p in parts if p.rows is not None)
        raise ModelLoadError(f"{', '.join(dense)} unquantized beside quantized {quantized}: a fused layer "
                             "is served dense or quantized, not both")
    hold_blocks(layer, parts, layer.in_features)
    layer.weight.data = layer.weight.data.new_empty(0)


def attach_gguf(model, path: Path) -> dict[str, int]:
    """Give every linear layer of ``model``, its LM head and its embedding the blocks of ``path`` (a head
    or embedding of a type without a kernel keeps the checkpoint's dense rows); returns the count of
    tensors per GGUF type. Under tensor parallelism each rank takes its own rows or whole blocks of the
    split, as it takes its part of a dense weight."""
    load_ops()
    file, arch = GGUFFile(path), model.arch
    d, hidden, inter = arch.head_dim, arch.hidden_size, arch.intermediate_size
    types: dict[str, int] = {}

    def take(name, out_features, in_features, heads=None):
        tensor = file.quantized(name, out_features, in_features, heads)
        types[tensor.type_name] = types.get(tensor.type_name, 0) + 1
        return tensor

    for i, layer in enumerate(model.layers):
        qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
        gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
        h, rank = qkv.heads, gate_up.group.rank
        _attach(qkv, [take(f"blk.{i}.attn_q.weight", arch.num_heads * d, hidden, arch.num_heads)
                      .output_slice(h.q_start * d, h.q_count * d),
                      take(f"blk.{i}.attn_k.weight", arch.num_kv_heads * d, hidden, arch.num_kv_heads)
                      .output_slice(h.kv_start * d, h.kv_count * d),
                      take(f"blk.{i}.attn_v.weight", arch.num_kv_heads * d, hidden)
                      .output_slice(h.kv_start * d, h.kv_count * d)])
        _attach(o, [take(f"blk.{i}.attn_output.weight", hidden, arch.num_heads * d)
                    .input_slice(o.in_start, o.in_features)])
        share = inter // gate_up.group.world_size
        _attach(gate_up, [take(f"blk.{i}.ffn_gate.weight", inter, hidden).output_slice(rank * share, share),
                          take(f"blk.{i}.ffn_up.weight", inter, hidden).output_slice(rank * share, share)])
        _attach(down, [take(f"blk.{i}.ffn_down.weight", hidden, inter).input_slice(down.in_start, down.in_features)])
    embed, lm_head = model.embed_tokens, model.lm_head
    tied = lm_head.weight is embed.weight
    head = "output.weight" if "output.weight" in file.tensors else "token_embd.weight"
    for module, name in ((lm_head, head), (embed, "token_embd.weight")):
        if module is embed and tied and lm_head.qweight is not None:  # one tensor serves both
            module.qtype, module.qweight, module.qscale, module.qmin = (
                lm_head.qtype, lm_head.qweight, lm_head.qscale, lm_head.qmin)
        else:
            kind = file.type_of(name)
            if kind not in KERNEL_TYPES:  # the checkpoint's dense rows serve it
                logger.info("%s is %s in %s: it stays dense", name, kind, path.name)
                continue
            rows = take(name, arch.vocab_size, hidden).output_slice(module.start, module.shard_size)
            hold_blocks(module, [rows], hidden)
        module.hidden = hidden
    for module in (lm_head, embed):
        if module.qweight is not None and not (tied and (lm_head.qweight is None or embed.qweight is None)):
            module.weight.data = module.weight.data.new_empty(0)
    return types
