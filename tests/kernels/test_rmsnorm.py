"""rms_norm: batch invariance and residual-fusion equivalence (bitwise), HF semantics, accuracy vs fp64."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.kernels.rmsnorm import MAX_D, launch_rms_norm_rows, rms_norm, rms_norm_ref

# The interpreter computes masked lanes too; numpy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# bf16 only on GPU: Triton's interpreter mishandles bf16 arithmetic/stores.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])

ROWS = st.sampled_from([1, 7, 333]) | st.integers(1, 24)
DIMS = st.sampled_from([1, 7, 128, 333]) | st.integers(1, 300)
EPS = st.sampled_from([1e-6, 1e-5, 0.0, 0.1])
# y is rounded to x.dtype, then multiplied by the weight and rounded again: 2 roundings of the output
# dtype, plus fp32 sum/rsqrt error (fp32 only matters for fp32 outputs).
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rand(shape, dtype, seed, scale=1e3, device=DEVICE):
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: big GPU cases stay fast
    x = (torch.rand(shape, generator=g, dtype=torch.float64, device=device) * 2 - 1) * scale
    return x.to(dtype)


def hf_rms_norm_fp64(h, weight, eps):
    """HF LlamaRMSNorm with every step in float64 (the accuracy reference)."""
    hd = h.double()
    y = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else weight.double() * y


def assert_accurate(y, h, weight, eps):
    want = hf_rms_norm_fp64(h, weight, eps)
    err = (y.double() - want).abs()
    rtol = max(RTOL[h.dtype], RTOL[y.dtype])  # y is rounded to x.dtype before the weight multiply
    bad = ~(err <= 1e-6 + rtol * want.abs())  # NaN (unwritten, poisoned) fails too
    assert not bad.any(), f"{int(bad.sum())} elements off, worst {err.nan_to_num(float('inf')).max():.3g}"


def make_case(shape, dtype, weight_kind, seed):
    x = rand(shape, dtype, seed)
    residual = rand(shape, dtype, seed + 1)
    d = shape[-1]
    weight = None
    if weight_kind == "same":
        weight = rand((d,), dtype, seed + 2, 2.0)
    elif weight_kind == "fp32":  # promotes y to fp32, as `weight * y` does in HF
        weight = rand((d,), torch.float32, seed + 2, 2.0)
    return x, residual, weight


def check_kernel_case(shape, dtype, weight_kind, eps, seed, m, n):
    x, residual, weight = make_case(shape, dtype, weight_kind, seed)
    out_dtype = dtype if weight is None else torch.promote_types(weight.dtype, dtype)
    y = rms_norm(x, weight, eps)
    assert y.shape == x.shape and y.dtype == out_dtype
    y2, h = rms_norm(x, weight, eps, residual=residual)
    assert torch.equal(h, x + residual)  # the add is done in model dtype, as HF does
    assert torch.equal(y2, rms_norm(h, weight, eps))  # contract C
    # contract A: slices of the leading dim
    lead = shape[0]
    lo, hi = sorted((m % lead, n % lead + 1))
    hi = max(hi, lo + 1)
    assert torch.equal(y[lo:hi], rms_norm(x[lo:hi], weight, eps))
    assert torch.equal(y2[lo:hi], rms_norm(x[lo:hi], weight, eps, residual[lo:hi])[0])
    # accuracy, with poisoned outputs so an unwritten element fails
    d = shape[-1]
    y_p = torch.full((x.numel() // d, d), float("nan"), dtype=out_dtype, device=DEVICE)
    h_p = torch.full((x.numel() // d, d), float("nan"), dtype=dtype, device=DEVICE)
    launch_rms_norm_rows(x.reshape(-1, d), weight, eps, residual.reshape(-1, d), y_p, h_p)
    assert torch.equal(h_p, h.reshape(-1, d)) and torch.equal(y_p, y2.reshape(-1, d))
    assert_accurate(y_p, h_p, weight, eps)


@given(rows=ROWS, d=DIMS, dtype=st.sampled_from([torch.float32, torch.float16]),
       weight_kind=st.sampled_from(["same", "fp32", None]), eps=EPS, seed=st.integers(0, 2**31),
       m=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_kernel_rows_invariant_and_accurate(rows, d, dtype, weight_kind, eps, seed, m, n):
    check_kernel_case((rows, d), dtype, weight_kind, eps, seed, m, n)


@given(tokens=ROWS, heads=st.integers(1, 8), head_dim=st.sampled_from([64, 128, 7]),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**31),
       m=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_per_head_norm(tokens, heads, head_dim, dtype, seed, m, n):
    """Qwen3's q/k norm: [T, H, Dh] with weight [Dh]; slicing tokens changes no bit."""
    check_kernel_case((tokens, heads, head_dim), dtype, "same", 1e-6, seed, m, n)


@pytest.mark.gpu
@given(rows=ROWS, d=DIMS | st.sampled_from([2048, 4096, 5120, 8192]),
       weight_kind=st.sampled_from(["same", "fp32", None]), eps=EPS, seed=st.integers(0, 2**31),
       m=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_kernel_rows_bf16(rows, d, weight_kind, eps, seed, m, n):
    check_kernel_case((rows, d), torch.bfloat16, weight_kind, eps, seed, m, n)


def test_non_contiguous_input():
    x = rand((6, 40), torch.float32, 1)[:, ::2]  # inner stride 2
    w = rand((20,), torch.float32, 2)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm(x.contiguous(), w, 1e-6))
    q = rand((5, 3 * 64), torch.float32, 3)[:, :128].view(5, 2, 64)  # a q slice of a fused qkv
    ones = torch.ones(64, device=DEVICE)
    assert torch.equal(rms_norm(q, ones, 1e-6)[1:3], rms_norm(q[1:3].contiguous(), ones, 1e-6))


def test_empty_inputs():
    assert rms_norm(torch.zeros(0, 8, device=DEVICE), None, 1e-6).shape == (0, 8)
    y, h = rms_norm(torch.zeros(2, 0, 8, device=DEVICE), None, 1e-6, torch.zeros(2, 0, 8, device=DEVICE))
    assert y.shape == h.shape == (2, 0, 8)


@given(rows=ROWS, d=DIMS, dtype=st.sampled_from([torch.float32, torch.float64]),
       weight=st.booleans(), seed=st.integers(0, 2**31), m=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_ref_invariant_and_accurate(rows, d, dtype, weight, seed, m, n):
    x = rand((rows, d), dtype, seed, device="cpu")
    r = rand((rows, d), dtype, seed + 1, device="cpu")
    w = rand((d,), dtype, seed + 2, 2.0, device="cpu") if weight else None
    y, h = rms_norm_ref(x, w, 1e-6, residual=r)
    assert torch.equal(h, x + r) and torch.equal(y, rms_norm_ref(h, w, 1e-6))
    lo, hi = sorted((m % rows, n % rows + 1))
    hi = max(hi, lo + 1)
    assert torch.equal(y[lo:hi], rms_norm_ref(x[lo:hi], w, 1e-6, r[lo:hi])[0])
    if dtype == torch.float64:
        assert torch.allclose(y, hf_rms_norm_fp64(h, w, 1e-6), rtol=1e-13, atol=1e-13)
    else:
        assert_accurate(y, h, w, 1e-6)


def test_matches_hf_module():
    """Same semantics as transformers' LlamaRMSNorm (weight in model dtype, fp32 math inside)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in KERNEL_DTYPES:
        norm = LlamaRMSNorm(96, eps=1e-5).to(DEVICE, dtype)
        with torch.no_grad():
            norm.weight.copy_(rand((96,), dtype, 4, 2.0))
            x = rand((9, 96), dtype, 5)
            want = norm(x)
        for fn in (rms_norm, rms_norm_ref):
            got = fn(x, norm.weight.detach(), 1e-5)
            assert got.dtype == want.dtype
            assert_accurate(got, x, norm.weight.detach(), 1e-5)
            # bits may differ only where the fp32 sum of squares is rounded differently: rarely, by 1 ulp
            ulp = torch.finfo(dtype).eps * want.abs().double()
            assert ((got.double() - want.double()).abs() <= 2 * ulp + 1e-6).all()


def test_bad_inputs():
    x = rand((2, 8), torch.float32, 0)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must have shape \[D\] = \[8\]"):
        rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm(x, w, -1e-6)
    for bad_eps in (float("nan"), "1e-6", None, True):
        with pytest.raises(ValueError, match="eps must be"):
            rms_norm_ref(x, w, bad_eps)
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(x, w, 1e-6, residual=x[:1])
    with pytest.raises(TypeError, match="residual dtype"):
        rms_norm(x, w, 1e-6, residual=x.half())
    with pytest.raises(ValueError, match="0-dim"):
        rms_norm(torch.tensor(1.0, device=DEVICE), None, 1e-6)
    with pytest.raises(TypeError, match="float tensor"):
        rms_norm(torch.ones(2, 8, dtype=torch.int32, device=DEVICE), None, 1e-6)
    with pytest.raises(TypeError, match="not supported"):
        rms_norm(x.double(), None, 1e-6)
    with pytest.raises(ValueError, match="maximum hidden size"):
        rms_norm(torch.zeros(1, MAX_D + 1, device=DEVICE), None, 1e-6)


def test_cpu_tensor_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        rms_norm(torch.ones(2, 3), None, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("d", [128, 4096, 5120])
def test_gpu_batch_sizes_and_residual(dtype, d):
    """Model shapes: a row's bits are the same in batches of 1..4096 rows, with and without residual."""
    x, r, w = make_case((4096, d), dtype, "same", 21)
    want = rms_norm(x[:1], w, 1e-6)
    want_r = rms_norm(x[:1], w, 1e-6, r[:1])[0]
    for b in (2, 3, 64, 1000, 4096):
        assert torch.equal(rms_norm(x[:b], w, 1e-6)[:1], want)
        assert torch.equal(rms_norm(x[:b], w, 1e-6, r[:b])[0][:1], want_r)
    assert torch.equal(rms_norm(x[7:300], w, 1e-6), rms_norm(x, w, 1e-6)[7:300])


@pytest.mark.gpu
def test_negative_control_stock_variance_varies_with_batch():
    """HF's `h.float().pow(2).mean(-1)` on CUDA: stock reductions choose their thread split from the
    number of rows, so a row's fp32 variance can change bits with the batch (the first shape that shows
    it is enough; if none did, the invariance tests above could not tell a variant kernel apart)."""
    seen = []
    for d in (4096, 8192, 1 << 15):
        x = rand((2048, d), torch.bfloat16, d, 3.0)
        var = {x[:b].float().pow(2).mean(-1)[0].item() for b in (1, 2, 8, 64, 2048)}
        seen.append(len(var) > 1)
        ours = rms_norm(x[:1], None, 1e-6)
        assert all(torch.equal(rms_norm(x[:b], None, 1e-6)[:1], ours) for b in (2, 8, 64, 2048))
    assert any(seen), "stock mean of squares gave the same bits for every batch size and width"
