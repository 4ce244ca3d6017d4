"""`attention_delta`: the attention backward's delta = rowsum(dO * O) in one launch, bitwise equal to the
torch form `fold_sum(dout.float() * out.float(), -1)` (fp32 and bf16 inputs: the interpreter's bf16 loads
cast to fp32 are exact), for any rows, heads, head_dim and strided inputs; bad input is a clear error.
GPU (marker gpu): the same equality for bf16 at Qwen3-8B's shape."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.kernels._fold import fold_sum
from detinfer.kernels.attention_delta import attention_delta

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)


@given(st.sampled_from([1, 7, 64, 65, 333]), st.integers(1, 5), st.sampled_from([16, 32, 64, 128]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.integers(0, 10_000))
def test_delta_equals_fold_sum_bitwise(t, h, d, dtype, strided, seed):
    do, out = _rand((t, h, d), dtype, seed), _rand((t, h, d), dtype, seed + 1)
    if strided:  # heads taken from a wider tensor: row strides that are not h * d
        do = _rand((t, h + 2, d), dtype, seed)[:, 1:h + 1]
    got = attention_delta(do, out)
    assert got.dtype == torch.float32 and got.shape == (t, h)
    assert torch.equal(got, fold_sum(do.float() * out.float(), -1))


def test_delta_empty_and_bad_input():
    assert attention_delta(torch.zeros(0, 4, 16, device=DEV), torch.zeros(0, 4, 16, device=DEV)).shape == (0, 4)
    with pytest.raises(ValueError, match="power of two"):
        attention_delta(torch.zeros(2, 1, 24, device=DEV), torch.zeros(2, 1, 24, device=DEV))
    with pytest.raises(ValueError, match="one shape"):
        attention_delta(torch.zeros(2, 1, 16, device=DEV), torch.zeros(2, 2, 16, device=DEV))


@pytest.mark.gpu
def test_delta_bf16_qwen3_shape_equals_fold_sum():
    do, out = _rand((8 * 1024, 32, 128), torch.bfloat16, 1), _rand((8 * 1024, 32, 128), torch.bfloat16, 2)
    assert torch.equal(attention_delta(do, out), fold_sum(do.float() * out.float(), -1))
