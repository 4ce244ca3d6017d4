"""The FP8 mixture-of-experts layer: batch invariance (bitwise) and accuracy of the CPU path, expert
parallel blocks, and (GPU only) the grouped FP8 expert GEMMs against the per-expert loop."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import fp8_moe
from detinfer.kernels.fp8_linear import linear_fp8_ref
from detinfer.kernels.fp8_quant import dequantize_weight, quantize_weight_rows
from detinfer.ops import Ops
from detinfer.ops.backend import silu_cpu


def _layer(E=4, H=200, inter=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g).to(torch.bfloat16)
    wgu, sgu = quantize_weight_rows(torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5)
    wd, sd = quantize_weight_rows(torch.randn(E, H, inter, generator=g) / inter ** 0.5)
    return router, wgu, sgu, wd, sd


def _x(T, H=200, seed=1):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 20), a=st.integers(0, 20), b=st.integers(0, 20), seed=st.integers(0, 1000))
def test_cpu_moe_fp8_slice_invariance_bitwise(T, a, b, seed):
    router, wgu, sgu, wd, sd = _layer()
    x = _x(T, seed=seed)
    ops = Ops("deterministic", "cpu", torch.bfloat16)
    a, b = sorted((min(a, T), min(b, T)))
    full = ops.moe_fp8(x, router, wgu, sgu, wd, sd, 2, True)
    assert torch.equal(full[a:b], ops.moe_fp8(x[a:b], router, wgu, sgu, wd, sd, 2, True))


def test_cpu_moe_fp8_close_to_float64_of_dequantized_weights():
    router, wgu, sgu, wd, sd = _layer()
    x = _x(16)
    ops = Ops("deterministic", "cpu", torch.bfloat16)
    y = ops.moe_fp8(x, router, wgu, sgu, wd, sd, 2, True).double()
    weights, ids = ops.moe_route(x, router, 2, True)
    gu, dn = dequantize_weight(wgu, sgu).double(), dequantize_weight(wd, sd).double()
    ref = torch.zeros_like(y)
    for t in range(x.shape[0]):
        for r in range(2):
            e = int(ids[t, r])
            gate, up = (gu[e] @ x[t].double()).chunk(2)
            ref[t] += float(weights[t, r]) * (dn[e] @ (gate / (1 + torch.exp(-gate)) * up))
    # fp8 activations (twice) and bf16 outputs: a few percent
    assert float((y - ref).norm() / ref.norm()) < 0.06


def test_expert_parallel_blocks_give_the_full_layers_slots():
    router, wgu, sgu, wd, sd = _layer()
    x = _x(9)
    ids = Ops("deterministic", "cpu", torch.bfloat16).moe_route(x, router, 2, True)[1]

    def silu_mul(g, u):
        return silu_cpu(g) * u

    full = fp8_moe.expert_outputs_fp8(x, ids, wgu, sgu, wd, sd, linear_fp8_ref, silu_mul)
    lo = fp8_moe.expert_outputs_fp8(x, ids, wgu[:2], sgu[:2], wd[:2], sd[:2], linear_fp8_ref, silu_mul, 0)
    hi = fp8_moe.expert_outputs_fp8(x, ids, wgu[2:], sgu[2:], wd[2:], sd[2:], linear_fp8_ref, silu_mul, 2)
    mine = (ids < 2)[:, :, None]
    assert torch.equal(torch.where(mine, lo, hi), full)
    assert not bool(lo[~mine.expand_as(lo)].any()) and not bool(hi[mine.expand_as(hi)].any())


# -- GPU: the grouped FP8 expert GEMMs ------------------------------------------------------------------------
def _fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _cuda(*ts):
    return [t.cuda() for t in ts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 7, 130])
def test_grouped_matches_the_loop(T):
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    router, wgu, sgu, wd, sd = _cuda(*_layer(E=8, H=512, inter=384))
    x = _x(T, H=512).cuda()
    ops = Ops("deterministic", "cuda", torch.bfloat16)
    ids = ops.moe_route(x, router, 2, True)[1]
    grouped = fp8_moe.expert_outputs_fp8_grouped(x, ids, wgu, sgu, wd, sd).float()
    loop = fp8_moe.expert_outputs_fp8(x, ids, wgu, sgu, wd, sd, ops.linear_fp8, ops.silu_mul).float()
    assert float((grouped - loop).norm() / loop.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=10, deadline=None)
@given(T=st.integers(1, 200), a=st.integers(0, 200), b=st.integers(0, 200))
def test_grouped_slice_invariance_and_expert_parallel_bitwise(T, a, b):
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    router, wgu, sgu, wd, sd = _cuda(*_layer(E=8, H=512, inter=384))
    x = _x(T, H=512).cuda()
    ops = Ops("deterministic", "cuda", torch.bfloat16)
    a, b = sorted((min(a, T), min(b, T)))
    full = ops.moe_fp8(x, router, wgu, sgu, wd, sd, 2, True)
    assert torch.equal(full[a:b], ops.moe_fp8(x[a:b], router, wgu, sgu, wd, sd, 2, True))
    ids = ops.moe_route(x, router, 2, True)[1]
    whole = fp8_moe.expert_outputs_fp8_grouped(x, ids, wgu, sgu, wd, sd)
    hi = fp8_moe.expert_outputs_fp8_grouped(x, ids, wgu[4:], sgu[4:], wd[4:], sd[4:], 4)
    mine = (ids >= 4)[:, :, None]
    assert torch.equal(torch.where(mine, hi, torch.zeros_like(hi)), torch.where(mine, whole, torch.zeros_like(whole)))
