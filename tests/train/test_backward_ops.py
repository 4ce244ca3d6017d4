"""Gradient checks for every op of the deterministic training forward, and fixed-order properties.

* fp64: torch.autograd.gradcheck of each autograd.Function (forward = the pure-torch op, backward = ours)
  against finite differences.
* fp32: each Function's gradients against float64 autograd of a plain-torch forward (tolerance for fp32).
* Bitwise: two backward passes are equal; a sequence's attention gradients do not depend on the other
  sequences packed with it; a token's dX does not depend on the other tokens (`f(x)[m:n] == f(x[m:n])`).
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.kernels.activations import silu_cpu
from detinfer.kernels.attention_backward import (
    TileConfig,
    attention_backward,
    attention_backward_ref,
    attention_forward_ref,
)
from detinfer.kernels.embedding_backward import embedding_backward_ref
from detinfer.kernels.linear_backward import linear_backward_ref, weight_grad, weight_grad_ref
from detinfer.kernels.matmul import linear_ref
from detinfer.kernels.rmsnorm import rms_norm_ref
from detinfer.kernels.softmax import log_softmax_ref
from detinfer.models.config import ModelConfig
from detinfer.models.rope import RotaryEmbedding
from detinfer.models.testing import tiny_config_dict
from detinfer.train.functions import (
    AttentionFn,
    EmbeddingFn,
    LinearFn,
    LogprobFn,
    RMSNormFn,
    RotaryFn,
    SiLUMulFn,
)

F64 = torch.float64


def _rand(*shape, dtype=F64, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)


def _silu_mul(g, u):
    return silu_cpu(g) * u


def _rotary(head_dim=8):
    cfg = ModelConfig.from_dict(tiny_config_dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=head_dim))
    return RotaryEmbedding(cfg)


def _naive_attention(q, k, v, cu, scale):
    """Plain masked attention per sequence (stock autograd): the float64 reference."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1], cu[1:]):
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].repeat_interleave(group, 1).transpose(0, 1)
        vs = v[a:b].repeat_interleave(group, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        mask = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        outs.append((s.masked_fill(~mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs)


# ---------------------------------------------------------------- fp64 gradcheck of every Function
def test_gradcheck_linear_rmsnorm_silu():
    x, w, b = _rand(5, 6, seed=1), _rand(4, 6, seed=2), _rand(4, seed=3)
    assert torch.autograd.gradcheck(lambda x, w, b: LinearFn.apply(x, w, b, linear_ref), (x, w, b))
    r, nw = _rand(3, 2, 6, seed=4), _rand(6, seed=5)
    x3 = _rand(3, 2, 6, seed=6)

    def norm_res(x, nw, r):
        y, h = RMSNormFn.apply(x, nw, r, 1e-6, rms_norm_ref)
        return y, h * 0.5  # both outputs carry gradient
    assert torch.autograd.gradcheck(norm_res, (x3, nw, r))
    assert torch.autograd.gradcheck(lambda x, nw: RMSNormFn.apply(x, nw, None, 1e-6, rms_norm_ref), (x3, nw))
    g, u = _rand(4, 7, seed=7), _rand(4, 7, seed=8)
    assert torch.autograd.gradcheck(lambda g, u: SiLUMulFn.apply(g, u, _silu_mul), (g, u))


def test_gradcheck_embedding_logprob_attention():
    w = _rand(9, 5, seed=9)
    ids = torch.tensor([3, 1, 3, 3, 0, 8, 1])
    assert torch.autograd.gradcheck(lambda w: EmbeddingFn.apply(ids, w), (w,))
    z = _rand(4, 9, seed=10)
    t = torch.tensor([2, 0, 8, 2])
    assert torch.autograd.gradcheck(lambda z: LogprobFn.apply(z, t, log_softmax_ref), (z,))
    cu = [0, 3, 4, 8]
    q, k, v = _rand(8, 4, 4, seed=11), _rand(8, 2, 4, seed=12), _rand(8, 2, 4, seed=13)
    fwd = lambda q, k, v: attention_forward_ref(q, k, v, cu, 0.5)  # noqa: E731
    assert torch.autograd.gradcheck(lambda q, k, v: AttentionFn.apply(q, k, v, fwd, cu, 0.5), (q, k, v))


def test_rotary_backward_matches_fp64_autograd():
    """The model's rotary computes in fp32 whatever the input dtype (so no fp64 gradcheck): compare the
    fp32 Function against fp64 autograd of the same rotation."""
    rot = _rotary()
    pos = torch.tensor([0, 1, 2, 0, 5, 300])
    q, k = _rand(6, 2, 8, dtype=torch.float32, seed=14), _rand(6, 1, 8, dtype=torch.float32, seed=15)
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    angles = pos.double()[:, None] * rot.inv_freq.double()[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    oq, ok = RotaryFn.apply(q, k, pos, rot)
    assert torch.equal(oq, rot(pos, q.detach(), k.detach())[0])  # forward = the model's module
    _close(_grads(oq * 1.5 + 0, (q,)), _grads(rotate(q64) * 1.5, (q64,)))
    _close(_grads(ok, (k,)), _grads(rotate(k64), (k64,)))


# ---------------------------------------------------------------- fp32 Functions vs fp64 autograd
def _grads(out, inputs, seed=99):
    gout = _rand(*out.shape, seed=seed, requires_grad=False).to(out.dtype)
    return torch.autograd.grad(out, inputs, gout, retain_graph=True)


def _close(ours, ref, rtol=2e-5):
    for a, b in zip(ours, ref, strict=True):
        scale = b.abs().max().item() + 1e-30
        assert (a.double() - b).abs().max().item() <= rtol * scale * 10, ((a.double() - b).abs().max(), scale)


def test_fp32_functions_match_fp64_autograd():
    f32 = torch.float32
    x, w, b = (_rand(33, 40, dtype=f32, seed=1), _rand(24, 40, dtype=f32, seed=2), _rand(24, dtype=f32, seed=3))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    _close(_grads(LinearFn.apply(x, w, b, linear_ref), (x, w, b)),
           _grads(torch.nn.functional.linear(x64, w64, b64), (x64, w64, b64)))
    h, nw, r = _rand(10, 48, dtype=f32, seed=4), _rand(48, dtype=f32, seed=5), _rand(10, 48, dtype=f32, seed=6)
    h64, nw64, r64 = (t.detach().double().requires_grad_() for t in (h, nw, r))
    y, s = RMSNormFn.apply(h, nw, r, 1e-6, rms_norm_ref)
    s64 = h64 + r64
    y64 = nw64 * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6)
    _close(_grads(y + s * 0.3, (h, nw, r)), _grads(y64 + s64 * 0.3, (h64, nw64, r64)))
    cu = [0, 5, 6, 17]
    q, k, v = (_rand(17, 4, 16, dtype=f32, seed=7), _rand(17, 2, 16, dtype=f32, seed=8),
               _rand(17, 2, 16, dtype=f32, seed=9))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    fwd = lambda q, k, v: attention_forward_ref(q, k, v, cu, 0.25)  # noqa: E731
    _close(_grads(AttentionFn.apply(q, k, v, fwd, cu, 0.25), (q, k, v)),
           _grads(_naive_attention(q64, k64, v64, cu, 0.25), (q64, k64, v64)))
    z = _rand(6, 50, dtype=f32, seed=10)
    z64 = z.detach().double().requires_grad_()
    t = torch.tensor([1, 49, 0, 7, 7, 3])
    _close(_grads(LogprobFn.apply(z, t, log_softmax_ref), (z,)),
           _grads(torch.log_softmax(z64, -1).gather(1, t[:, None])[:, 0], (z64,)))


# ---------------------------------------------------------------- bitwise fixed-order properties
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.sampled_from([(2, 1), (4, 2), (2, 2)]),
       st.integers(0, 1000))
def test_attention_backward_per_sequence_independent_of_packing(lens, heads, seed):
    hq, hkv = heads
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    t = cu[-1]
    q, k, v, do = (_rand(t, h, 8, dtype=torch.float32, seed=seed + i, requires_grad=False)
                   for i, h in enumerate((hq, hkv, hkv, hq)))
    out = attention_forward_ref(q, k, v, cu, 0.3)
    dq, dk, dv = attention_backward_ref(do, q, k, v, out, cu, 0.3)
    for a, b in zip(cu[:-1], cu[1:]):  # each sequence alone gives the same bits
        alone = attention_backward_ref(do[a:b], q[a:b], k[a:b], v[a:b], out[a:b], [0, b - a], 0.3)
        for packed, single in zip((dq, dk, dv), alone):
            assert torch.equal(packed[a:b], single)


@given(st.integers(1, 40), st.integers(0, 39), st.integers(0, 40), st.integers(0, 1000))
def test_linear_dx_rows_independent_and_dw_deterministic(rows, m, n, seed):
    m, n = min(m, rows - 1), max(min(n, rows), min(m, rows - 1) + 1)
    dy, x, w = (_rand(*s, dtype=torch.float32, seed=seed + i, requires_grad=False)
                for i, s in enumerate(((rows, 12), (rows, 20), (12, 20))))
    dx, dw, db = linear_backward_ref(dy, x, w, True)
    assert torch.equal(dx[m:n], linear_backward_ref(dy[m:n], x[m:n], w, True)[0])
    dx2, dw2, db2 = linear_backward_ref(dy, x, w, True)
    assert torch.equal(dw, dw2) and torch.equal(db, db2) and dw.dtype == torch.float32


@given(st.lists(st.integers(0, 6), min_size=0, max_size=30), st.integers(0, 1000))
def test_embedding_backward_matches_fp64_and_is_order_fixed(ids, seed):
    ids_t = torch.tensor(ids, dtype=torch.int64)
    dh = _rand(len(ids), 5, dtype=torch.float32, seed=seed, requires_grad=False)
    dw = embedding_backward_ref(dh, ids_t, 7)
    ref = torch.zeros(7, 5, dtype=F64).index_add_(0, ids_t, dh.double())
    assert torch.allclose(dw.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(dw, embedding_backward_ref(dh, ids_t, 7))
    for v in set(range(7)) - set(ids):
        assert torch.equal(dw[v], torch.zeros(5))


@pytest.mark.parametrize("t,n,k", [(1, 5, 3), (70, 33, 65), (130, 64, 17), (40, 700, 200)])
def test_weight_grad_triton_matches_reference(t, n, k):
    """The Triton dW kernel (interpreter on CPU, fp32) against the fold-based reference and fp64."""
    dy, x = (_rand(t, n, dtype=torch.float32, seed=t, requires_grad=False),
             _rand(t, k, dtype=torch.float32, seed=n, requires_grad=False))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    got = weight_grad(dy.to(dev), x.to(dev)).cpu()
    ref64 = dy.double().t() @ x.double()
    tol = 1e-5 * math.sqrt(t) * ref64.abs().max().item()
    assert (got.double() - ref64).abs().max().item() <= tol
    assert (weight_grad_ref(dy, x).double() - ref64).abs().max().item() <= tol
    assert torch.equal(got, weight_grad(dy.to(dev), x.to(dev)).cpu())


@pytest.mark.parametrize("t,n,k,cut", [(1, 8, 4, 0), (70, 36, 68, 64), (200, 40, 300, 128)])
def test_weight_grad_descriptor_kernel_matches_fp64_and_continues_chunks(t, n, k, cut):
    """The TMA-descriptor dW kernel (forced; fp32 under the interpreter on CPU): fp64 accuracy, two calls
    bitwise, and a call continued over a token chunk (`out=`) gives the one-call bits."""
    dy, x = (_rand(t, n, dtype=torch.float32, seed=t + 1, requires_grad=False),
             _rand(t, k, dtype=torch.float32, seed=n + 1, requires_grad=False))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dy, x = dy.to(dev), x.to(dev)
    got = weight_grad(dy, x, tma=True)
    ref64 = dy.double().t() @ x.double()
    assert (got.double() - ref64).abs().max().item() <= 1e-5 * math.sqrt(t) * ref64.abs().max().item()
    assert torch.equal(got, weight_grad(dy, x, tma=True))
    if cut:
        part = weight_grad(dy[:cut], x[:cut], tma=True)
        assert torch.equal(weight_grad(dy[cut:], x[cut:], out=part, tma=True), got)
    with pytest.raises(ValueError, match="16-byte aligned"):
        weight_grad(dy[:, 1:], x[:, 1:], tma=True)  # rows no longer 16-byte aligned


_UNEVEN_TILES = (TileConfig(32, 16, 4, 2), TileConfig(16, 32, 4, 2))  # other query/key steps per kernel


@pytest.mark.parametrize("configs", [None, _UNEVEN_TILES])
@pytest.mark.parametrize("lens,hq,hkv,d", [([5, 1, 34], 4, 2, 16), ([33, 67], 2, 1, 64), ([1], 2, 2, 32)])
def test_attention_backward_triton_matches_fp64_and_is_packing_independent(lens, hq, hkv, d, configs):
    """The Triton backward (interpreter on CPU, fp32) against fp64, bitwise per sequence across packings;
    with the dtype's tile configs and with query and key tiles of different heights in each kernel."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    t = cu[-1]
    q, k, v, do = (_rand(t, h, d, dtype=torch.float32, seed=i + d, requires_grad=False).to(dev)
                   for i, h in enumerate((hq, hkv, hkv, hq)))
    out = attention_forward_ref(q, k, v, cu, 0.3)
    got = attention_backward(do, q, k, v, out, cu, 0.3, configs=configs)
    ref = attention_backward_ref(*(x.double() for x in (do, q, k, v, out)), cu, 0.3)
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() <= 2e-5 * (b.abs().max().item() + 1)
    again = attention_backward(do, q, k, v, out, cu, 0.3, configs=configs)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    s0, s1 = cu[-2], cu[-1]  # the last sequence alone, at offset 0
    alone = attention_backward(do[s0:s1], q[s0:s1], k[s0:s1], v[s0:s1], out[s0:s1], [0, s1 - s0], 0.3,
                               configs=configs)
    assert all(torch.equal(a[s0:s1], b) for a, b in zip(got, alone))
