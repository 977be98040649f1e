"""Quantized layers read from an FP8, AWQ or GPTQ checkpoint, or rounded from a dense one at load.

The loader (engine.model.loader) hands every tensor of a quantized layer here instead of to the
dense parameter; once the files are read, each layer's parts (q, k and v; gate and up) are joined
along the output features into one ``QuantWeights`` (engine.model.gpu_quant), so fused layers stay
one product. A layer the checkpoint left dense (its ``ignore`` list) loads as before.

Under tensor parallelism each part is cut to the rank's share before it is joined, as the dense
loaders cut theirs: output rows with their scales (any rows: scales are per row once read), or
input features with their groups or scale blocks whole (a cut inside one is refused). A rank reads
only its share of the large tensors (an FP8 weight, an int4 ``qweight``) from the file; scales, zero
points and ``g_idx`` are read whole (1/16 or less of a weight's bytes) and cut with the rest.
"""

from __future__ import annotations

import logging

import torch

from engine.errors import ModelLoadError
from engine.model.llama import PACKED
from engine.model.gpu_quant import (AWQ_ORDER, QuantScheme, QuantWeights, fp8_from_dense, int4_from_dense,
                                    kernels_run_on, pack_rows, scaled_mm_supported, unpack_columns,
                                    unpack_rows)

logger = logging.getLogger(__name__)

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
PART_ORDER = {"q": 0, "k": 1, "v": 2}


def _fp8_scale(name: str, s: torch.Tensor, n: int, k: int, block: tuple[int, int] | None):
    """One part's scale as ``[n, 1]`` (per tensor or channel) or, for block scales, ``[n, K / bk]``: a
    block's scale repeated over its rows, so parts of any size join (a k_proj of 64 rows beside 128-row
    blocks) and the kernel reads one scale a column either way. Returns (scale, bk or None)."""
    s = s.float()
    if block is not None and s.dim() == 2 and tuple(s.shape) == (-(-n // block[0]), -(-k // block[1])):
        return s.repeat_interleave(block[0], 0)[:n], block[1]  # by the config's blocks first
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, 1), None
    if s.numel() == n and (s.dim() == 1 or s.shape[-1] == 1):
        return s.reshape(n, 1), None
    bn, bk = block or (128, 128)
    if tuple(s.shape) == (-(-n // bn), -(-k // bk)):
        return s.repeat_interleave(bn, 0)[:n], bk
    raise ModelLoadError(f"{name}: scale of shape {tuple(s.shape)} fits neither a tensor, its {n} channels "
                         f"nor {bn} x {bk} blocks of a {n} x {k} weight")


Shard = tuple[slice | None, slice | None]
"""A rank's (output rows, input features) of one part, in the checkpoint's whole tensor; None: all."""


def _shard_of(module, part) -> Shard:
    if module.group.world_size == 1:
        return None, None
    if hasattr(module, "part_rows"):  # column-parallel: q/k/v heads, gate/up rows
        start, size = module.part_rows(part)
        return slice(start, start + size), None
    return None, slice(module.in_start, module.in_start + module.in_features)  # row-parallel: o, down


def _cut_error(name: str, cols: slice, width: int, what: str) -> ModelLoadError:
    return ModelLoadError(f"{name}: tensor parallelism splits its input features at {cols.start} and {cols.stop}, "
                          f"inside its {width}-wide {what}; choose a tensor_parallel_size whose splits fall "
                          "between them")


CUT = "cut"
"""Marks a part whose large tensor (``weight`` or ``qweight``) was read as the rank's share only."""
SHAPES = "shapes"
"""A part's whole tensor shapes in the file, by suffix, where a share was read."""


def _whole_shape(part: dict, suffix: str) -> tuple[int, ...]:
    return part.get(SHAPES, {}).get(suffix) or tuple(part[suffix].shape)


def read_share(sl, suffix: str, source: str, shard: Shard) -> torch.Tensor | None:
    """This rank's share of a large tensor straight from the file (``sl``: a safetensors slice), in
    its own layout; None where it has none (whole reads: one rank, small tensors, or a cut that is no
    whole packed word, which the part's builder refuses or cuts itself)."""
    rows, cols = shard
    if (rows is None and cols is None) or suffix not in ("weight", "qweight"):
        return None
    everything = slice(None)
    if suffix == "weight":  # FP8 [N, K]
        return sl[rows or everything, cols or everything]
    if source == "awq":  # [K, N / 8]: output features packed by eight along the columns
        if rows is not None and (rows.start % 8 or rows.stop % 8):
            return None
        return sl[cols or everything, slice(rows.start // 8, rows.stop // 8) if rows else everything]
    if cols is not None and (cols.start % 8 or cols.stop % 8):  # gptq [K / 8, N]: input features by eight
        return None
    return sl[slice(cols.start // 8, cols.stop // 8) if cols else everything, rows or everything]


def _fp8_parts(names: list[str], parts: list[dict[str, torch.Tensor]], scheme: QuantScheme,
               shards: list[Shard] | None = None) -> QuantWeights:
    weights, scales, widths = [], [], set()
    shards = shards or [(None, None)] * len(parts)
    k = _whole_shape(parts[0], "weight")[1]
    for name, p, (rows, cols) in zip(names, parts, shards):
        w, (n, wk), read_cut = p["weight"], _whole_shape(p, "weight"), CUT in p
        s = p.get("weight_scale_inv", p.get("weight_scale"))
        if s is None:
            raise ModelLoadError(f"{name}: an FP8 weight without weight_scale or weight_scale_inv")
        if wk != k:
            raise ModelLoadError(f"{name}: weight has {wk} input features, expected {k}")
        s, width = _fp8_scale(name, s, n, k, scheme.block)
        if rows is not None:  # a scale per row (blocks repeated over theirs): any rows cut cleanly
            w, s = (w if read_cut else w[rows]), s[rows]
        if cols is not None:
            if width is not None and (cols.start % width or (cols.stop % width and cols.stop != k)):
                raise _cut_error(name, cols, width, "scale blocks")
            w = w if read_cut else w[:, cols]
            s = s[:, cols.start // width:-(-cols.stop // width)] if width is not None else s
        widths.add(width)
        weights.append(w.to(torch.float8_e4m3fn))
        scales.append(s)
    k = weights[0].shape[1]
    widths.discard(None)
    if len(widths) > 1:
        raise ModelLoadError(f"{', '.join(names)}: parts have blocks of different widths {sorted(widths)}")
    bk = widths.pop() if widths else None
    if bk is not None:  # per-channel parts beside block-scaled ones: their scale in every column
        scales = [t.expand(-1, -(-k // bk)) if t.shape[1] == 1 else t for t in scales]
    return QuantWeights("fp8", {"weight": torch.cat(weights).contiguous(), "scale": torch.cat(scales).contiguous()},
                        block=None if bk is None else (1, bk))


def _int4_parts(names: list[str], parts: list[dict[str, torch.Tensor]], scheme: QuantScheme,
                shards: list[Shard] | None = None) -> QuantWeights:
    q_all, s_all, z_all = [], [], []
    shards = shards or [(None, None)] * len(parts)
    g = scheme.group
    for name, p, (rows, cols) in zip(names, parts, shards):
        missing = [t for t in ("qweight", "qzeros", "scales") if t not in p]
        if missing:
            raise ModelLoadError(f"{name}: {scheme.source} layer lacks {', '.join(missing)}")
        read_cut, (pk, pn) = CUT in p, _whole_shape(p, "qweight")
        if scheme.source == "awq":  # qweight [K, N / 8], interleaved nibbles
            q = unpack_columns(p["qweight"], AWQ_ORDER)
            z = unpack_columns(p["qzeros"], AWQ_ORDER)
            k, n = pk, pn * 8
        else:  # gptq: qweight [K / 8, N], rows packed in order
            q = unpack_rows(p["qweight"])
            z = unpack_columns(p["qzeros"]) + scheme.zero_offset
            k, n = pk * 8, pn
            if "g_idx" in p and not torch.equal(p["g_idx"].long(), torch.arange(k) // g):
                raise ModelLoadError(f"{name}: g_idx reorders the input features (act-order); "
                                     "quantize with desc_act false")
        s = p["scales"]
        if k % g or tuple(s.shape) != (k // g, n) or tuple(z.shape) != (k // g, n):
            raise ModelLoadError(f"{name}: qweight is {k} x {n} but scales are {tuple(s.shape)} and zero "
                                 f"points {tuple(z.shape)}; group size {g} needs {k // g} x {n}")
        if rows is not None:  # output features are this layout's columns
            q, s, z = (q if read_cut else q[:, rows]), s[:, rows], z[:, rows]
        if cols is not None:
            if cols.start % g or cols.stop % g:
                raise _cut_error(name, cols, g, "groups")
            groups = slice(cols.start // g, cols.stop // g)
            q, s, z = (q if read_cut else q[cols]), s[groups], z[groups]
        q_all.append(q)
        s_all.append(s.half())
        z_all.append(z.half())
    ks = {q.shape[0] for q in q_all}
    if len(ks) > 1:
        raise ModelLoadError(f"{', '.join(names)}: parts have different input features {sorted(ks)}")
    return QuantWeights("int4", {"qweight": pack_rows(torch.cat(q_all, 1)), "scales": torch.cat(s_all, 1).contiguous(),
                                 "zeros": torch.cat(z_all, 1).contiguous()}, group=g)


def _checkpoint_name(module: str, part) -> str:
    """The layer's name as the checkpoint spells it (``layers.0.self_attn.k_proj`` for part k)."""
    for ckpt, (fused, p) in PACKED.items():
        if p == part and module.endswith(fused):
            return module.removesuffix(fused) + ckpt
    return module


def check_tp_cuts(scheme: QuantScheme, arch, world_size: int) -> None:
    """Refuse, before any worker starts, a tensor-parallel split of o_proj's or down_proj's input features
    that falls inside the checkpoint's int4 groups or FP8 blocks (where the config names them; the loader
    checks every tensor's scales as it shards them)."""
    from engine.parallel import shard_heads
    width = scheme.group if scheme.kind == "int4" else (scheme.block[1] if scheme.block else None)
    if width is None or world_size == 1 or scheme.source == "dense":
        return
    cuts = {"o_proj": [shard_heads(arch.num_heads, arch.num_kv_heads, r, world_size).q_start * arch.head_dim
                       for r in range(1, world_size)],
            "down_proj": [r * arch.intermediate_size // world_size for r in range(1, world_size)]}
    for layer, points in cuts.items():
        inside = [c for c in points if c % width]
        if inside:
            what = "groups" if scheme.kind == "int4" else "scale blocks"
            raise ModelLoadError(f"{scheme.source} checkpoint: tensor_parallel_size {world_size} splits every "
                                 f"{layer}'s input features at {inside[0]}, inside its {width}-wide {what}; choose "
                                 "a tensor_parallel_size whose splits fall between them")


class QuantCollector:
    """Tensors of quantized layers, held until every file is read (parts may sit in different files)."""

    def __init__(self, scheme: QuantScheme, model) -> None:
        self.scheme = scheme
        self.model = model
        self.parts: dict[str, dict[object, dict[str, torch.Tensor]]] = {}

    def take(self, name: str, f) -> bool:
        """Hold ``name`` if it belongs to a quantized layer; False lets the dense loader have it."""
        stem, _, suffix = name.rpartition(".")
        if suffix not in self.scheme.suffixes:
            return False
        if suffix == "weight" and f.get_slice(name).get_dtype() not in ("F8_E4M3", "F8_E4M3FN"):
            return False  # a layer the checkpoint left dense
        target = self.model.parameter_for(f"{stem}.weight")
        if target is None:
            return True
        pname, part = target
        module = pname.removesuffix(".weight")
        if not module.endswith(LINEARS):
            raise ModelLoadError(f"{name}: only the decoder's linear layers can be quantized, not {module}")
        held = self.parts.setdefault(module, {}).setdefault(part, {})
        sl = f.get_slice(name)
        share = read_share(sl, suffix, self.scheme.source, _shard_of(self.model.get_submodule(module), part))
        if share is None:
            held[suffix] = f.get_tensor(name)
        else:
            held[suffix], held[CUT] = share, True
            held.setdefault(SHAPES, {})[suffix] = tuple(sl.get_shape())
        return True

    def finish(self, device: torch.device, dtype: torch.dtype) -> set[tuple[str, object]]:
        """Build every held layer; returns the (parameter, part) pairs now loaded."""
        loaded = set()
        build = _fp8_parts if self.scheme.kind == "fp8" else _int4_parts
        for module_name, by_part in self.parts.items():
            module = self.model.get_submodule(module_name)
            order = sorted(by_part, key=lambda p: PART_ORDER.get(p, p) if p is not None else 0)
            names = [_checkpoint_name(module_name, p) for p in order]
            weights = build(names, [by_part[p] for p in order], self.scheme, [_shard_of(module, p) for p in order])
            expected = (module.out_features, module.in_features)
            if (weights.out_features, weights.in_features) != expected:
                raise ModelLoadError(f"{module_name}: the quantized weight is {weights.out_features} x "
                                     f"{weights.in_features}, the model expects {expected[0]} x {expected[1]}")
            attach(module, weights.to(device), dtype)
            loaded |= {(f"{module_name}.weight", p) for p in order}
        return loaded


def attach(module, weights: QuantWeights, dtype: torch.dtype) -> None:
    """Serve ``module`` from ``weights`` where the kernels run, else from its de-quantized weight."""
    if kernels_run_on(weights_device(weights)):
        module.wq = weights
        module.weight.data = module.weight.data.new_empty(0)  # release the dense copy
    else:
        module.weight.data = weights.dequantize().to(dtype)


def weights_device(weights: QuantWeights) -> torch.device:
    return next(weights.buffers()).device


def quantize_dense(model, method: str, device: torch.device) -> None:
    """Round every decoder linear layer of a dense checkpoint (``quantization: fp8`` or ``int4``)."""
    if not kernels_run_on(device):
        raise ModelLoadError(f"quantization {method} runs on CUDA (Triton kernels); on CPU use gguf or int8")
    make = fp8_from_dense if method == "fp8" else int4_from_dense
    for layer in model.layers:
        for name in LINEARS:
            module = layer.get_submodule(name)
            module.wq = make(module.weight.data)
            module.weight.data = module.weight.data.new_empty(0)


def describe_quantized(model, scheme: QuantScheme, dtype_name: str) -> str:
    """What the log says of the weights; also picks the FP8 kernel (``QuantWeights.use_scaled_mm``)."""
    held = [m.wq for m in model.modules() if isinstance(getattr(m, "wq", None), QuantWeights)]
    if not held:
        return f"a {scheme.source} checkpoint de-quantized to {dtype_name} (its kernels run on CUDA)"
    device = weights_device(held[0])
    # torch's row-wise scaled matmul writes bfloat16 only.
    rowwise = dtype_name == "bfloat16" and scaled_mm_supported(device)
    for wq in held:
        wq.use_scaled_mm = wq.kind == "fp8" and wq.block is None and rowwise
    if scheme.kind == "fp8":
        scales = "128 x 128 blocks" if held[0].block else "output channels"
        kernel = "torch._scaled_mm, activations per token" if held[0].use_scaled_mm else "Triton W8A16"
        what = f"float8 e4m3, a scale per {scales} ({kernel})"
    else:
        groups = " or ".join(str(g) for g in sorted({w.group for w in held}, reverse=True))
        what = f"int4, a scale and zero point per {groups} inputs (Triton W4A16)"
    source = "rounded at load" if scheme.source == "dense" else f"from the {scheme.source} checkpoint"
    return f"{len(held)} linear layers {what} {source}, {sum(w.nbytes() for w in held) / 2**20:.0f} MiB; " \
           f"LM head and embedding {dtype_name}"
