"""Linear layers whose weights stay quantized on the GPU: FP8 (e4m3) and INT4 (W4A16, group-wise).

Where the weights come from:

- an FP8 checkpoint as Hugging Face writes it (``quant_method: fp8``: 128 x 128 blocks with a
  ``weight_scale_inv`` each) or as compressed-tensors writes it (``float-quantized``: a
  ``weight_scale`` per tensor, per output channel or per block);
- an AWQ (``gemm``) or GPTQ (no act-order) checkpoint of 4 bits, any group size dividing 32 * k;
- a dense checkpoint rounded at load (``quantization: fp8``: a scale per output channel, as vLLM's
  dynamic FP8; ``quantization: int4``: round-to-nearest with a scale and zero point per 128 inputs).

Every format becomes one of two layouts, so two kernels serve them all (engine.model.triton_quant):
FP8 keeps ``[N, K]`` with float32 scales per channel or per block; INT4 is repacked to GPTQ's
``[K / 8, N]`` int32 with ``[K / group, N]`` scales and zero points. A per-tensor scale becomes a
per-channel one, so the fused q/k/v and gate/up layers (one scale per part in the file) stay one
product. Activations stay in the model's dtype (W8A16, W4A16); on GPUs with FP8 tensor cores
(compute capability 8.9+) per-channel FP8 can instead quantize activations per token and call
``torch._scaled_mm``. The LM head and the embedding stay dense, as in the checkpoints.

On a CPU the kernels run only under Triton's interpreter (how CI tests them); otherwise a
quantized checkpoint is de-quantized at load into the dense layers, and rounding a dense
checkpoint is refused (``gguf`` and ``int8`` are the CPU's levers).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

FP8_MAX = 448.0
"""Largest finite float8 e4m3fn."""
INT4_GROUP = 128
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Which packed nibble holds output column ``8 j + c`` of an AWQ word: nibble ``AWQ_ORDER[c]``."""
SCALED_MM_MIN_ROWS = 64
"""Fewer rows go to the W8A16 kernel even where FP8 tensor cores serve larger products: for a decode
step's few rows a product is bound by reading the weights, and quantizing the activations first only
adds launches (H200, Llama-3.1-8B's products, benchmarks.quant_gpu)."""


@dataclass(frozen=True)
class QuantScheme:
    kind: str
    """``fp8`` or ``int4``: which layout and kernel."""
    source: str
    """``fp8`` (Hugging Face), ``compressed-tensors``, ``awq``, ``gptq`` or ``dense`` (rounded at load)."""
    group: int = INT4_GROUP
    block: tuple[int, int] | None = None
    """FP8 weight blocks [output, input] sharing a scale, when the config names them."""
    zero_offset: int = 0
    """Added to a GPTQ file's zero points (its first format stores them minus one)."""

    @property
    def suffixes(self) -> tuple[str, ...]:
        """Checkpoint tensors of a quantized layer, by the last part of their names."""
        if self.kind == "fp8":
            return ("weight", "weight_scale", "weight_scale_inv", "input_scale")
        return ("qweight", "qzeros", "scales", "g_idx")


def checkpoint_scheme(cfg: dict) -> QuantScheme | None:
    """The scheme of a checkpoint's ``quantization_config`` (config.json); None when it has none."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        return QuantScheme("fp8", "fp8", block=tuple(block) if block else None)
    if method == "compressed-tensors":
        if qc.get("format") != "float-quantized":
            raise ModelLoadError(f"compressed-tensors format {qc.get('format')!r} is not supported: "
                                 "only 'float-quantized' (FP8 weights)")
        block = None
        for name, group in (qc.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ModelLoadError(f"compressed-tensors config group {name}: weights of type "
                                     f"{weights.get('type')} with {weights.get('num_bits')} bits; only float 8")
            block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        return QuantScheme("fp8", "compressed-tensors", block=tuple(block) if block else None)
    if method in ("awq", "gptq"):
        if qc.get("bits", 4) != 4:
            raise ModelLoadError(f"{method} checkpoint of {qc.get('bits')} bits: only 4 are supported")
        group = int(qc.get("group_size", INT4_GROUP))
        if group <= 0 or group % 32:
            raise ModelLoadError(f"{method} group_size {group}: must be a positive multiple of 32")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ModelLoadError(f"awq version {qc.get('version')!r}: only 'gemm' is supported")
        if method == "awq" and not qc.get("zero_point", True):
            raise ModelLoadError("awq without zero points is not supported")
        if method == "gptq" and qc.get("desc_act"):
            raise ModelLoadError("gptq with desc_act (act-order) is not supported: quantize with desc_act false")
        offset = 1 if method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq" else 0
        return QuantScheme("int4", method, group, zero_offset=offset)
    raise ModelLoadError(f"quantization_config quant_method {method!r} is not supported "
                         "(fp8, compressed-tensors FP8, awq, gptq)")


def resolve_scheme(model_dir, requested: str | None) -> QuantScheme | None:
    """The scheme a model directory is served with: its checkpoint's, which ``requested`` may name,
    or a dense checkpoint rounded at load (``fp8``, ``int4``); None for ``gguf``, ``int8`` or none."""
    import json
    from pathlib import Path
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}  # the model's own loader says what is wrong with it
    found = checkpoint_scheme(cfg)
    if found is not None:
        if requested not in (None, found.kind, found.source):
            raise ModelLoadError(f"quantization {requested}: the checkpoint is already quantized "
                                 f"({found.source}); leave quantization unset or set it to {found.source}")
        return found
    if requested in ("awq", "gptq"):
        raise ModelLoadError(f"quantization {requested} names a checkpoint's format, but {model_dir}/config.json "
                             "has no quantization_config (for a dense checkpoint: fp8 or int4)")
    if requested in ("fp8", "int4"):
        return QuantScheme(requested, "dense")
    return None


def interpreted() -> bool:
    """Whether Triton kernels run here on CPU tensors (its interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or interpreted()


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores (Ada, Hopper and later) and torch's row-wise scaled matmul."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
            and hasattr(torch, "_scaled_mm"))


def _kernels():
    """engine.model.triton_quant, imported on first use: importing triton costs a second."""
    from engine.model import triton_quant
    return triton_quant


# Custom ops: opaque to torch.compile (no tracing into Triton) and captured like any kernel in a graph.
@torch.library.custom_op("slotserve::fp8_mm", mutates_args=())
def fp8_mm_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_n: int,
              scale_k: int) -> torch.Tensor:
    from engine.model.triton_quant import fp8_mm
    return fp8_mm(x, weight, scale, scale_n, scale_k)


@fp8_mm_op.register_fake
def _(x, weight, scale, scale_n, scale_k):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("slotserve::int4_mm", mutates_args=())
def int4_mm_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group: int) -> torch.Tensor:
    from engine.model.triton_quant import int4_mm
    return int4_mm(x, qweight, scales, zeros, group)


@int4_mm_op.register_fake
def _(x, qweight, scales, zeros, group):
    return x.new_empty(x.shape[0], qweight.shape[1])


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """W8A8: ``x`` quantized per token to e4m3, then FP8 tensor cores with both scales applied."""
    sx = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    xq = (x.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=channel_scale.view(1, -1),
                            out_dtype=x.dtype)


class QuantWeights(nn.Module):
    """One linear layer's quantized weight (buffers, so a compiled graph takes them as inputs)."""

    def __init__(self, kind: str, tensors: dict[str, torch.Tensor], group: int = 0,
                 block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.kind, self.group, self.block = kind, group, block
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)
        self.use_scaled_mm = False
        """FP8 per channel: W8A8 through torch._scaled_mm instead of the W8A16 kernel."""
        if kind == "fp8":
            self.out_features, self.in_features = self.weight.shape
        else:
            self.out_features, self.in_features = self.qweight.shape[1], self.qweight.shape[0] * 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # The custom ops only where torch.compile traces: called eagerly, their dispatch cost about
        # 100 us each on the H200's host, twice the kernel's own time in a one-row decode step.
        compiling = torch.compiler.is_compiling()
        if self.kind == "int4":
            mm = int4_mm_op if compiling else _kernels().int4_mm
            out = mm(flat, self.qweight, self.scales, self.zeros, self.group)
        elif self.use_scaled_mm and flat.shape[0] >= SCALED_MM_MIN_ROWS:
            out = fp8_scaled_mm(flat, self.weight, self.scale)
        else:
            bn, bk = self.block or (1, self.in_features)
            out = (fp8_mm_op if compiling else _kernels().fp8_mm)(flat, self.weight, self.scale, bn, bk)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The dense ``[N, K]`` weight in float32 (the reference the kernels are tested against)."""
        if self.kind == "fp8":
            bn, bk = self.block or (1, self.in_features)
            n, k = self.weight.shape
            scale = self.scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            return self.weight.float() * scale
        q = unpack_rows(self.qweight)  # [K, N]
        g = self.group
        return ((q.float() - self.zeros.float().repeat_interleave(g, 0)) * self.scales.float().repeat_interleave(g, 0)).t()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


# --- INT4 packing -------------------------------------------------------------------------------

def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """``q [K, N]`` ints 0..15 -> ``[K / 8, N]`` int32, row ``8 r + i`` in bits ``4 i`` (GPTQ's packing)."""
    k, n = q.shape
    shifts = (torch.arange(8, device=q.device, dtype=torch.int64) * 4).view(1, 8, 1)
    return _to_int32((q.to(torch.int64).view(k // 8, 8, n) << shifts).sum(1))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    shifts = (torch.arange(8, device=packed.device, dtype=torch.int32) * 4).view(1, 8, 1)
    return ((packed.unsqueeze(1) >> shifts) & 0xF).reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[R, C / 8]`` int32 words of eight nibbles along columns -> ``[R, C]`` ints; ``order[c]``: the
    nibble of column ``c`` in each word (AWQ interleaves them; GPTQ's zero points do not)."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C / 8, 8] by nibble
    if order is not None:
        nibbles = nibbles[..., list(order)]
    return nibbles.reshape(packed.shape[0], -1)


def int4_from_dense(weight: torch.Tensor, group: int | None = None) -> QuantWeights:
    """Round-to-nearest, asymmetric, a scale and zero point per ``group`` inputs of each output
    (default: 128, as AWQ and GPTQ checkpoints; 64 or 32 for layers too narrow for it)."""
    n, k = weight.shape
    group = group or next((g for g in (INT4_GROUP, 64, 32) if k % g == 0), INT4_GROUP)
    if k % group:
        raise ModelLoadError(f"int4 needs input features divisible by the group size {group}, got {k}")
    w = weight.float().view(n, k // group, group)
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    q = ((w / scale.unsqueeze(-1)).round() + zero.unsqueeze(-1)).clamp(0, 15).view(n, k)
    # float16 scales, as AWQ and GPTQ files hold them (zero points 0..15 are exact in it).
    return QuantWeights("int4", {"qweight": pack_rows(q.t().contiguous()),
                                 "scales": scale.t().contiguous().half(), "zeros": zero.t().contiguous().half()},
                        group=group)


def fp8_from_dense(weight: torch.Tensor) -> QuantWeights:
    """e4m3 with a float32 scale per output channel (its largest magnitude maps to 448)."""
    w = weight.float()
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return QuantWeights("fp8", {"weight": (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
                                "scale": scale})
