"""The paged attention forward's row log-sum-exp (`lse_out`) and the attention backward that reads it.

In the training layout (each sequence a whole prefill, packed; `PackedPagedAttention`): storing the LSE
changes no output bit; it matches a float64 logsumexp (log2 units of the scaled scores) for the
sequential and the split-parallel schedules, with GQA; it is the same bits whatever the schedule and the
packing. `attention_backward(lse=)` matches the float64 reference gradients, is bitwise packing-independent
and repeatable, and really reads the given LSE. CPU: fp32 in Triton's interpreter; GPU (marker gpu):
bf16 at model shapes, and a 20-repeat bitwise check.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.attention import paged_attention, paged_attention_fast
from detinfer.kernels.attention_backward import attention_backward, attention_backward_ref
from detinfer.kernels.attention_ref import paged_attention_ref
from detinfer.kernels.kv_write import write_kv_ref
from detinfer.train.adapter import PackedPagedAttention

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FEW = max(3, settings.default.max_examples // 3)  # each example is several interpreter launches
# |lse - ref| <= tol * (1 + |ref|): fp32 scores; bf16 also rounds each probability before summing it.
LSE_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, d, generator=g).to(DEV, dtype) for h in (hq, hkv, hkv, hq))


def forward(q, k, v, cu: list[int], scale: float, lse_out=None, block_size: int = 16, attend=paged_attention,
            **launch):
    """The trainer's forward: K/V written to a temporary paged cache, then one paged attention call."""
    attn = PackedPagedAttention(functools.partial(attend, **launch), write_kv_ref, cu, scale, block_size, q.device)
    return attn._forward(q, k, v, lse_out=lse_out)


def lse_f64(q, k, cu: list[int], scale: float) -> torch.Tensor:
    """float64 log2(sum_j exp(scale * q.k_j)) per (token, query head), causal within each sequence."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[:2], dtype=torch.float64, device=q.device)
    for a, b in zip(cu[:-1], cu[1:]):
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double().repeat_interleave(group, 1)) * scale
        hide = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril().logical_not()
        out[a:b] = (torch.logsumexp(s.masked_fill(hide, float("-inf")), -1) / math.log(2)).T
    return out


def assert_lse_accurate(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = ((lse.double() - ref).abs() / (1 + ref.abs())).max().item()
    assert err <= LSE_TOL[dtype], err


def check_forward_lse(lens, hq, hkv, d, dtype, seed, schedules):
    """Every schedule (one split size): the same output bits with and without lse_out, accurate LSE, one set of LSE bits
    across schedules, and the last sequence alone gives its packed rows' LSE bits."""
    cu, scale = _cu(lens), d ** -0.5
    q, k, v, _ = _qkv(cu[-1], hq, hkv, d, dtype, seed)
    ref = lse_f64(q, k, cu, scale)
    first = None
    for launch in schedules:
        lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=DEV)
        out = forward(q, k, v, cu, scale, lse_out=lse, **launch)
        assert torch.equal(out, forward(q, k, v, cu, scale, **launch)), launch
        assert_lse_accurate(lse, ref, dtype)
        if first is None:
            first = lse
        assert torch.equal(lse, first), launch
    s0, s1 = cu[-2], cu[-1]
    alone = torch.empty(s1 - s0, hq, dtype=torch.float32, device=DEV)
    forward(q[s0:s1], k[s0:s1], v[s0:s1], [0, s1 - s0], scale, lse_out=alone, block_size=8, **schedules[0])
    assert torch.equal(alone, first[s0:s1])
    return first


# --------------------------------------------------------------------------------------- CPU (fp32)
@settings(max_examples=FEW)
@given(lens=st.lists(st.one_of(st.integers(1, 20), st.integers(60, 150)), min_size=1, max_size=3),
       heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]), seed=st.integers(0, 999))
def test_forward_lse_accurate_schedule_and_packing_invariant(lens, heads, seed):
    """split_size 64 = one tile per split: both schedules merge a partial per 64 keys."""
    check_forward_lse(lens, *heads, 64, torch.float32, seed,
                      [dict(schedule="sequential", split_size=64), dict(schedule="parallel", split_size=64)])


def test_forward_lse_leaves_rows_past_the_packed_queries_untouched():
    """Kernel (both schedules, and its non-invariant twin) and reference: accurate LSE, and rows past
    cu_q_lens[-1] (padding) keep what they held."""
    cu, scale = [0, 3, 40], 0.125
    q, k, v, _ = _qkv(43, 4, 2, 64, torch.float32, 1)  # 3 padding rows past cu[-1]
    k_cache = torch.zeros(4, 16, 2, 64, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    # sequence 0: 3 keys in block 0; sequence 1: 37 keys in blocks 1..3
    write_kv_ref(k[:40], v[:40], k_cache, v_cache, torch.tensor([0, 1, 2] + list(range(16, 53)), device=DEV))
    meta = (torch.tensor([[0, 0, 0], [1, 2, 3]], dtype=torch.int32, device=DEV),
            torch.tensor([3, 37], dtype=torch.int32, device=DEV), torch.tensor(cu, dtype=torch.int32, device=DEV))
    ref = lse_f64(q[:40], k[:40], cu, scale)
    for fn, launch in ((paged_attention, dict(schedule="sequential", split_size=64)),
                       (paged_attention, dict(schedule="parallel", split_size=64)),
                       (paged_attention_fast, {}), (paged_attention_ref, {})):
        lse = torch.full((43, 4), 7.0, device=DEV)
        fn(q, k_cache, v_cache, *meta, scale, lse_out=lse, **launch)
        assert_lse_accurate(lse[:40], ref, torch.float32)
        assert torch.equal(lse[40:], torch.full((3, 4), 7.0, device=DEV)), (fn.__name__, launch)


def test_reference_lse_is_the_float64_logsumexp():
    lens, scale = [5, 1, 30], 0.3
    cu = _cu(lens)
    q, k, v, _ = _qkv(cu[-1], 4, 2, 16, torch.float64, 3)
    lse = torch.empty(cu[-1], 4, device=DEV)
    forward(q, k, v, cu, scale, lse_out=lse, attend=paged_attention_ref)
    assert (lse.double() - lse_f64(q, k, cu, scale)).abs().max().item() <= 1e-6


def check_backward_with_lse(lens, hq, hkv, d, dtype, seed, tol):
    cu, scale = _cu(lens), d ** -0.5
    q, k, v, do = _qkv(cu[-1], hq, hkv, d, dtype, seed)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEV)
    out = forward(q, k, v, cu, scale, lse_out=lse)
    got = attention_backward(do, q, k, v, out, cu, scale, lse=lse)
    ref = attention_backward_ref(*(x.double() for x in (do, q, k, v, out)), cu, scale)
    for a, b in zip(got, ref, strict=True):
        assert (a.double() - b).abs().max().item() <= tol * (b.abs().max().item() + 1)
    again = attention_backward(do, q, k, v, out, cu, scale, lse=lse)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    s0, s1 = cu[-2], cu[-1]  # the last sequence alone, at offset 0, with its own forward's LSE
    lse_alone = torch.empty(s1 - s0, hq, dtype=torch.float32, device=DEV)
    out_alone = forward(q[s0:s1], k[s0:s1], v[s0:s1], [0, s1 - s0], scale, lse_out=lse_alone)
    alone = attention_backward(do[s0:s1], q[s0:s1], k[s0:s1], v[s0:s1], out_alone, [0, s1 - s0], scale,
                               lse=lse_alone)
    assert all(torch.equal(a[s0:s1], b) for a, b in zip(got, alone, strict=True))
    return (do, q, k, v, out, cu, scale), lse, got


@pytest.mark.parametrize("lens,hq,hkv", [([5, 1, 34], 4, 2), ([33, 67], 2, 1), ([1], 2, 2)])
def test_backward_with_forward_lse_matches_fp64_and_is_packing_independent(lens, hq, hkv):
    args, lse, got = check_backward_with_lse(lens, hq, hkv, 64, torch.float32, sum(lens), 2e-5)
    # The LSE is read, not recomputed: one 2x too large halves every probability, so every gradient moves.
    shifted = attention_backward(*args, lse=lse + 1.0)
    assert all(not torch.equal(a, b) for a, b in zip(got, shifted))
    recomputed = attention_backward(*args)  # the recompute path: equal within rounding, not bitwise
    for a, b in zip(got, recomputed):
        assert (a - b).abs().max().item() <= 1e-5 * (b.abs().max().item() + 1)


def test_bad_lse_buffers_are_rejected():
    cu, scale = [0, 4, 9], 0.125
    q, k, v, do = _qkv(9, 4, 2, 64, torch.float32, 0)
    good = torch.empty(9, 4, device=DEV)
    bad = {"dtype": good.double(), "shape": torch.empty(9, 2, device=DEV), "not contiguous":
           torch.empty(4, 9, device=DEV).T, "device": torch.empty(9, 4, device="meta"), "type": [0.0] * 36}
    for lse in bad.values():
        for attend in (paged_attention, paged_attention_ref):
            with pytest.raises(ValueError, match="lse_out must be a contiguous torch.float32 tensor"):
                forward(q, k, v, cu, scale, lse_out=lse, attend=attend)
    out = forward(q, k, v, cu, scale, lse_out=good)
    for what in ("dtype", "shape", "device", "type"):
        with pytest.raises(ValueError, match="lse must be a torch.float32 tensor of shape"):
            attention_backward(do, q, k, v, out, cu, scale, lse=bad[what])


# ----------------------------------------------------------------------------------- GPU (bf16)
@pytest.mark.gpu
@pytest.mark.parametrize("lens,hq,hkv,d", [([1024, 1024, 7, 300], 32, 8, 128), ([129, 64, 700], 9, 3, 64)])
def test_gpu_forward_lse_bf16(lens, hq, hkv, d):
    check_forward_lse(lens, hq, hkv, d, torch.bfloat16, d, [dict(schedule="sequential"), dict(schedule="parallel")])


@pytest.mark.gpu
@pytest.mark.parametrize("lens,hq,hkv,d", [([1024, 1024, 7, 300], 32, 8, 128), ([129, 64], 9, 3, 64)])
def test_gpu_backward_with_forward_lse_bf16(lens, hq, hkv, d):
    check_backward_with_lse(lens, hq, hkv, d, torch.bfloat16, d, 3e-2)


@pytest.mark.gpu
def test_gpu_forward_lse_and_backward_repeat_bitwise():
    """Twenty forward + backward runs at Qwen3-8B's attention shape give one set of bits."""
    cu, hq, d = _cu([1024, 1024, 517]), 32, 128
    q, k, v, do = _qkv(cu[-1], hq, 8, d, torch.bfloat16, 5)

    def run():
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEV)
        out = forward(q, k, v, cu, d ** -0.5, lse_out=lse)
        return (out, lse, *attention_backward(do, q, k, v, out, cu, d ** -0.5, lse=lse))
    first = run()
    for _ in range(19):
        assert all(torch.equal(a, b) for a, b in zip(first, run(), strict=True))
