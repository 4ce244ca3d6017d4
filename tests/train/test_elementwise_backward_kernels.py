"""The Triton backwards of SiLU*mul, RMSNorm (+ residual) and the embedding gather: accuracy vs float64,
two runs bitwise equal, row slices bitwise equal to the rows of the whole batch (dx, dgate, dup), the
documented summation orders, bad input, and the training Functions' dispatch.

fp32 tests run on the GPU where there is one, else in Triton's interpreter (TRITON_INTERPRET=1; the
interpreter gives garbage for bf16 math, so fp16/bf16 are `gpu` tests)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.embedding_backward import embedding_backward, embedding_backward_ref
from detinfer.kernels.rmsnorm import MAX_D
from detinfer.kernels.rmsnorm_backward import ROWS_PER_DW, rms_norm_backward, rms_norm_backward_ref
from detinfer.kernels.silu_mul_backward import silu_mul_backward, silu_mul_backward_ref
from detinfer.train import functions

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
ROWS = st.sampled_from([1, 7, 333]) | st.integers(1, 40)
GPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _eps(dtype) -> float:
    """Relative rounding of one result of `dtype` (the kernels compute in fp32 and round once)."""
    return torch.finfo(dtype).eps


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype).to(DEV)


def _assert_close(got, want64, dtype, extra=1e-5):
    """|got - want| <= one rounding of `dtype` plus `extra` of the result's scale (fp32 math error)."""
    err = (got.double().cpu() - want64.cpu()).abs()
    tol = 2 * _eps(dtype) * want64.abs().cpu() + extra * (want64.abs().max().item() + 1)
    assert bool((err <= tol).all()), f"worst error {err.max().item():.3g} (tolerance {tol.max().item():.3g})"


def _slice(draw_data, rows):
    m = draw_data.draw(st.integers(0, rows - 1))
    return m, draw_data.draw(st.integers(m + 1, rows))


# ---- SiLU * mul ---------------------------------------------------------------------------------------


def _check_silu_mul(rows, n, dtype, seed, data):
    gu = _randn(rows, 2 * n, seed=seed, dtype=dtype, scale=3.0)
    gate, up = gu.split(n, dim=-1)  # strided halves, as the fused gate_up projection gives them
    dout = _randn(rows, n, seed=seed + 1, dtype=dtype)
    dgate, dup = silu_mul_backward(dout, gate, up)
    assert dgate.dtype == dup.dtype == dtype and dgate.shape == dup.shape == (rows, n)
    want = silu_mul_backward_ref(dout.double(), gate.double(), up.double())
    for got, ref in zip((dgate, dup), want):
        _assert_close(got, ref, dtype)
    again = silu_mul_backward(dout, gate, up)
    assert torch.equal(dgate, again[0]) and torch.equal(dup, again[1])
    m, k = _slice(data, rows)
    part = silu_mul_backward(dout[m:k], gate[m:k], up[m:k])
    assert torch.equal(part[0], dgate[m:k]) and torch.equal(part[1], dup[m:k])
    return dgate, dup, dout, gate, up


@settings(max_examples=10, deadline=None)
@given(ROWS, st.sampled_from([1, 5, 96, 1000, 1500]), st.integers(0, 2**16), st.data())
def test_silu_mul_backward_fp32_accurate_deterministic_row_invariant(rows, n, seed, data):
    dgate, dup, dout, gate, up = _check_silu_mul(rows, n, torch.float32, seed, data)
    if DEV == "cpu":  # the interpreter: numpy's fp32 exp vs torch's, the rest the same roundings
        ref = silu_mul_backward_ref(dout, gate, up)
        for got, want in zip((dgate, dup), ref):
            assert (got - want).abs().max().item() <= 4 * _eps(torch.float32) * (want.abs().max().item() + 1)


@pytest.mark.gpu
@settings(deadline=None)
@given(ROWS, st.sampled_from([1, 5, 96, 1000, 1500, 12288]), st.sampled_from(GPU_DTYPES), st.integers(0, 2**16),
       st.data())
def test_gpu_silu_mul_backward_accurate_deterministic_row_invariant(rows, n, dtype, seed, data):
    _check_silu_mul(rows, n, dtype, seed, data)


def test_silu_mul_backward_rejects_bad_input():
    g = torch.zeros(2, 3, device=DEV)
    with pytest.raises(ValueError, match="dout must be a tensor of gate's shape"):
        silu_mul_backward(torch.zeros(2, 4, device=DEV), g, g)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_backward(g, g, torch.zeros(3, 3, device=DEV))
    with pytest.raises(TypeError, match="not supported"):
        silu_mul_backward(g.double(), g.double(), g.double())


# ---- RMSNorm (+ residual) -----------------------------------------------------------------------------


def _rms_case(rows, d, dtype, seed, residual, weight, dh_out):
    x = _randn(rows, d, seed=seed, dtype=dtype)
    res = _randn(rows, d, seed=seed + 1, dtype=dtype) if residual else None
    w = (1 + 0.1 * _randn(d, seed=seed + 2)).to(dtype) if weight else None
    dy = _randn(rows, d, seed=seed + 3, dtype=dtype)
    dh = _randn(rows, d, seed=seed + 4, dtype=dtype) if dh_out else None
    return dy, dh, x, res, w


def _rms_want64(dy, dh, x, res, w, eps):
    """float64 reference of the same op: h rounded to x.dtype as the forward's add does, n = h * r
    unrounded (covered by dw's tolerance)."""
    h = x if res is None else x + res
    return rms_norm_backward_ref(dy.double(), None if dh is None else dh.double(), h.double(), None,
                                 None if w is None else w.double(), eps)


def _check_rms(rows, d, dtype, seed, flags, data, eps=1e-6):
    dy, dh, x, res, w = _rms_case(rows, d, dtype, seed, *flags)
    dx, dres, dw = rms_norm_backward(dy, dh, x, res, w, eps)
    want_dx, _, want_dw = _rms_want64(dy, dh, x, res, w, eps)
    assert dx.dtype == dtype and dx.shape == x.shape
    _assert_close(dx, want_dx, dtype)
    if res is None:
        assert dres is None
    else:  # a separate tensor with dx's bits (autograd may accumulate into either in place)
        assert torch.equal(dres, dx) and dres.data_ptr() != dx.data_ptr()
    if w is None:
        assert dw is None
    else:
        assert dw.dtype == torch.float32 and dw.shape == (d,)
        hf = (x if res is None else x + res).double()
        n_abs = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).abs()
        scale = (dy.double().abs() * n_abs).sum(0).cpu()  # sum of |terms|: bounds every rounding error
        err = (dw.double().cpu() - want_dw.cpu()).abs()
        assert bool((err <= 2 * _eps(dtype) * scale + 1e-6).all()), f"dw worst error {err.max().item():.3g}"
    again = rms_norm_backward(dy, dh, x, res, w, eps)
    assert torch.equal(dx, again[0]) and (dw is None or torch.equal(dw, again[2]))
    m, k = _slice(data, rows)
    part = rms_norm_backward(dy[m:k], None if dh is None else dh[m:k], x[m:k], None if res is None else res[m:k],
                             w, eps)
    assert torch.equal(part[0], dx[m:k])
    return dx, dw, (dy, dh, x, res, w)


FLAGS = st.tuples(st.booleans(), st.booleans(), st.booleans())  # residual, weight, dh_out


@settings(max_examples=12, deadline=None)
@given(ROWS, st.sampled_from([1, 3, 48, 300, 1000]), FLAGS, st.integers(0, 2**16), st.data())
def test_rms_norm_backward_fp32_accurate_deterministic_row_invariant(rows, d, flags, seed, data):
    dx, dw, args = _check_rms(rows, d, torch.float32, seed, flags, data)
    if DEV == "cpu":  # the interpreter's row sums are numpy's, the reference's fold_sum: a few ulps apart
        ref_dx, _, ref_dw = rms_norm_backward_ref(*args, 1e-6)
        assert (dx - ref_dx).abs().max().item() <= 1e-5 * (ref_dx.abs().max().item() + 1)
        if dw is not None:
            assert (dw - ref_dw).abs().max().item() <= 1e-5 * (ref_dw.abs().max().item() + 1)


@pytest.mark.gpu
@settings(deadline=None)
@given(ROWS, st.sampled_from([1, 3, 128, 300, 1000, 4096, 5120]), FLAGS, st.sampled_from(GPU_DTYPES),
       st.integers(0, 2**16), st.data())
def test_gpu_rms_norm_backward_accurate_deterministic_row_invariant(rows, d, flags, dtype, seed, data):
    _check_rms(rows, d, dtype, seed, flags, data)


def test_rms_norm_backward_dw_is_a_fold_of_fixed_row_blocks():
    """dw = fold_sum over blocks of ROWS_PER_DW rows: rows that are all zero beyond a block boundary add
    exact zeros, so dw of M rows equals dw of the same M rows followed by zero rows filling the block."""
    rows = ROWS_PER_DW + 3
    dy, _, x, _, w = _rms_case(rows, 40, torch.float32, 5, False, True, False)
    pad = ROWS_PER_DW - 3
    dy_p = torch.cat([dy, torch.zeros(pad, 40, device=DEV)])
    x_p = torch.cat([x, torch.ones(pad, 40, device=DEV)])
    assert torch.equal(rms_norm_backward(dy, None, x, None, w, 1e-6)[2],
                       rms_norm_backward(dy_p, None, x_p, None, w, 1e-6)[2])


def test_rms_norm_backward_empty_and_bad_input():
    x = torch.zeros(0, 8, device=DEV)
    w = torch.ones(8, device=DEV)
    dx, dres, dw = rms_norm_backward(x, None, x, None, w, 1e-6)
    assert dx.shape == (0, 8) and dres is None and torch.equal(dw, torch.zeros(8, device=DEV))
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_backward(torch.zeros(2, 8, device=DEV), None, torch.zeros(2, 8, device=DEV), None,
                          torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="dh_out must have x's shape"):
        rms_norm_backward(torch.zeros(2, 8, device=DEV), torch.zeros(2, 7, device=DEV),
                          torch.zeros(2, 8, device=DEV), None, None, 1e-6)
    with pytest.raises(ValueError, match="exceeds the kernel's maximum"):
        big = torch.zeros(1, MAX_D + 1, device=DEV)
        rms_norm_backward(big, None, big, None, None, 1e-6)


# ---- embedding ----------------------------------------------------------------------------------------


def _sequential_rows_sum(dh, ids, v):
    """The documented order: each id's rows added one after another in token order, in fp32."""
    out = torch.zeros(v, dh.shape[-1], dtype=torch.float32)
    for t, i in enumerate(ids.tolist()):
        out[i] = out[i] + dh[t].float().cpu()
    return out


def _check_embedding(ids, v, d, dtype, seed):
    ids_t = torch.tensor(ids, dtype=torch.int64, device=DEV)
    dh = _randn(len(ids), d, seed=seed, dtype=dtype)
    dw = embedding_backward(dh, ids_t, v)
    assert dw.dtype == torch.float32 and dw.shape == (v, d)
    assert torch.equal(dw.cpu(), _sequential_rows_sum(dh, ids_t, v))
    assert torch.equal(dw, embedding_backward(dh, ids_t, v))
    want = torch.zeros(v, d, dtype=F64).index_add_(0, ids_t.cpu(), dh.double().cpu())
    abs_sum = torch.zeros(v, d, dtype=F64).index_add_(0, ids_t.cpu(), dh.double().abs().cpu())
    most = max([ids.count(i) for i in set(ids)], default=0)
    assert bool(((dw.double().cpu() - want).abs() <= most * _eps(torch.float32) * abs_sum).all())
    for i in set(range(v)) - set(ids):
        assert not dw[i].any() and not torch.signbit(dw[i]).any()  # exact +0.0 rows


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=0, max_size=40), st.sampled_from([1, 5, 33, 1100]),
       st.integers(0, 2**16))
def test_embedding_backward_fp32_sequential_order_deterministic_accurate(ids, d, seed):
    _check_embedding(ids, 7, d, torch.float32, seed)


@pytest.mark.gpu
@settings(deadline=None)
@given(st.lists(st.integers(0, 50), min_size=0, max_size=400), st.sampled_from([1, 5, 1100, 4096]),
       st.sampled_from(GPU_DTYPES), st.integers(0, 2**16))
def test_gpu_embedding_backward_sequential_order_deterministic_accurate(ids, d, dtype, seed):
    _check_embedding(ids, 51, d, dtype, seed)


def test_embedding_backward_rejects_bad_input():
    dh = torch.zeros(3, 4, device=DEV)
    with pytest.raises(ValueError, match="one id per row"):
        embedding_backward(dh, torch.zeros(2, dtype=torch.int64, device=DEV), 5)
    with pytest.raises(ValueError, match="integer tensor"):
        embedding_backward(dh, torch.zeros(3, device=DEV), 5)
    for bad in ([0, 5, 1], [-1, 0, 1]):
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\)"):
            embedding_backward(dh, torch.tensor(bad, device=DEV), 5)
    with pytest.raises(ValueError, match="num_embeddings must be an int"):
        embedding_backward(dh, torch.zeros(3, dtype=torch.int64, device=DEV), -1)


def test_leading_dims_and_broadcast_gradients_as_autograd_passes_them():
    """[B, S, D] inputs give the [B*S, D] results reshaped; a stride-0 gradient (what autograd passes for
    out.sum()) gives the bits of the materialised one; 2-D ids with [B, S, D] dh work."""
    x, dyc = _randn(2, 3, 40, seed=1), torch.ones(2, 3, 40, device=DEV)
    dy0 = torch.ones((), device=DEV).expand(2, 3, 40)
    w = 1 + 0.1 * _randn(40, seed=2)
    got = rms_norm_backward(dy0, None, x, x, w, 1e-6)
    flat = rms_norm_backward(dyc.view(6, 40), None, x.view(6, 40), x.view(6, 40), w, 1e-6)
    assert got[0].shape == (2, 3, 40) and torch.equal(got[0].view(6, 40), flat[0]) and torch.equal(got[2], flat[2])
    g, u = _randn(2, 3, 40, seed=3), _randn(2, 3, 40, seed=4)
    assert all(torch.equal(a.view(6, 40), b) for a, b in zip(silu_mul_backward(dy0, g, u),
                                                            silu_mul_backward(dyc.view(6, 40), g.view(6, 40),
                                                                              u.view(6, 40))))
    ids = torch.tensor([[1, 0, 1], [4, 1, 0]], device=DEV)
    assert torch.equal(embedding_backward(dy0, ids, 5), embedding_backward(dyc.view(6, 40), ids.view(6), 5))


# ---- the training Functions' dispatch -----------------------------------------------------------------


def test_functions_take_the_references_off_the_gpu():
    """CPU (and fp64): the pure-torch references, bit for bit."""
    g, u, d = (_randn(5, 9, seed=s).cpu() for s in range(3))
    assert all(torch.equal(a, b) for a, b in zip(functions._silu_mul_backward(d, g, u),
                                                 silu_mul_backward_ref(d, g, u)))
    w = torch.ones(9)
    got, want = functions._rms_norm_backward(d, None, g, u, w, 1e-6), rms_norm_backward_ref(d, None, g, u, w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ids = torch.tensor([3, 1, 3, 0, 2])
    assert torch.equal(functions._embedding_backward(d, ids, 4), embedding_backward_ref(d, ids, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_functions_take_the_triton_kernels(dtype):
    g, u, d = (_randn(5, 96, seed=s, dtype=dtype) for s in range(3))
    assert all(torch.equal(a, b) for a, b in zip(functions._silu_mul_backward(d, g, u),
                                                 silu_mul_backward(d, g, u)))
    w = torch.ones(96, device=DEV, dtype=dtype)
    got, want = functions._rms_norm_backward(d, d, g, u, w, 1e-6), rms_norm_backward(d, d, g, u, w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ids = torch.tensor([3, 1, 3, 0, 2], device=DEV)
    assert torch.equal(functions._embedding_backward(d, ids, 4), embedding_backward(d, ids, 4))


@pytest.mark.gpu
def test_gpu_functions_fp32_gradients_match_fp64_autograd():
    """The autograd Functions on CUDA (their backwards the Triton kernels) against fp64 stock autograd."""
    from detinfer.kernels.rmsnorm import rms_norm
    from detinfer.kernels.silu_mul import silu_mul

    def leaves(*ts):
        return [t.detach().requires_grad_() for t in ts], [t.detach().double().requires_grad_() for t in ts]

    def check(out, inputs, out64, inputs64):
        gout = [_randn(*o.shape, seed=9) for o in out]
        got = torch.autograd.grad(out, inputs, gout)
        want = torch.autograd.grad(out64, inputs64, [g.double() for g in gout])
        for a, b in zip(got, want):
            assert (a.double() - b).abs().max().item() <= 1e-4 * (b.abs().max().item() + 1)

    (x, nw, r), (x64, nw64, r64) = leaves(_randn(37, 300, seed=1), 1 + 0.1 * _randn(300, seed=2),
                                          _randn(37, 300, seed=3))
    y, h = functions.RMSNormFn.apply(x, nw, r, 1e-6, rms_norm)
    h64 = x64 + r64
    y64 = nw64 * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6)
    check((y, h), (x, nw, r), (y64, h64), (x64, nw64, r64))
    (g, u), (g64, u64) = leaves(_randn(37, 300, seed=4), _randn(37, 300, seed=5))
    check((functions.SiLUMulFn.apply(g, u, silu_mul),), (g, u), (torch.nn.functional.silu(g64) * u64,), (g64, u64))
    (w,), (w64,) = leaves(_randn(50, 300, seed=6))
    ids = torch.randint(0, 50, (200,), generator=torch.Generator().manual_seed(7)).to(DEV)
    check((functions.EmbeddingFn.apply(ids, w),), (w,), (torch.nn.functional.embedding(ids, w64),), (w64,))
