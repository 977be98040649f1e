"""The Triton paged-attention kernel (the CUDA backend for block sizes FlashAttention cannot page),
executed on CPU by Triton's interpreter (tests/conftest.py turns it on without a GPU): the
attention contract at block sizes 16, 24, 32 and 256, GQA/MQA/MHA, first chunks through the
kernel itself or a varlen stand-in. With a GPU the same tests run the compiled kernel."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.test_attention import CPU, ref_varlen, run_contract

DEVICE = torch.device("cuda") if torch.cuda.is_available() else CPU
HALF_TOL = 5e-3


@pytest.fixture(scope="module")
def triton_backend():
    from engine.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend


# Under the interpreter every program is Python: the kernel takes the first chunks (the bulk of
# run_contract's rows) in one float32 test; elsewhere, in float16, a FlashAttention stand-in
# takes them (as on a GPU in half precision) and the kernel reads the pages.
def test_triton_kernel_takes_every_chunk_like_dense_attention(triton_backend):
    run_contract(triton_backend(4, 2, 16, 16, fresh_kernel=None), DEVICE, 16, torch.float32, 1e-5)


@pytest.mark.parametrize("block_size", [16, 24, 32, 256])
def test_triton_kernel_pages_like_dense_attention(triton_backend, block_size):
    backend = triton_backend(4, 2, 16, block_size, fresh_kernel=ref_varlen)
    run_contract(backend, DEVICE, block_size, torch.float16, HALF_TOL)


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 4), (6, 2)], ids=["mqa", "mha", "gqa3"])
def test_triton_kernel_head_layouts(triton_backend, heads, kv_heads):
    backend = triton_backend(heads, kv_heads, 16, 16, fresh_kernel=ref_varlen)
    run_contract(backend, DEVICE, 16, torch.float16, HALF_TOL, heads, kv_heads)


def test_first_chunks_go_to_the_varlen_kernel(triton_backend):
    calls = []

    @functools.wraps(ref_varlen)  # its signature: the backend reads enable_gqa off it
    def fresh(*args, **kwargs):
        calls.append(kwargs)
        return ref_varlen(*args, **kwargs)

    run_contract(triton_backend(4, 2, 16, 32, fresh_kernel=fresh), DEVICE, 32, torch.float16, HALF_TOL)
    assert calls and all(c["window_size"] == (-1, 0) and c["enable_gqa"] for c in calls)


def test_float32_first_chunks_stay_in_the_triton_kernel(triton_backend):
    """FlashAttention-2 takes only half precision: in float32 the kernel reads first chunks too."""
    def fresh(*args, **kwargs):
        raise AssertionError("the varlen kernel got a float32 chunk")

    backend = triton_backend(4, 4, 16, 16, fresh_kernel=fresh)
    run_contract(backend, DEVICE, 16, torch.float32, 1e-5, 4, 4)


def test_head_dim_that_is_not_a_power_of_two(triton_backend):
    backend = triton_backend(4, 2, 24, 16, fresh_kernel=ref_varlen)
    run_contract(backend, DEVICE, 16, torch.float16, HALF_TOL, head_dim=24)
