"""Triton kernels for linear layers whose weights stay quantized on the GPU (engine.model.gpu_quant).

Both read a tile of packed weights, de-quantize it in registers to the activations' dtype and
multiply on tensor cores (W8A16, W4A16), so a step reads 1 or 0.5 byte per weight instead of 2:

- ``fp8_mm``: float8 e4m3 weights ``[N, K]`` times a scale per block of ``scale_n x scale_k``
  weights (per tensor: ``N x K``; per output channel: ``1 x K``; DeepSeek-style blocks: 128 x 128);
- ``int4_mm``: 4-bit weights packed eight to an int32 along K (``[K / 8, N]``), with a scale and a
  zero point per ``group`` input features and output channel: ``w = (q - zero) * scale``.

For a few rows, tensor-core tiles pad the rows to 16; a tile's ``gemv`` (the kernels' ``GEMV``) has
them multiply and add in float32 registers instead, and the tile search of benchmarks.quant_gpu
picks between the two kinds per number of rows.

Decode steps have few rows, so output tiles alone would leave most multiprocessors idle: the
reduction over K is then split across programs (``split_k``), each writing float32 partial sums that
one ``sum`` adds in a fixed order (no atomics, so a row's result does not depend on scheduling).

The same source runs on CPU tensors under ``TRITON_INTERPRET=1`` (read when this module is
imported), which is how CI executes it on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_mm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_split, stride_xm, stride_wn, stride_sn, stride_om,
            stride_os, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
            GEMV: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_split
    for i in range(0, tl.cdiv(tl.minimum(k_split, K - k_start), BLOCK_K)):
        k0 = k_start + i * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        # Unmasked along K where tiles divide it: masks that vary along K would cut the wide
        # vector loads of the weights down to single bytes.
        if EVEN_K:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn < N)[:, None], other=0.0)
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :],
                        other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn < N)[:, None] & (rk < K)[None, :],
                        other=0.0)
        # BLOCK_K divides SCALE_K: one scale a column per tile.
        s = tl.load(s_ptr + (rn // SCALE_N) * stride_sn + k0 // SCALE_K, mask=rn < N, other=0.0)
        if GEMV:  # float32 multiply-adds over [BLOCK_M, BLOCK_N, BLOCK_K], then the column's scale
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2) * s[None, :]
        else:
            # Scaled before the product: on an H200 this ran faster than casting e4m3 straight to
            # bfloat16 and scaling the tile's sums (174 against 289 us for a layer of Llama-3.1-8B, 1 row).
            b = (w.to(tl.float32) * s[:, None]).to(x.dtype)
            if IEEE:
                acc += tl.dot(x, tl.trans(b), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(b))
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_mm(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, k_split, stride_xm, stride_qk, stride_sg, stride_om,
             stride_os, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, GEMV: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_split
    for i in range(0, tl.cdiv(tl.minimum(k_split, K - k_start), BLOCK_K)):
        k0 = k_start + i * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        # Each packed word is read once ([BLOCK_K / 8, BLOCK_N], along N as it lies), then opened
        # into its eight rows: row 8 r + j is bits 4 j of word r.
        if EVEN_K:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None], other=0.0)
            packed = tl.load(q_ptr + (k0 // 8 + rw)[:, None] * stride_qk + rn[None, :], mask=(rn < N)[None, :],
                             other=0)
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :],
                        other=0.0)
            packed = tl.load(q_ptr + (k0 // 8 + rw)[:, None] * stride_qk + rn[None, :],
                             mask=((k0 + rw * 8) < K)[:, None] & (rn < N)[None, :], other=0)
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        # BLOCK_K divides GROUP: one group per tile.
        s = tl.load(s_ptr + (k0 // GROUP) * stride_sg + rn, mask=rn < N, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + (k0 // GROUP) * stride_sg + rn, mask=rn < N, other=0.0).to(tl.float32)
        if GEMV:
            # Float32 multiply-adds, the zero point out of the inner sum: within a group
            # sum x (q - z) s = s (sum x q - z sum x), one subtraction a column, not a weight.
            xf = x.to(tl.float32)
            xq = tl.sum(xf[:, :, None] * q.to(tl.float32)[None, :, :], axis=1)
            acc += (xq - tl.sum(xf, axis=1)[:, None] * z[None, :]) * s[None, :]
        else:
            b = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(x.dtype)
            if IEEE:
                acc += tl.dot(x, b, input_precision="ieee")
            else:
                acc += tl.dot(x, b)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


KERNELS = {"fp8": _fp8_mm, "int4": _int4_mm}


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs exercise the split path without slowing tests
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    split: bool = True
    """Split K across programs when output tiles alone are too few to fill the GPU."""
    gemv: bool = False
    """Multiply-adds in registers (the kernels' ``GEMV``) instead of tensor-core tiles: for a
    few rows, with ``block_m`` as small as 1. The product's size in registers is ``block_m x block_n x
    block_k``, so wide tiles want few rows."""


TUNED: dict[tuple[str, int], Tile] = {
    # The fastest of benchmarks.quant_gpu's candidates on an H200 (Llama-3.1-8B's four products of a
    # layer, bfloat16 activations, 2026-11-28): microseconds a layer beside cuBLAS bfloat16's 125-128
    # (1-64 rows) and 302 (512 rows).
    ("fp8", 1): Tile(16, 64, 128, 4, 3, split=False),  # 174 us
    ("fp8", 16): Tile(16, 64, 128, 4, 3, split=False),  # 223 us
    ("fp8", 64): Tile(64, 64, 128, 4, 4, split=False),  # 223 us
    ("fp8", 512): Tile(128, 128, 64, 8, 3),  # 704 us
    ("int4", 1): Tile(16, 64, 128, 4, 3, split=False),  # 292 us
    ("int4", 16): Tile(16, 64, 128, 8, 5),  # 273 us
    ("int4", 64): Tile(64, 64, 128, 4, 3),  # 266 us
    ("int4", 512): Tile(128, 128, 64, 8, 3),  # 787 us
}
"""Tiles by (kernel, rows rounded up to a power of two, at most 512), as measured on CUDA; rows between
two entries take the next larger's. The interpreter (CPU) keeps the default heuristics."""


def rows_bucket(m: int) -> int:
    return min(512, 1 << max(0, (m - 1).bit_length()))


def default_tile(m: int, step: int) -> Tile:
    block_k = 128 if step % 128 == 0 and m <= 64 else 64 if step % 64 == 0 else 32 if step % 32 == 0 else 16
    return Tile(16 if m <= 16 else 32 if m <= 32 else 64, 64 if m <= 64 else 128, block_k)


def plan(kernel: str, m: int, n: int, k: int, step: int, device: torch.device,
         tile: Tile | None = None) -> tuple[Tile, int]:
    """The tile and the number of K splits for an ``[m, k] x [k, n]`` product whose K tiles must divide
    ``step`` (the scale's or group's width along K). Few rows: split K until the programs fill the
    GPU's multiprocessors twice over."""
    if tile is None and device.type == "cuda":
        tile = next((t for (name, rows), t in sorted(TUNED.items()) if name == kernel and rows >= m), None)
    tile = tile or default_tile(m, step)
    if step % tile.block_k:
        tile = replace(tile, block_k=default_tile(m, step).block_k)
    tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
    split = max(1, min(triton.cdiv(2 * _sms(device), tiles), k // (4 * tile.block_k))) if tile.split else 1
    return tile, split


def _launch(name: str, x: torch.Tensor, n: int, k: int, step: int, args: tuple, strides: tuple,
            constants: dict, tile: Tile | None) -> torch.Tensor:
    m = x.shape[0]
    tile, split = plan(name, m, n, k, step, x.device, tile)
    # Each split's share of K is whole tiles, so a tile never straddles two programs.
    k_split = triton.cdiv(triton.cdiv(k, split), tile.block_k) * tile.block_k
    split = triton.cdiv(k, k_split)
    out = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n), split)
    KERNELS[name][grid](x, *args, out, m, n, k, k_split, x.stride(0), *strides, out.stride(1), out.stride(0),
                        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                        EVEN_K=k % tile.block_k == 0, IEEE=x.dtype == torch.float32, GEMV=tile.gemv,
                        num_warps=tile.warps, num_stages=tile.stages, **constants)
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


def fp8_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_n: int, scale_k: int,
           tile: Tile | None = None) -> torch.Tensor:
    """``x [M, K] @ (weight * scale).T``: ``weight [N, K]`` float8 e4m3, ``scale [N / scale_n,
    K / scale_k]`` float32 (rounded up)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, k = weight.shape
    return _launch("fp8", x, n, k, scale_k, (weight, scale), (weight.stride(0), scale.stride(0)),
                   {"SCALE_N": scale_n, "SCALE_K": scale_k}, tile)


def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group: int, tile: Tile | None = None) -> torch.Tensor:
    """``x [M, K] @ W`` with ``W [K, N] = (q - zeros) * scales``: ``qweight [K / 8, N]`` int32 (row
    ``8 r + i`` in bits ``4 i``), ``scales`` and ``zeros`` ``[K / group, N]``."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    return _launch("int4", x, n, k, group, (qweight, scales, zeros),
                   (qweight.stride(0), scales.stride(0)), {"GROUP": group}, tile)
