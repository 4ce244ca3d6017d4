"""silu_mul (fast mode's fused SwiGLU activation): accuracy vs float64, row/slice independence (bitwise),
strided gate/up views, the reference, and errors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from detinfer.kernels.silu_mul import BLOCK_COLS, silu_mul, silu_mul_ref

# The interpreter computes masked lanes too; numpy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# bf16 only on GPU: Triton's interpreter mishandles bf16 arithmetic/stores.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# One rounding to the output dtype plus fp32 exp/division error.
RTOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def gate_up(rows, cols, dtype, seed, scale=8.0):
    """gate, up: the two halves of one [rows, 2 * cols] tensor, as the MLP's fused gate_up output gives them."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    both = ((torch.rand(rows, 2 * cols, generator=g, dtype=torch.float64, device=DEVICE) * 2 - 1) * scale)
    return both.to(dtype).split(cols, dim=-1)


def reference_fp64(gate, up):
    g, u = gate.double(), up.double()
    return g / (1 + torch.exp(-g)) * u


def assert_accurate(out, gate, up):
    want = reference_fp64(gate, up)
    # relative to each element's magnitude, with an absolute floor of one ulp-ish of the row scale
    tol = RTOL[out.dtype] * (want.abs() + 1e-3 * want.abs().amax().clamp(min=1e-30))
    assert ((out.double() - want).abs() <= tol).all()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@given(rows=st.integers(1, 9), cols=st.sampled_from([1, 5, 64, 200]) | st.integers(1, 130),
       seed=st.integers(0, 2**16))
def test_accuracy_and_row_independence(dtype, rows, cols, seed):
    gate, up = gate_up(rows, cols, dtype, seed)
    out = silu_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
    assert_accurate(out, gate, up)
    m = rows // 2
    assert torch.equal(silu_mul(gate[m:], up[m:]), out[m:])  # f(x)[m:] == f(x[m:]): elementwise


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_matches_its_reference_and_more_than_one_column_block(dtype):
    gate, up = gate_up(3, BLOCK_COLS + 37, dtype, 1)
    out = silu_mul(gate, up)
    assert_accurate(out, gate, up)
    if dtype == torch.float32:  # same formula in fp32: within a few ulps (the GPU's exp is approximate)
        torch.testing.assert_close(out, silu_mul_ref(gate, up), rtol=2e-6, atol=1e-30)


def test_leading_dims_contiguous_inputs_and_empty():
    gate, up = gate_up(6, 24, torch.float32, 2)
    g3, u3 = gate.contiguous().view(2, 3, 24), up.contiguous().view(2, 3, 24)
    assert torch.equal(silu_mul(g3, u3).view(6, 24), silu_mul(gate, up))
    empty = torch.zeros(0, 24, device=DEVICE)
    assert silu_mul(empty, empty).shape == (0, 24)


def test_reference_is_fp64_for_fp64_and_close_to_stock():
    gate, up = gate_up(4, 33, torch.float64, 3)
    assert silu_mul_ref(gate, up).dtype == torch.float64
    torch.testing.assert_close(silu_mul_ref(gate, up), F.silu(gate) * up, rtol=1e-12, atol=1e-12)


def test_bad_inputs_are_refused():
    x = torch.ones(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(x, torch.ones(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(x, x.half())
    with pytest.raises(TypeError, match="float tensor"):
        silu_mul(x.int(), x.int())
    with pytest.raises(TypeError, match="torch.Tensor"):
        silu_mul(x, 1.0)
    with pytest.raises(ValueError, match="0-dim"):
        silu_mul(torch.tensor(1.0, device=DEVICE), torch.tensor(1.0, device=DEVICE))
    with pytest.raises(TypeError, match="not supported"):
        silu_mul(x.double(), x.double())


def test_cpu_tensor_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        silu_mul(torch.ones(2, 3), torch.ones(2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_gpu_model_shapes(dtype):
    """Qwen3-8B's intermediate size, decode to prefill row counts: accurate, and a row's bits do not
    depend on the rows around it."""
    gate, up = gate_up(4096, 12288, dtype, 4)
    out = silu_mul(gate, up)
    assert_accurate(out, gate, up)
    for b in (1, 3, 64, 1000):
        assert torch.equal(silu_mul(gate[:b], up[:b]), out[:b])
