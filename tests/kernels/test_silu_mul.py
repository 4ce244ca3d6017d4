"""silu_mul (SwiGLU's elementwise part): accuracy vs float64, row slices bitwise, strided halves of a fused
gate_up output, the Ops dispatch, and on the GPU bf16 + batch invariance."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels._launch import interpreting
from detinfer.kernels.activations import silu_cpu
from detinfer.kernels.silu_mul import silu_mul, silu_mul_ref
from detinfer.ops import Ops

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
# fp32 kernel tests: on the GPU where there is one, else in Triton's interpreter (TRITON_INTERPRET=1).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
interpreter_only = pytest.mark.skipif(not interpreting(), reason="Ops(cpu_triton=True) needs TRITON_INTERPRET=1")


def gate_up_halves(t, n, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(t, 2 * n, generator=g) * 4).to(dtype).to(device)
    return gu.split(n, dim=-1)  # strided views, as the MLP passes them


def assert_accurate(out, gate, up, rtol):
    want = silu_mul_ref(gate.double(), up.double())
    err = (out.double() - want).abs()
    assert bool((err <= 1e-6 + rtol * want.abs()).all()), f"worst error {err.max():.3g}"


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 12), st.sampled_from([1, 7, 64, 1000, 1500]), st.integers(0, 2**16), st.data())
def test_kernel_matches_reference_and_row_slices(t, n, seed, data):
    gate, up = gate_up_halves(t, n, seed, device=DEV)
    out = silu_mul(gate, up)
    assert out.shape == (t, n) and out.is_contiguous()
    assert_accurate(out, gate, up, 1e-5)
    m = data.draw(st.integers(0, t - 1))
    k = data.draw(st.integers(m + 1, t))
    assert torch.equal(silu_mul(gate[m:k], up[m:k]), out[m:k])
    assert torch.equal(silu_mul(gate.contiguous(), up.contiguous()), out)  # strides never change a bit


def test_leading_dims_and_empty():
    gate, up = gate_up_halves(6, 10, 1, device=DEV)
    out = silu_mul(gate.reshape(2, 3, 10), up.reshape(2, 3, 10))
    assert torch.equal(out.reshape(6, 10), silu_mul(gate, up))
    assert silu_mul(gate[:0], up[:0]).shape == (0, 10)


@interpreter_only
def test_ops_dispatch():
    gate, up = gate_up_halves(4, 9, 2)
    assert torch.equal(Ops().silu_mul(gate, up), silu_cpu(gate) * up)  # the CPU definition, unchanged
    assert torch.equal(Ops(cpu_triton=True).silu_mul(gate, up), silu_mul(gate, up))
    g = gate.clone().requires_grad_()
    out = Ops(cpu_triton=True).silu_mul(g, up)  # under autograd: the differentiable torch spelling
    assert out.requires_grad


def test_bad_input_is_a_clear_error():
    gate, up = gate_up_halves(2, 4, 3, device=DEV)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(gate, up[:, :3])
    with pytest.raises(TypeError, match="dtype"):
        silu_mul(gate, up.double())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [12288, 3072, 777])
def test_gpu_bf16_accuracy_and_batch_invariance(n):
    gate, up = gate_up_halves(257, n, 5, torch.bfloat16, "cuda")
    out = silu_mul(gate, up)
    assert_accurate(out, gate, up, 1.6e-2)
    for m, k in ((0, 1), (3, 4), (10, 74), (0, 257)):
        assert torch.equal(silu_mul(gate[m:k], up[m:k]), out[m:k])
    assert torch.equal(Ops("deterministic", "cuda", torch.bfloat16).silu_mul(gate, up), out)
    assert torch.equal(Ops("fast", "cuda", torch.bfloat16).silu_mul(gate, up), out)
