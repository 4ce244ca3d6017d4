"""The CPU reference linear's exact-chunk-sum path (detinfer.kernels._exact_dot).

The claim that makes it batch-invariant is that BLAS never rounds: every chunk dot product it returns is
the exact one. Checked here against an independent exact sum (math.fsum of exact float64 products), and by
its consequences: same bits whatever the thread count, the row's neighbours, zero-extension of K.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import _exact_dot as ed
from detinfer.kernels import matmul_ref as mm


def _rand(shape, seed, spread=0.0):
    """Uniform values; with spread > 0 each element is also scaled by 2^U(-spread, spread) (wide exponents)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
    if spread:
        x = x * torch.exp2((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * spread)
    return x.float()


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The path's definition, computed independently: rounded operands (the module's rounding), each chunk
    summed exactly by math.fsum, chunks added in ascending order in float64, rounded once to float32."""
    xq, wq = ed._chunked(x), ed._chunked(w)
    ed._round_rows_(xq)
    ed._round_rows_(wq)
    m, c, _ = xq.shape
    out = torch.empty((m, w.shape[0]), dtype=torch.float32)
    for i in range(m):
        for j in range(w.shape[0]):
            acc = 0.0
            for ch in range(c):
                exact = math.fsum((xq[i, ch] * wq[j, ch]).tolist())  # products of <= 24-bit values: exact
                acc = exact if ch == 0 else acc + exact
            out[i, j] = acc
    return out


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 5), k=st.sampled_from([1, 7, 128, 129, 300]), n=st.integers(1, 6),
       spread=st.sampled_from([0.0, 20.0]), seed=st.integers(0, 2**31))
def test_blas_returns_the_exact_chunk_sums(m, k, n, spread, seed):
    x, w = _rand((m, k), seed, spread), _rand((n, k), seed + 1, spread)
    assert torch.equal(mm.linear_ref(x, w), _reference(x, w))


def test_rounding_keeps_23_bits_below_the_chunk_maximum():
    x = _rand((4, 256), 3, spread=30.0).double().view(4, 2, 128)
    q = x.clone()
    amax = ed._round_rows_(q)
    _, e = torch.frexp(amax)
    step = torch.ldexp(torch.ones_like(amax), e - ed.MANTISSA_BITS)
    ints = q / step
    assert torch.equal(ints, ints.round()) and bool((ints.abs() <= 2**ed.MANTISSA_BITS).all())
    assert bool(((q - x).abs() <= step / 2).all())  # round to nearest


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_changes_no_bit(threads):
    x, w = _rand((37, 600), 5), _rand((70, 600), 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = mm.linear_ref(x, w)
        torch.set_num_threads(threads)
        assert torch.equal(mm.linear_ref(x, w), want)
        assert torch.equal(mm.linear_ref(x[:1], w), want[:1])
    finally:
        torch.set_num_threads(before)


@given(m=st.integers(1, 9), k=st.integers(1, 300), n=st.integers(1, 20), pad=st.integers(1, 300),
       seed=st.integers(0, 2**31))
@settings(deadline=None)
def test_linear_ref_zero_extension_of_k_changes_no_bit(m, k, n, pad, seed):
    x, w = _rand((m, k), seed), _rand((n, k), seed + 1)
    xp = torch.cat([x, torch.zeros(m, pad)], 1)
    wp = torch.cat([w, torch.zeros(n, pad)], 1)
    assert torch.equal(mm.linear_ref(xp, wp), mm.linear_ref(x, w))


def test_a_non_finite_row_changes_only_itself():
    x, w = _rand((6, 200), 7), _rand((9, 200), 8)
    alone = mm.linear_ref(x, w)
    x_bad = x.clone()
    x_bad[2, 5] = float("nan")
    x_bad[4, 0] = float("inf")
    y = mm.linear_ref(x_bad, w)
    keep = [0, 1, 3, 5]
    assert torch.equal(y[keep], alone[keep])
    assert bool(y[2].isnan().all()) and not bool(y[4].isfinite().any())
    part = mm.linear_ref(x_bad[2:5], w)
    assert torch.equal(part.isnan(), y[2:5].isnan()) and torch.equal(part.nan_to_num(), y[2:5].nan_to_num())


def test_non_finite_weight_takes_the_fold_path():
    x, w = _rand((3, 40), 9), _rand((5, 40), 10)
    w[1, 3] = float("inf")
    y = mm.linear_ref(x, w)
    assert torch.equal(y[:, [0, 2, 3, 4]], mm._ref_bnk(x[None], w[None], None)[0][:, [0, 2, 3, 4]])
    assert torch.equal(mm.linear_ref(x[1:], w), y[1:])


def test_weight_cache_follows_in_place_updates():
    x, w = _rand((4, 130), 11), _rand((6, 130), 12)
    mm.linear_ref(x, w)
    w.mul_(3.0)  # bumps the version counter: the cached rounded weight must not be reused
    assert torch.equal(mm.linear_ref(x, w), mm.linear_ref(x, w.clone()))


def test_low_precision_inputs_round_once_to_their_dtype():
    x, w = _rand((5, 300), 13).half(), _rand((7, 300), 14).half()
    y = mm.linear_ref(x, w)
    assert y.dtype == torch.float16
    assert torch.equal(y, mm.linear_ref(x.float(), w.float()).half())
