"""linear_fp8_silu_mul (the FP8 gate_up projection + SiLU*mul in one launch): its reference is silu_mul of
linear_fp8_ref's halves and accurate against float64; deterministic mode's CPU path is exactly the two ops it
replaces (bitwise, bf16 included); errors are named. The kernel (GPU; on CPU in Triton's interpreter, fp32):
close to the reference, bitwise equal to `linear_fp8` then `silu_mul`, and batch-invariant bitwise
(`f(x)[a:b] == f(x[a:b])`)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels._launch import interpreting
from detinfer.kernels.fp8_linear import linear_fp8_ref, linear_fp8_stock
from detinfer.kernels.fp8_linear_silu_mul import linear_fp8_silu_mul, linear_fp8_silu_mul_ref
from detinfer.kernels.fp8_quant import BLOCK, dequantize_weight, quantize_activations, quantize_weight_rows
from detinfer.kernels.silu_mul import silu_mul_ref
from detinfer.ops import Ops

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
# the kernel on CPU: Triton's interpreter, fp32 activations only (its bf16 math is wrong)
interpreter = pytest.mark.skipif(not interpreting(), reason="the kernel on CPU needs TRITON_INTERPRET=1")


def _operands(m, i, k, seed, bias=False, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = torch.randn(2 * i, k, generator=g) / math.sqrt(k)  # gate/up of a few units: silu's whole range
    q, s = quantize_weight_rows(w)
    b = (torch.randn(2 * i, generator=g) * 0.5).to(dtype) if bias else None
    return x, q, s, b


def _split_silu_mul(y, i):
    gate, up = y.split(i, dim=-1)
    return silu_mul_ref(gate, up)


# -- the reference and the CPU dispatch ------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), i=st.integers(1, 150), k=st.integers(1, 400), bias=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2 ** 16))
def test_ref_is_silu_mul_of_the_fp8_linear_ref(m, i, k, bias, dtype, seed):
    x, q, s, b = _operands(m, i, k, seed, bias, dtype)
    out = linear_fp8_silu_mul_ref(x, q, s, b)
    assert out.shape == (m, i) and out.dtype == dtype
    assert torch.equal(out, _split_silu_mul(linear_fp8_ref(x, q, s, b), i))


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), i=st.integers(1, 150), k=st.integers(1, 400), bias=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2 ** 16))
def test_deterministic_cpu_path_is_the_two_ops_bitwise(m, i, k, bias, dtype, seed):
    """What the dense FP8 MLP ran before the fused op existed: `linear_fp8` then `silu_mul`, same bits."""
    x, q, s, b = _operands(m, i, k, seed, bias, dtype)
    for ops in (Ops("deterministic", "cpu", dtype), Ops("fast", "cpu", dtype)):
        gate, up = ops.linear_fp8(x, q, s, b).split(i, dim=-1)
        assert torch.equal(ops.linear_fp8_silu_mul(x, q, s, b), ops.silu_mul(gate, up)), ops.mode
    fast = Ops("fast", "cpu", dtype).linear_fp8_silu_mul(x, q, s, b)
    assert torch.equal(fast, Ops("fast", "cpu", dtype).silu_mul(*linear_fp8_stock(x, q, s, b).split(i, dim=-1)))


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 20), i=st.integers(1, 100), k=st.integers(1, 300), a=st.integers(0, 20),
       b=st.integers(0, 20), seed=st.integers(0, 2 ** 16))
def test_ref_slice_invariance_bitwise(m, i, k, a, b, seed):
    x, q, s, _ = _operands(m, i, k, seed)
    a, b = sorted((min(a, m), min(b, m)))
    assert torch.equal(linear_fp8_silu_mul_ref(x, q, s)[a:b], linear_fp8_silu_mul_ref(x[a:b], q, s))


def _float64(x, q, s, b):
    """silu(gate) * up in float64 of the same quantized operands."""
    k = x.shape[-1]
    x_q, sx = quantize_activations(x)
    y = (x_q.double() * sx.double().repeat_interleave(BLOCK, -1)[:, :k]) @ dequantize_weight(q, s).double().t()
    gate, up = (y + (0 if b is None else b.double())).split(q.shape[0] // 2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


def test_ref_matches_float64_of_the_quantized_operands():
    x, q, s, b = _operands(13, 96, 520, seed=4, bias=True, dtype=torch.float32)
    exact = _float64(x, q, s, b)
    out = linear_fp8_silu_mul_ref(x, q, s, b).double()
    # fp32 block partials, scale products and the silu*mul epilogue: a few fp32 ulps of the terms' magnitudes
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))


def test_bad_operands_are_named():
    x, q, s, b = _operands(3, 8, 256, seed=0, bias=True)
    with pytest.raises(ValueError, match="odd row count 15"):
        linear_fp8_silu_mul_ref(x, q[:15], s[:15])
    with pytest.raises(ValueError, match="weight scales"):
        linear_fp8_silu_mul_ref(x, q, s[:, :1])
    with pytest.raises(ValueError, match=r"bias must have shape \[N\] = \[16\]"):
        linear_fp8_silu_mul_ref(x, q, s, b[:3])
    if not interpreting():
        with pytest.raises(ValueError, match="runs on CUDA tensors"):
            linear_fp8_silu_mul(x, q, s)


def test_the_dense_fp8_mlp_runs_the_fused_op_and_a_16bit_one_does_not():
    """models/transformer.py's MLP: an FP8 gate_up goes through `Ops.linear_fp8_silu_mul` (one launch on CUDA),
    a 16-bit one (a linear left unquantized) through `linear_silu_mul`."""
    import dataclasses

    from detinfer.models.config import ModelConfig
    from detinfer.models.random_weights import random_state
    from detinfer.models.testing import tiny_config_dict
    from detinfer.models.transformer import MLP

    calls = []

    @dataclasses.dataclass(frozen=True)
    class Spy(Ops):
        def linear_fp8_silu_mul(self, *args):
            calls.append("fp8")
            return super().linear_fp8_silu_mul(*args)

        def linear_silu_mul(self, *args):
            calls.append("16-bit")
            return super().linear_silu_mul(*args)

    config = dataclasses.replace(ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM")), quantization="fp8")
    state = random_state(config, seed=1, dtype=torch.float32, device="cpu")
    mlp = MLP(config)
    mlp.load_state_dict({k.removeprefix("layers.0.mlp."): v for k, v in state.items()
                         if k.startswith("layers.0.mlp.")}, assign=True)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    ops = Spy("deterministic", "cpu", torch.float32)
    proj = mlp.gate_up_proj
    want = ops.linear_fp8(ops.silu_mul(*ops.linear_fp8(x, proj.weight, proj.weight_scale).split(
        config.intermediate_size, -1)), mlp.down_proj.weight, mlp.down_proj.weight_scale)
    assert torch.equal(mlp(x, ops), want) and calls == ["fp8"]
    proj.weight_scale, proj.weight = None, torch.nn.Parameter(dequantize_weight(proj.weight, state[
        "layers.0.mlp.gate_up_proj.weight_scale"]), requires_grad=False)
    calls.clear()
    mlp(x, ops)
    assert calls == ["16-bit"]


# -- the kernel in Triton's interpreter (fp32) --------------------------------------------------------------
def _two_launches(x, q, s, b):
    from detinfer.kernels.fp8_linear import linear_fp8
    from detinfer.kernels.silu_mul import silu_mul

    gate, up = linear_fp8(x, q, s, b).split(q.shape[0] // 2, dim=-1)
    return silu_mul(gate, up)


@interpreter
@pytest.mark.parametrize("m,i,k,bias", [(1, 48, 300, False), (70, 100, 256, True), (5, 1100, 130, True),
                                        (3, 7, 40, False)])
def test_kernel_in_the_interpreter_equals_two_launches_and_is_close_to_the_ref(m, i, k, bias):
    x, q, s, b = _operands(m, i, k, seed=m + i + k, bias=bias, dtype=torch.float32)
    out = linear_fp8_silu_mul(x, q, s, b)
    assert out.shape == (m, i) and out.dtype == torch.float32
    assert torch.equal(out, _two_launches(x, q, s, b))
    ref = linear_fp8_silu_mul_ref(x, q, s, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.equal(linear_fp8_silu_mul(x.reshape(1, m, k), q, s, b), out.reshape(1, m, i))
    assert linear_fp8_silu_mul(x[:0], q, s, b).shape == (0, i)


@interpreter
@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 80), a=st.integers(0, 80), b=st.integers(0, 80), seed=st.integers(0, 100))
def test_kernel_slice_invariance_bitwise_in_the_interpreter(m, a, b, seed):
    x, q, s, _ = _operands(m, 40, 260, seed, dtype=torch.float32)
    a, b = sorted((min(a, m), min(b, m)))
    assert torch.equal(linear_fp8_silu_mul(x, q, s)[a:b], linear_fp8_silu_mul(x[a:b], q, s))


# -- GPU (fp8 tensor cores: sm89+) ----------------------------------------------------------------------------
def _fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


fp8_gpu = pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with fp8 tensor cores (sm89+)")


def _cuda(*ts):
    return tuple(None if t is None else t.cuda() for t in ts)


@pytest.mark.gpu
@fp8_gpu
@pytest.mark.parametrize("m,i,k", [(1, 1536, 512), (37, 500, 300), (200, 3072, 2048), (5, 64, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_ref_and_two_launches_on_gpu(m, i, k, bias):
    x, q, s, b = _operands(m, i, k, seed=m + i + k, bias=bias)
    out = linear_fp8_silu_mul(*_cuda(x, q, s, b))
    assert out.shape == (m, i) and out.dtype == torch.bfloat16
    ref = linear_fp8_silu_mul_ref(x, q, s, b).float()
    # not bitwise: the tensor cores' fp8 accumulation is not the ref's exact block dot (and bf16 roundings)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    # the same dot shapes, K order and epilogue as linear_fp8 + silu_mul (docs/fp8.md: what the repro
    # audit's two-launch path relies on)
    assert torch.equal(out, _two_launches(*_cuda(x, q, s, b)))


@pytest.mark.gpu
@fp8_gpu
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 300), a=st.integers(0, 300), b=st.integers(0, 300), seed=st.integers(0, 100))
def test_kernel_slice_invariance_bitwise_on_gpu(m, a, b, seed):
    x, q, s, bias = _cuda(*_operands(m, 1536, 1024, seed, bias=True))
    a, b = sorted((min(a, m), min(b, m)))
    assert torch.equal(linear_fp8_silu_mul(x, q, s, bias)[a:b], linear_fp8_silu_mul(x[a:b], q, s, bias))


@pytest.mark.gpu
@fp8_gpu
def test_ops_runs_the_fused_kernel_on_cuda_for_any_batch():
    for m in (1, 64, 65, 300):  # no row threshold: the launch choice never looks at the batch
        x, q, s, b = _cuda(*_operands(m, 768, 512, seed=m, bias=True))
        det = Ops("deterministic", "cuda", torch.bfloat16)
        assert torch.equal(det.linear_fp8_silu_mul(x, q, s, b), linear_fp8_silu_mul(x, q, s, b))
    fast = Ops("fast", "cuda", torch.bfloat16).linear_fp8_silu_mul(x, q, s, b).float()
    ref = linear_fp8_silu_mul_ref(*(t.cpu() for t in (x, q, s, b))).float().cuda()
    assert float((fast - ref).norm() / ref.norm()) < 0.06  # fast mode: the stock FP8 linear, then silu_mul
