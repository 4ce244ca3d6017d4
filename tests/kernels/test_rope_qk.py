"""qk_norm_rope (fused per-head q/k RMSNorm + RoPE): accuracy vs float64, row slices bitwise, strided views
into a fused QKV output, the Ops dispatch (CPU definition unchanged), and on the GPU bf16 + batch invariance."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels._launch import interpreting
from detinfer.kernels.rope import apply_rope
from detinfer.kernels.rope_qk import qk_norm_rope, qk_norm_rope_ref
from detinfer.ops import Ops

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
# fp32 kernel tests: on the GPU where there is one, else in Triton's interpreter (TRITON_INTERPRET=1).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
interpreter_only = pytest.mark.skipif(not interpreting(), reason="Ops(cpu_triton=True) needs TRITON_INTERPRET=1")


def inv_freq_for(d: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))


def make_case(t, hq, hkv, d, norm, seed, dtype=torch.float32, device="cpu", max_pos=4096):
    """q/k as views into one [T, (Hq + 2 Hkv) D] projection output (the model's layout)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype).to(device)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, max_pos, (t,), generator=g).to(device)
    w = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device) for _ in range(2)] if norm else [None, None]
    return pos, q, k, inv_freq_for(d).to(device), w[0], w[1]


def assert_accurate(got, pos, q, k, inv, wq, wk, eps, rtol):
    want = qk_norm_rope_ref(pos, q.double(), k.double(), inv, *(None if w is None else w.double() for w in (wq, wk)),
                            eps)
    for a, b in zip(got, want):
        err = (a.double() - b).abs()
        # two roundings of the norm plus the rotation's: relative to the head's scale
        assert bool((err <= rtol * (1 + b.abs())).all()), f"worst error {err.max():.3g}"


CASES = st.tuples(st.integers(1, 9), st.sampled_from([(4, 2), (2, 2), (3, 1)]), st.sampled_from([8, 16, 64]),
                  st.booleans(), st.integers(0, 2**16))


@settings(max_examples=15, deadline=None)
@given(CASES, st.data())
def test_kernel_matches_reference_and_row_slices(case, data):
    t, (hq, hkv), d, norm, seed = case
    pos, q, k, inv, wq, wk = make_case(t, hq, hkv, d, norm, seed, device=DEV)
    got = qk_norm_rope(pos, q, k, inv, wq, wk, 1e-6)
    assert got[0].shape == (t, hq, d) and got[1].shape == (t, hkv, d) and got[0].is_contiguous()
    assert_accurate(got, pos, q, k, inv, wq, wk, 1e-6, 2e-5)
    m = data.draw(st.integers(0, t - 1))
    n = data.draw(st.integers(m + 1, t))
    part = qk_norm_rope(pos[m:n], q[m:n], k[m:n], inv, wq, wk, 1e-6)
    assert torch.equal(part[0], got[0][m:n]) and torch.equal(part[1], got[1][m:n])


def test_contiguous_and_strided_inputs_give_the_same_bits():
    pos, q, k, inv, wq, wk = make_case(5, 4, 2, 16, True, 3, device=DEV)
    strided = qk_norm_rope(pos, q, k, inv, wq, wk, 1e-5)
    packed = qk_norm_rope(pos, q.contiguous(), k.contiguous(), inv, wq, wk, 1e-5)
    assert not q.is_contiguous()
    assert torch.equal(strided[0], packed[0]) and torch.equal(strided[1], packed[1])


def test_ops_dispatch_cpu_definition_unchanged():
    """On CPU (no interpreter switch) Ops composes rms_norm per head and rope exactly as the model did."""
    pos, q, k, inv, wq, wk = make_case(6, 4, 2, 16, True, 5)
    ops = Ops()
    got = ops.qk_norm_rope(pos, q, k, inv, wq, wk, 1e-6)
    want = ops.rope(pos, ops.rms_norm(q, wq, 1e-6), ops.rms_norm(k, wk, 1e-6), inv)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    plain = ops.qk_norm_rope(pos, q, k, inv)
    want = apply_rope(pos, q, k, inv)
    assert torch.equal(plain[0], want[0]) and torch.equal(plain[1], want[1])


@interpreter_only
def test_ops_runs_the_kernel_under_the_interpreter_switch():
    pos, q, k, inv, wq, wk = make_case(3, 2, 2, 8, True, 7)
    got = Ops(cpu_triton=True).qk_norm_rope(pos, q, k, inv, wq, wk, 1e-6)
    want = qk_norm_rope(pos, q, k, inv, wq, wk, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("bad, match", [
    (dict(inv_freq=torch.ones(3)), "inv_freq"),
    (dict(positions=torch.zeros(2, dtype=torch.int64)), "positions"),
    (dict(k_weight=None), "both"),
    (dict(eps=-1.0), "eps"),
])
def test_bad_input_is_a_clear_error(bad, match):
    pos, q, k, inv, wq, wk = make_case(3, 2, 2, 8, True, 1, device=DEV)
    args = dict(positions=pos, q=q, k=k, inv_freq=inv, q_weight=wq, k_weight=wk, eps=1e-6) | bad
    with pytest.raises((ValueError, TypeError), match=match):
        qk_norm_rope(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (16, 8, 64), (8, 1, 256)])
def test_gpu_bf16_accuracy_and_batch_invariance(norm, hq, hkv, d):
    pos, q, k, inv, wq, wk = make_case(300, hq, hkv, d, norm, 11, torch.bfloat16, "cuda", max_pos=40000)
    full = qk_norm_rope(pos, q, k, inv, wq, wk, 1e-6)
    assert_accurate(full, pos, q, k, inv, wq, wk, 1e-6, 2e-2)
    for m, n in ((0, 1), (7, 8), (5, 69), (0, 300)):
        part = qk_norm_rope(pos[m:n], q[m:n], k[m:n], inv, wq, wk, 1e-6)
        assert torch.equal(part[0], full[0][m:n]) and torch.equal(part[1], full[1][m:n])
    ops = Ops("deterministic", "cuda", torch.bfloat16, head_dim=d)
    via_ops = ops.qk_norm_rope(pos, q, k, inv, wq, wk, 1e-6)
    assert torch.equal(via_ops[0], full[0]) and torch.equal(via_ops[1], full[1])
