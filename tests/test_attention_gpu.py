"""Every attention backend's real kernels on CUDA equal dense attention (the torch reference's
semantics) at block sizes 16 and 256 (Triton: compiled, not interpreted): decodes, first prefill chunks, chunks after a cached
prefix, GQA and MQA. A backend whose kernel is absent, or whose block-size rule excludes
the case, skips with the reason."""

from __future__ import annotations

import pytest
import torch

from tests.test_attention import needs_backend, run_contract

pytestmark = pytest.mark.gpu
HEAD_DIM = 64
SHAPES = pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
BLOCKS = pytest.mark.parametrize("block_size", [16, 256])


@SHAPES
@BLOCKS
@pytest.mark.parametrize("name", ["varlen", "flash", "fa3"])
def test_flash_kernels_match_dense_attention(name, block_size, heads, kv_heads):
    needs_backend(name, torch.bfloat16, block_size, HEAD_DIM)
    run_contract(name, torch.device("cuda"), block_size, torch.bfloat16, 2e-2, heads, kv_heads, HEAD_DIM)


@SHAPES
@BLOCKS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_kernel_compiled_matches_dense_attention(block_size, heads, kv_heads, dtype):
    needs_backend("triton", dtype, block_size, HEAD_DIM)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    run_contract("triton", torch.device("cuda"), block_size, dtype, atol, heads, kv_heads, HEAD_DIM)


@BLOCKS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_kernel_compiled_over_long_contexts(block_size, dtype):
    """Many tiles per row and many blocks per tile: a 1000-token context, a 513-token first chunk."""
    needs_backend("triton", dtype, block_size, HEAD_DIM)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    run_contract("triton", torch.device("cuda"), block_size, dtype, atol, 8, 2, HEAD_DIM,
                 contexts=[0, 700, 300, 1000, 129], new=[513, 1, 64, 1, 1])


@SHAPES
@BLOCKS
def test_torch_backend_on_cuda_matches_dense_attention(block_size, heads, kv_heads):
    needs_backend("torch", torch.float32, block_size, HEAD_DIM)
    run_contract("torch", torch.device("cuda"), block_size, torch.float32, 1e-4, heads, kv_heads, HEAD_DIM)
