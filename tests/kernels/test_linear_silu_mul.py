"""linear_silu_mul (gate_up projection + SiLU*mul in one launch): bitwise equal to `linear` then `silu_mul`
(the deterministic kernels), row slices bitwise, strided weights, the Ops dispatch, clear errors; on the GPU
bf16/fp16 at Qwen3-8B-like shapes for every config the dispatcher can pick."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import linear_silu_mul as lsm
from detinfer.kernels._launch import interpreting
from detinfer.kernels.matmul import linear
from detinfer.kernels.silu_mul import silu_mul
from detinfer.ops import Ops

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
# fp32 kernel tests: on the GPU where there is one, else in Triton's interpreter (TRITON_INTERPRET=1).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
kernel_runs = pytest.mark.skipif(DEV == "cpu" and not interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")


def operands(m, h, i, seed, bias, dtype=torch.float32, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g)
    w = torch.randn(2 * i, h, generator=g) * (2 / h) ** 0.5  # gate/up values of a few units: silu's whole range
    b = torch.randn(2 * i, generator=g) if bias else None
    return tuple(None if t is None else t.to(dtype).to(device) for t in (x, w, b))


def two_launches(x, w, b):
    gate, up = linear(x, w, b).split(w.shape[0] // 2, dim=-1)
    return silu_mul(gate, up)


@kernel_runs
@pytest.mark.parametrize("m,h,i,bias", [(1, 32, 64, False), (7, 45, 37, True), (33, 300, 5, False),
                                        (64, 100, 70, True)])
def test_fused_equals_linear_then_silu_mul(m, h, i, bias):
    x, w, b = operands(m, h, i, m + h + i, bias)
    out = lsm.linear_silu_mul(x, w, b)
    assert out.shape == (m, i) and out.dtype == x.dtype
    assert torch.equal(out, two_launches(x, w, b))
    if DEV == "cpu":  # the pure-torch reference is a different reduction: accurate, not bitwise
        torch.testing.assert_close(out, lsm.linear_silu_mul_ref(x, w, b), rtol=1e-5, atol=1e-5)


@kernel_runs
def test_strided_weight_and_leading_dims():
    x, w, b = operands(6, 64, 40, 3, True)
    wt = torch.empty(64, 80, device=DEV).t()  # [80, 64] with strides (1, 80): the weight read by strides
    wt.copy_(w)
    want = two_launches(x, w, b)
    assert torch.equal(lsm.linear_silu_mul(x, wt, b), want)
    assert torch.equal(lsm.linear_silu_mul(x.reshape(2, 3, 64), w, b), want.reshape(2, 3, 40))
    assert lsm.linear_silu_mul(x[:0], w, b).shape == (0, 40)


@pytest.mark.skipif(not interpreting(), reason="the interpreter's descriptor emulation (GPU: the sweep below)")
def test_tma_kernel_matches_pointer_kernel_in_the_interpreter(monkeypatch):
    """The descriptor kernel computes the same tiles in the same K order as the pointer kernel (fp16: the
    interpreter's 16-bit dot that is exact enough; rows of 208 B and both weight halves 16-byte aligned)."""
    x, w, b = operands(23, 104, 40, 4, True, torch.float16, "cpu")
    want = lsm.linear_silu_mul(x, w, b, config=lsm.MatmulConfig(1, 64, 32, 4, 1))
    assert torch.equal(want, two_launches(x, w, b))
    calls, kernel = [], lsm._linear_silu_mul_tma_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(lsm, "_linear_silu_mul_tma_kernel", Spy())
    tma = lsm.MatmulConfig(1, 64, 32, 4, 1, tma=True)
    assert torch.equal(lsm.linear_silu_mul(x, w, b, config=tma), want)
    assert torch.equal(lsm.linear_silu_mul(x[5:6], w, b, config=tma), want[5:6])
    assert len(calls) == 2
    w_odd = torch.zeros(80, 105, dtype=torch.float16)[:, 1:].copy_(w)  # misaligned rows: pointer loads
    assert torch.equal(lsm.linear_silu_mul(x, w_odd, b, config=tma), want) and len(calls) == 2


@kernel_runs
@settings(max_examples=6, deadline=None)
@given(st.integers(1, 12), st.integers(16, 90), st.integers(1, 40), st.booleans(), st.integers(0, 2**16),
       st.data())
def test_row_slices_are_bitwise(m, h, i, bias, seed, data):
    x, w, b = operands(m, h, i, seed, bias)
    out = lsm.linear_silu_mul(x, w, b)
    lo = data.draw(st.integers(0, m - 1))
    hi = data.draw(st.integers(lo + 1, m))
    assert torch.equal(lsm.linear_silu_mul(x[lo:hi], w, b), out[lo:hi])


@pytest.mark.skipif(not interpreting(), reason="Ops(cpu_triton=True) needs TRITON_INTERPRET=1")
def test_ops_dispatch(monkeypatch):
    x, w, b = operands(3, 32, 16, 7, True, torch.float16, "cpu")
    ops = Ops(cpu_triton=True, dtype=torch.float16)
    fused = ops.linear_silu_mul(x, w, b)  # fp16 in the interpreter: the fused kernel
    gate, up = ops.linear(x, w, b).split(16, dim=-1)
    assert torch.equal(fused, ops.silu_mul(gate, up))
    for other in (Ops(), Ops(mode="fast")):  # CPU: linear then silu_mul, exactly the two calls
        xf, wf, bf = x.float(), w.float(), b.float()
        gate, up = other.linear(xf, wf, bf).split(16, dim=-1)
        assert torch.equal(other.linear_silu_mul(xf, wf, bf), other.silu_mul(gate, up))
    def no_fused(*args):
        raise AssertionError("the fused kernel ran")

    monkeypatch.setattr(lsm, "linear_silu_mul", no_fused)
    assert torch.equal(ops.linear_silu_mul(x, w.clone().requires_grad_(), b), fused)  # autograd: two calls
    assert torch.equal(ops.linear_silu_mul(x[:1].expand(65, 32), w, b)[0], fused[0])  # > 64 rows: two calls


@kernel_runs
def test_bad_inputs_raise_clear_errors():
    x, w, _ = operands(2, 32, 8, 1, False)
    with pytest.raises(ValueError, match="odd row count"):
        lsm.linear_silu_mul(x, w[:-1])
    with pytest.raises(ValueError, match="K=32"):
        lsm.linear_silu_mul(x[:, :30], w)
    with pytest.raises(ValueError, match="bias must have shape"):
        lsm.linear_silu_mul(x, w, torch.zeros(3))
    with pytest.raises(TypeError, match="dtype"):
        lsm.linear_silu_mul(x, w.double())
    with pytest.raises(ValueError, match="gate_up weight"):
        lsm.linear_silu_mul_ref(x, w[:-1])


def test_configs_halve_the_plain_tiles():
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        cfgs = lsm.gpu_configs(dt)
        assert cfgs and all(c.block_n >= 16 and not c.persistent for c in cfgs)
        assert all(c.tma is False or lsm.replace(c, tma=False) in cfgs for c in cfgs)  # pointer twins swept too


# ------------------------------------------------------------------------------------------ GPU (bitwise)
QWEN3_8B = (4096, 12288)  # hidden, intermediate


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,i,bias", [(*QWEN3_8B, False), (896, 4864, True), (300, 200, True)])
def test_gpu_fused_equals_two_launches_for_every_m_and_config(dtype, h, i, bias):
    x, w, b = operands(64, h, i, 11, bias, dtype, "cuda")
    for m in (1, 2, 3, 7, 16, 17, 33, 64):
        want = two_launches(x[:m], w, b)  # the deterministic kernels, each with its own dispatched config
        assert torch.equal(lsm.linear_silu_mul(x[:m], w, b), want), (m, "dispatched")
        for cfg in lsm.gpu_configs(dtype):
            assert torch.equal(lsm.linear_silu_mul(x[:m], w, b, config=cfg), want), (m, cfg)
        ops = Ops("deterministic", "cuda", dtype)
        assert torch.equal(ops.linear_silu_mul(x[:m], w, b), want)
    # above the fused rows the backend keeps two launches; the kernel itself still gives the same bits
    xl, _, _ = operands(200, h, i, 12, bias, dtype, "cuda")
    assert torch.equal(lsm.linear_silu_mul(xl, w, b), two_launches(xl, w, b))


@pytest.mark.gpu
def test_gpu_fast_mode_is_unchanged():
    x, w, _ = operands(4, 256, 128, 5, False, torch.bfloat16, "cuda")
    ops = Ops("fast", "cuda", torch.bfloat16)
    gate, up = torch.nn.functional.linear(x, w).split(128, dim=-1)
    assert torch.equal(ops.linear_silu_mul(x, w), silu_mul(gate, up))


def test_mlp_keeps_gate_up_visible_to_forward_hooks():
    """MLP.forward calls the one fused op, except while a forward hook watches gate_up_proj (the repro
    audit records every module's output): then the module runs, with the same bits."""
    from types import SimpleNamespace

    from detinfer.models.transformer import MLP

    mlp = MLP(SimpleNamespace(hidden_size=32, intermediate_size=24, mlp_bias=True, quantization=None))
    x, w, b = operands(5, 32, 24, 9, True, device="cpu")
    mlp.gate_up_proj.weight.data, mlp.gate_up_proj.bias.data = w, b
    mlp.down_proj.weight.data.normal_(), mlp.down_proj.bias.data.normal_()
    ops = Ops()
    plain = mlp(x, ops)
    seen = []
    handle = mlp.gate_up_proj.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        assert torch.equal(mlp(x, ops), plain)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == (5, 48)
