"""Tensor-parallel-aware building blocks.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies this
rank's slice of a checkpoint tensor into it, so the checkpoint loader only routes names.
``loaded`` is a tensor or a safetensors slice (``safe_open(...).get_slice``): from a slice
only this rank's rows or columns are read, so no rank ever holds a full copy of a tensor
it shards. Column-parallel layers split output features (no communication); row-parallel
layers split input features and all-reduce their output; the vocabulary is split across
ranks for the embedding and the LM head, whose logits are gathered on rank 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_features import fast_bf16
from engine.model.quant import quant_linear, quant_rows
from engine.parallel import ParallelGroup


def _shape(loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def _part(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) ``[start, start + size)`` of a checkpoint tensor."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def _whole(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _check_full(loaded, dim: int, expected: int, name: str) -> None:
    """The checkpoint holds the unsharded tensor: its split dimension must be the full size."""
    shape = _shape(loaded)
    if len(shape) <= dim or shape[dim] != expected:
        raise ValueError(f"checkpoint tensor for {name} has shape {shape}: size "
                         f"{shape[dim] if len(shape) > dim else None} on dim {dim}, expected {expected} "
                         "(does config.json match the weights?)")


def cpu_prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights can be prepacked for oneDNN's CPU GEMM (as inductor's freezing does):
    float32, or bfloat16 where the CPU has bfloat16 dot products (oneDNN refuses it elsewhere)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and fast_bf16())


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """``weight`` reordered into oneDNN's blocked layout for inputs of about ``batch_hint`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


AMX_MAX_ROWS = 512
"""Inputs of at most this many rows go to the AMX kernel, larger ones to oneDNN. One forward's GEMMs
of the default model (cold weights, 2 threads), AMX against oneDNN: 8.0 against 12.3 ms at 16 rows,
65 against 71 ms at 256, 151 against 174 ms at 512, even at 768-1,024, 400 against 229 ms at 2,048."""


def amx_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether bfloat16 linear layers can run on AMX tiles (engine/csrc/amx_linear.cpp) here."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    from engine.cpu_kernels import amx_linear_problem
    return amx_linear_problem() is None


def pack_amx(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[N, K]`` as the AMX kernel reads it, ``[N/16, K/32, 16 K-pairs, 16 columns, 2]``;
    None when N is not a multiple of 16 or K of 32."""
    n, k = weight.shape
    if n % 16 or k % 32:
        return None
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None,
           amx: torch.Tensor | None = None):
    if amx is not None and x.shape[0] <= AMX_MAX_ROWS:
        out = x.new_empty(x.shape[0], amx.shape[0] * 16)
        torch.ops.slotserve_cpu.amx_linear(out, x if x.stride(-1) == 1 else x.contiguous(), amx)
        return out if bias is None else out.add_(bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _quantizable(module: nn.Module) -> None:
    """Room for GGUF blocks (engine.model.quant.attach_gguf): ``qweight`` [out, bytes] and its type."""
    for name in ("qweight", "qscale", "qmin"):  # qscale, qmin: packed for the int8 kernel
        module.register_buffer(name, None, persistent=False)
    module.qtype = None  # set once quantized
    module.register_module("wq", None)  # weights kept quantized on the GPU (engine.model.gpu_quant)
    module.qparts = None  # a fused layer's parts, where their types differ (engine.model.quant.QuantPart)
    module.qexact = False  # large steps summed as small ones (engine.model.quant.make_batch_invariant)
    module.qindex, module.qout = -1, 0  # its number in a compiled graph's table (engine.model.compiled); N


def _attach(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearBase(nn.Module):
    packed: torch.Tensor | None = None
    """oneDNN-packed weight (CPU, after ``prepack``); the dense weight is then released."""
    amx: torch.Tensor | None = None
    """The weight packed for the AMX kernel (``pack_amx``), which runs inputs of up to ``AMX_MAX_ROWS``
    rows; a second copy beside ``packed``, which runs larger ones."""
    packed_index: int = -1
    """This layer's number in the compiled model's list of packed layers (engine.model.compiled)."""
    packed_op = None
    """The op the compiled graph calls with ``packed_index`` (set by engine.model.compiled)."""
    lora = None
    """Every adapter slot's weights for this projection (engine.lora.layers.LoRAWeights), if served."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.weight = _attach(nn.Parameter(torch.empty(out_features, in_features), requires_grad=False),
                              self.weight_loader)
        self.bias = (_attach(nn.Parameter(torch.empty(out_features), requires_grad=False), self.weight_loader)
                     if bias else None)
        _quantizable(self)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        _copy_checked(param, _whole(loaded), type(self).__name__)

    def prepack(self, batch_hint: int, amx: bool = False) -> None:
        if self.qtype is not None or self.wq is not None:  # served from its quantized weights
            return
        self.amx = pack_amx(self.weight) if amx else None
        self.packed = pack_weight(self.weight, batch_hint)
        self.weight.data = self.weight.data.new_empty(0)

    def _linear(self, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        bias = self.bias if with_bias else None
        if self.qtype is not None:  # the GGUF blocks (engine.model.quant)
            out = quant_linear(x, self)
            out = out if bias is None else out + bias
        elif self.wq is not None:  # FP8 or INT4 (engine.model.gpu_quant)
            out = self.wq(x)
            out = out if bias is None else out + bias
        elif compiling and self.packed is not None:
            # A packed oneDNN weight cannot be traced: the graph names the layer.
            out = self.packed_op(x, self.packed_index, self.packed.shape[0], with_bias)
        else:
            out = linear(x, self.weight, bias, None if compiling else self.packed, None if compiling else self.amx)
        if self.lora is None:
            return out
        if compiling:
            if self.lora.index < 0:
                raise RuntimeError("LoRA weights were attached after the model was compiled")
            return out + torch.ops.slotserve.lora_delta(x, self.lora.index, out.shape[-1])
        delta = self.lora.delta(x)
        return out if delta is None else out.add_(delta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, True)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup) -> None:
        super().__init__(in_features, group.shard(out_features, "output features"), bias, group)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        size = param.shape[0]
        _check_full(loaded, 0, size * self.group.world_size, type(self).__name__)
        _copy_checked(param, _part(loaded, 0, self.group.rank * size, size), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate and up of the MLP)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, group: ParallelGroup) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, group)

    def part_rows(self, shard_id) -> tuple[int, int]:
        """(start, size) of this rank's rows of part ``shard_id``, in the checkpoint's whole tensor."""
        size = self.out_sizes[shard_id] // self.group.world_size
        return self.group.rank * size, size

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        offset = sum(self.out_sizes[:shard_id]) // self.group.world_size
        src, size = self.part_rows(shard_id)
        name = f"{type(self).__name__}[{shard_id}]"
        _check_full(loaded, 0, self.out_sizes[shard_id], name)
        _copy_checked(param.data.narrow(0, offset, size), _part(loaded, 0, src, size), name)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds whole KV groups (engine.parallel.shard_heads),
    or a replica of one KV head when there are more ranks than KV heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 group: ParallelGroup) -> None:
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.heads = group.heads(num_heads, num_kv_heads)
        self.local_heads, self.local_kv_heads = self.heads.q_count, self.heads.kv_count
        out = (self.local_heads + 2 * self.local_kv_heads) * head_dim
        LinearBase.__init__(self, hidden, out, bias, group)

    def part_rows(self, shard_id) -> tuple[int, int]:
        """(start, size) of this rank's rows of part ``shard_id`` (q, k, v), in the checkpoint's tensor."""
        d, h = self.head_dim, self.heads
        return (h.q_start * d, h.q_count * d) if shard_id == "q" else (h.kv_start * d, h.kv_count * d)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        d, h = self.head_dim, self.heads
        q_size, kv_size = h.q_count * d, h.kv_count * d
        name = f"QKVParallelLinear[{shard_id}]"
        _check_full(loaded, 0, (self.num_heads if shard_id == "q" else self.num_kv_heads) * d, name)
        dst = {"q": 0, "k": q_size, "v": q_size + kv_size}[shard_id]
        src, size = self.part_rows(shard_id)
        _copy_checked(param.data.narrow(0, dst, size), _part(loaded, 0, src, size), name)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    ``in_shard`` = (start, size) of this rank's input features when the split is not even
    (o_proj after an uneven head split); default: an even split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup,
                 in_shard: tuple[int, int] | None = None) -> None:
        if in_shard is None:
            size = group.shard(in_features, "input features")
            in_shard = (group.rank * size, size)
        self.in_start, self.in_features_full = in_shard[0], in_features
        super().__init__(in_shard[1], out_features, bias, group)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            _copy_checked(param, _whole(loaded), "RowParallelLinear.bias")
            return
        _check_full(loaded, 1, self.in_features_full, "RowParallelLinear")
        _copy_checked(param, _part(loaded, 1, self.in_start, param.shape[1]), "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self._linear(x, False))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, group: ParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.shard_size = group.shard(vocab_size, "vocab_size")
        self.start = group.rank * self.shard_size
        self.weight = _attach(nn.Parameter(torch.empty(self.shard_size, hidden), requires_grad=False),
                              self.weight_loader)
        _quantizable(self)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows = _shape(loaded)[0]
        if rows != self.vocab_size:
            raise ValueError(f"embedding has {rows} rows, config says vocab_size {self.vocab_size}")
        _copy_checked(param, _part(loaded, 0, self.start, self.shard_size), type(self).__name__)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:  # GGUF rows, de-quantized as they are looked up
            return quant_rows(ids, self).to(self.weight.dtype)  # the emptied dense weight keeps the model's dtype
        return F.embedding(ids, self.weight)

    def gathered(self) -> torch.Tensor | None:
        """The whole vocabulary's rows (de-quantized, in the model's dtype) on rank 0, None elsewhere:
        a collective every rank calls once. An EAGLE-3 head on rank 0 looks its draft tokens up in it."""
        rows = self._rows(torch.arange(self.shard_size, device=self.weight.device))
        whole = self.group.gather_last_dim(rows.t())
        return None if whole is None else whole.t().contiguous()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return self._rows(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = self._rows(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice, gathered to the full vocabulary on rank 0
    (the only rank that samples); other ranks get None."""

    packed: torch.Tensor | None = None
    amx: torch.Tensor | None = None

    def prepack(self, batch_hint: int, amx: bool = False) -> None:
        """Packed copies; the dense weight stays (tied embeddings read it)."""
        if self.qweight is not None:
            return
        self.amx = pack_amx(self.weight) if amx else None
        self.packed = pack_weight(self.weight, batch_hint)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.qweight is not None:
            return self.group.gather_last_dim(quant_linear(hidden, self))
        return self.group.gather_last_dim(linear(hidden, self.weight, None, self.packed, self.amx))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _attach(nn.Parameter(torch.ones(size), requires_grad=False),
                              lambda p, w, s=None: _copy_checked(p, _whole(w), "RMSNorm"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
