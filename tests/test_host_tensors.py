"""Host tensors of a step, packed from Python lists."""

from __future__ import annotations

import pytest
import torch

from engine.host_tensors import host_tensor


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
def test_host_tensor_is_the_lists_end_to_end(dtype):
    parts = [[1, 2, 3], [], [4], [5, 6]]
    got = host_tensor(dtype, *parts)
    assert got.dtype == dtype
    assert torch.equal(got, torch.tensor([1, 2, 3, 4, 5, 6], dtype=dtype))
    assert host_tensor(dtype, [], []).numel() == 0
