"""Fast mode (`Ops("fast")`): what a serving stack runs. Each op is accurate against a float64 reference
(CPU: stock torch; CUDA: cuBLAS and the fused norm / activation kernels), the fused kernels are what runs
on CUDA, autograd still works, and a negative control shows its linear bits do depend on the batch size,
which is what the comparison with deterministic mode measures."""

import pytest
import torch
import torch.nn.functional as F

from detinfer.kernels._launch import KERNEL_DTYPES
from detinfer.ops import Ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Rounding of the output dtype (twice for a norm with a weight) plus fp32 accumulation error.
RTOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rand(shape, dtype, seed, device=DEVICE, scale=1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)


def assert_close_fp64(got, want64, dtype, floor=None):
    """|got - want| <= rtol * (|want| + floor), elementwise; floor defaults to 1% of the largest |want|
    (sums pass the sum of |x|: their error scales with it, not with the result)."""
    want64 = want64.double()
    floor = 1e-2 * want64.abs().amax().clamp(min=1e-30) if floor is None else floor
    err = (got.double() - want64).abs()
    assert (err <= RTOL[dtype] * (want64.abs() + floor)).all(), float(err.max())


def rms_fp64(h, w, eps):
    hd = h.double()
    return w.double() * (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps))


def check_fast_ops(ops: Ops, dtype: torch.dtype, device: torch.device) -> None:
    """Every dense op of fast mode against float64."""
    t, k, n, inter = 19, 256, 320, 96
    x, w, b = rand((t, k), dtype, 1, device), rand((n, k), dtype, 2, device, k**-0.5), rand((n,), dtype, 3, device)
    assert_close_fp64(ops.linear(x, w, b), x.double() @ w.double().T + b.double(), dtype)
    logits = ops.logits(x, w)
    assert logits.dtype == torch.float32
    assert_close_fp64(logits, x.double() @ w.double().T, dtype)
    assert_close_fp64(ops.mm(x, w.t(), b), x.double() @ w.double().T + b.double(), dtype)
    xb = rand((3, 5, k), dtype, 4, device)
    assert_close_fp64(ops.bmm(xb, w.t()[None].expand(3, k, n)), xb.double() @ w.double().T, dtype)
    nw, r = rand((k,), dtype, 5, device).abs() + 0.5, rand((t, k), dtype, 6, device)
    assert_close_fp64(ops.rms_norm(x, nw, 1e-6), rms_fp64(x, nw, 1e-6), dtype)
    y, h = ops.rms_norm(x, nw, 1e-6, residual=r)
    assert torch.equal(h, x + r)  # the new residual stream: one add rounded to the model dtype
    assert_close_fp64(y, rms_fp64(h, nw, 1e-6), dtype)
    gate, up = rand((t, 2 * inter), dtype, 7, device, 4.0).split(inter, dim=-1)
    g64 = gate.double()
    assert_close_fp64(ops.silu_mul(gate, up), g64 / (1 + torch.exp(-g64)) * up.double(), dtype)
    s = rand((4, 1000), dtype, 8, device, 6.0)
    assert_close_fp64(ops.softmax(s), torch.softmax(s.double(), -1), dtype)
    assert_close_fp64(ops.log_softmax(s), torch.log_softmax(s.double(), -1), dtype)
    a = s.double().abs()
    assert_close_fp64(ops.sum_dim(s, [1]), s.double().sum(1), dtype, floor=a.sum(1))
    assert_close_fp64(ops.mean_dim(s, [0, 1], keepdim=True), s.double().mean((0, 1), keepdim=True), dtype,
                      floor=a.mean())


def test_selection_fused_kernels_on_cuda_only():
    assert Ops("fast", "cuda", torch.bfloat16).fused_dtypes == frozenset(KERNEL_DTYPES)  # choosing needs no GPU
    assert Ops("fast", "cpu", torch.float32, cpu_triton=True).fused_dtypes == frozenset()
    assert Ops("deterministic", "cuda", torch.bfloat16).fused_dtypes == frozenset()


def test_cpu_fast_ops_are_stock_and_accurate():
    ops = Ops("fast", "cpu", torch.float32)
    check_fast_ops(ops, torch.float32, torch.device("cpu"))
    x, w = rand((5, 64), torch.float32, 9, "cpu"), rand((64,), torch.float32, 10, "cpu")
    g, u = x[:, :32], x[:, 32:]
    assert torch.equal(ops.silu_mul(g, u), F.silu(g) * u)
    assert torch.equal(ops.sum_dim(x, [1]), torch.sum(x, [1]))
    h = x.float()
    want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) * w
    assert torch.equal(ops.rms_norm(x, w, 1e-6), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_gpu_fast_ops_are_accurate(dtype):
    check_fast_ops(Ops("fast", "cuda", dtype), dtype, torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_fast_norm_and_activation_are_the_fused_kernels(monkeypatch):
    from detinfer.kernels import rmsnorm, silu_mul

    calls = []
    for mod, name in ((rmsnorm, "rms_norm"), (silu_mul, "silu_mul")):
        original = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    ops = Ops("fast", "cuda", torch.bfloat16)
    x, w = rand((4, 128), torch.bfloat16, 1), rand((128,), torch.bfloat16, 2)
    ops.rms_norm(x, w, 1e-6, residual=x)
    ops.silu_mul(x, x)
    assert calls == ["rms_norm", "silu_mul"]
    # autograd recording: stock torch (the kernels have no backward)
    wg = w.clone().requires_grad_(True)
    y = ops.rms_norm(x, wg, 1e-6)
    assert calls == ["rms_norm", "silu_mul"] and y.requires_grad
    y.float().sum().backward()
    assert wg.grad is not None


@pytest.mark.gpu
def test_gpu_fast_linear_bits_depend_on_the_batch_size():
    """Negative control: cuBLAS picks its kernel (tile, split-K) from M, so a row's bits change with the
    batch around it; the deterministic kernel on the same operands does not (the positive control)."""
    fast, det = Ops("fast", "cuda", torch.bfloat16), Ops("deterministic", "cuda", torch.bfloat16)
    x = rand((4096, 4096), torch.bfloat16, 11)
    w = rand((4096, 4096), torch.bfloat16, 12, scale=4096**-0.5)
    ms = (2, 3, 8, 16, 33, 64, 128, 256, 512, 1024, 2048, 4096)
    fast_alone, det_alone = fast.linear(x[:1], w), det.linear(x[:1], w)
    fast_same = [torch.equal(fast.linear(x[:m], w)[:1], fast_alone) for m in ms]
    det_same = [torch.equal(det.linear(x[:m], w)[:1], det_alone) for m in ms]
    assert all(det_same)
    assert not all(fast_same), "cuBLAS gave row 0 the same bits at every batch size: the control shows nothing"
