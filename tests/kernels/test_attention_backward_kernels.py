"""The Triton attention backward's kernels, against their earlier forms (bitwise):

* the gradients are stored by the kernels in the gradient dtype, one rounding of the fp32 accumulators:
  the same bits as storing fp32 and casting afterwards (interpreter: fp32 inputs, fp16 stores, which numpy
  rounds like torch; GPU: bf16 at Qwen3-8B's shape).
GPU (marker gpu): bf16 repeatability and packing invariance with the shipped configs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.attention_backward import _backward, attention_backward, attention_forward_ref

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FEW = max(3, settings.default.max_examples // 3)  # each example is several interpreter launches


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _inputs(lens, hq, hkv, d, dtype, seed):
    cu = _cu(lens)
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(cu[-1], hq, d, generator=g).to(dtype).to(DEV) for _ in range(2))
    k, v = (torch.randn(cu[-1], hkv, d, generator=g).to(dtype).to(DEV) for _ in range(2))
    out = attention_forward_ref(q, k, v, cu, d ** -0.5)
    return (do, q, k, v, out), cu


def _lse(q, k, cu, scale):
    """Row log-sum-exps [T, Hq] in log2 units of the scaled scores (what `lse=` takes), in float64."""
    lse = torch.empty(q.shape[:2], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for s0, s1 in zip(cu[:-1], cu[1:]):
        kk = k[s0:s1].double().repeat_interleave(group, 1)  # [L, Hq, D]
        s = torch.einsum("qhd,khd->hqk", q[s0:s1].double(), kk) * scale
        s = s.masked_fill(torch.ones(s1 - s0, s1 - s0).triu(1).bool(), float("-inf"))
        lse[s0:s1] = (torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0))).T
    return lse.float().to(q.device)


@settings(max_examples=FEW)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.sampled_from([(2, 1), (4, 2), (4, 4)]),
       st.booleans(), st.integers(0, 1000))
def test_grads_stored_in_grad_dtype_equal_fp32_then_cast(lens, heads, with_lse, seed):
    (do, q, k, v, out), cu = _inputs(lens, *heads, 16, torch.float32, seed)
    lse = _lse(q, k, cu, 0.25) if with_lse else None  # the read path, or the recompute path
    wide = _backward(do, q, k, v, out, cu, 0.25, None, lse, grad_dtype=torch.float32)
    narrow = _backward(do, q, k, v, out, cu, 0.25, None, lse, grad_dtype=torch.float16)
    assert all(n.dtype == torch.float16 and torch.equal(n, w.half()) for n, w in zip(narrow, wide))
    assert all(torch.equal(a, w) for a, w in zip(attention_backward(do, q, k, v, out, cu, 0.25, lse=lse), wide))


@pytest.mark.gpu
def test_bf16_grads_equal_fp32_then_cast():
    (do, q, k, v, out), cu = _inputs([1024, 1024, 517], 32, 8, 128, torch.bfloat16, 3)
    wide = _backward(do, q, k, v, out, cu, 128 ** -0.5, None, None, grad_dtype=torch.float32)
    got = attention_backward(do, q, k, v, out, cu, 128 ** -0.5)
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, w.bfloat16()) for a, w in zip(got, wide))
