"""softmax / log_softmax: batch invariance and masked-key invariance (bitwise), accuracy vs float64."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.kernels.softmax import (
    SOFTMAX_BLOCK,
    launch_softmax_rows,
    log_softmax,
    log_softmax_ref,
    softmax,
    softmax_ref,
)

# The interpreter computes masked lanes too (log(0), 0/0); numpy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# bf16 only on GPU: Triton's interpreter mishandles bf16 arithmetic/stores.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])

ROWS = st.sampled_from([1, 7, 333]) | st.integers(1, 24)
COLS = st.sampled_from([1, 7, 333]) | st.integers(1, 200)
# Small blocks make short CPU rows span several blocks; the default is tested on long rows below.
BLOCKS = st.sampled_from([32, 64, SOFTMAX_BLOCK])
# Spread of the scores: 1e3 makes rows nearly one-hot (exp underflows), 1 makes them flat.
SCALES = st.sampled_from([1.0, 30.0, 1e3])

# (rtol, atol) of the output vs float64, per output dtype: one rounding to the output dtype plus the
# fp32 exp/log/sum error (the GPU uses approximate exp2/log2, a few fp32 ulps of |x - max| <= ~100).
SOFTMAX_TOL = {torch.float32: (3e-5, 1e-30), torch.float16: (1.5e-3, 1e-7), torch.bfloat16: (1e-2, 1e-30)}
LOG_SOFTMAX_TOL = {torch.float32: (5e-7, 5e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 1e-2)}


def rand(shape, dtype, seed, scale=1e3, device=DEVICE):
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: big GPU cases stay fast
    x = (torch.rand(shape, generator=g, dtype=torch.float64, device=device) * 2 - 1) * scale
    return x.to(dtype)


def assert_close_to_fp64(out, x, log):
    want = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    rtol, atol = (LOG_SOFTMAX_TOL if log else SOFTMAX_TOL)[out.dtype]
    err = (out.double() - want).abs()
    bad = ~(err <= atol + rtol * want.abs())  # NaN (e.g. a poisoned, unwritten element) fails too
    assert not bad.any(), f"{int(bad.sum())} elements off, worst {err.nan_to_num(float('inf')).max():.3g}"


def slice_bounds(rows, m, n):
    lo, hi = sorted((m % rows, n % rows + 1))
    return lo, max(hi, lo + 1)


def check_kernel_case(rows, cols, dtype, out_dtype, log, block, scale, seed, m, n):
    x = rand((rows, cols), dtype, seed, scale)
    fn = log_softmax if log else softmax
    out = fn(x, -1, out_dtype, block_size=block)
    assert out.shape == x.shape and out.dtype == (out_dtype or dtype)
    lo, hi = slice_bounds(rows, m, n)
    assert torch.equal(out[lo:hi], fn(x[lo:hi], -1, out_dtype, block_size=block))  # contract A
    poisoned = torch.full(x.shape, float("nan"), dtype=out.dtype, device=DEVICE)
    launch_softmax_rows(x, poisoned, log, block)
    assert torch.equal(poisoned, out)
    assert_close_to_fp64(poisoned, x, log)


@given(rows=ROWS, cols=COLS, dtype=st.sampled_from([torch.float32, torch.float16]),
       out_dtype=st.sampled_from([None, torch.float32]), log=st.booleans(), block=BLOCKS, scale=SCALES,
       seed=st.integers(0, 2**31), m=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_kernel_rows_invariant_and_accurate(rows, cols, dtype, out_dtype, log, block, scale, seed, m, n):
    check_kernel_case(rows, cols, dtype, out_dtype, log, block, scale, seed, m, n)


@pytest.mark.gpu
@given(rows=ROWS, cols=COLS, out_dtype=st.sampled_from([None, torch.float32]), log=st.booleans(),
       block=BLOCKS, scale=SCALES, seed=st.integers(0, 2**31), m=st.integers(0, 10**6),
       n=st.integers(0, 10**6))
def test_kernel_rows_bf16(rows, cols, out_dtype, log, block, scale, seed, m, n):
    check_kernel_case(rows, cols, torch.bfloat16, out_dtype, log, block, scale, seed, m, n)


def masked_pad(x, pad, kind, seed):
    """`pad` masked keys appended to each row: -inf, finfo.min, or HF's scores + finfo.min."""
    shape = (x.shape[0], pad)
    lowest = torch.finfo(x.dtype).min
    if kind == "-inf":
        tail = torch.full(shape, float("-inf"), dtype=x.dtype, device=x.device)
    elif kind == "finfo.min":
        tail = torch.full(shape, lowest, dtype=x.dtype, device=x.device)
    else:  # HF eager attention: the additive mask is finfo.min, added to real scores in model dtype
        tail = rand(shape, x.dtype, seed + 1, 30.0, x.device) + lowest
    return torch.cat([x, tail], 1)


@given(cols=st.integers(1, 300), pad=st.integers(1, 700), dtype=st.sampled_from(KERNEL_DTYPES),
       kind=st.sampled_from(["-inf", "finfo.min", "hf"]), log=st.booleans(), block=BLOCKS, scale=SCALES,
       seed=st.integers(0, 2**31))
def test_appending_masked_keys_keeps_bits(cols, pad, dtype, kind, log, block, scale, seed):
    """Contract B: masked keys appended to a row (across block boundaries too) change no other bit."""
    x = rand((3, cols), dtype, seed, scale)
    padded = masked_pad(x, pad, kind, seed)
    for fn in ((log_softmax, log_softmax_ref) if log else (softmax, softmax_ref)):
        kw = {} if fn in (softmax_ref, log_softmax_ref) else {"block_size": block}
        for out_dtype in (None, torch.float32):
            out = fn(x, -1, out_dtype, **kw)
            assert torch.equal(out, fn(padded, -1, out_dtype, **kw)[:, :cols]), (fn.__name__, out_dtype)


def test_default_block_long_rows():
    """Rows longer than the default block: slices, masked keys across the block edge, accuracy."""
    cols = 2 * SOFTMAX_BLOCK + 123
    x = rand((3, cols), torch.float32, 7, 30.0)
    for log, fn in ((False, softmax), (True, log_softmax)):
        out = fn(x)
        assert torch.equal(out[1:2], fn(x[1:2]))
        for kind in ("-inf", "hf"):
            assert torch.equal(out, fn(masked_pad(x, SOFTMAX_BLOCK, kind, 1))[:, :cols])
        assert_close_to_fp64(out, x, log)
    short = rand((2, 300), torch.float32, 8, 30.0)
    assert torch.equal(softmax(short), softmax(masked_pad(short, SOFTMAX_BLOCK, "-inf", 2))[:, :300])


@given(cols=st.integers(1, 300), log=st.booleans(), seed=st.integers(0, 2**31))
def test_short_row_result_independent_of_block(cols, log, seed):
    """A row that fits in one block gives the same bits for every power-of-two block >= its length."""
    x = rand((4, cols), torch.float32, seed, 30.0)
    fn = log_softmax if log else softmax
    want = fn(x)
    for block in (32, 64, 128, 256, 512, 1024):
        if block >= cols:
            assert torch.equal(fn(x, block_size=block), want)


def test_dims_dtypes_and_degenerate_inputs():
    x = rand((3, 5, 7), torch.float32, 1, 10.0)
    for fn, stock, ref in ((softmax, torch.softmax, softmax_ref),
                           (log_softmax, torch.log_softmax, log_softmax_ref)):
        for dim in (0, 1, -2, 2):
            out = fn(x, dim)
            assert torch.equal(out, fn(x.movedim(dim, -1).contiguous(), -1).movedim(-1, dim))
            assert torch.allclose(out.double(), stock(x.double(), dim), rtol=1e-5, atol=1e-5)
            assert torch.allclose(ref(x, dim).double(), stock(x.double(), dim), rtol=1e-5, atol=1e-5)
        # torch's dtype=: the input is cast first
        assert torch.equal(fn(x, -1, torch.float16), fn(x.half(), -1))
        assert fn(x.half(), -1, torch.float32).dtype == torch.float32
        s = torch.tensor(3.0, device=DEVICE)
        assert torch.equal(fn(s, 0), stock(s, 0)) and fn(s, -1).shape == ()
        assert fn(torch.zeros(3, 0, device=DEVICE)).shape == (3, 0)
        assert fn(torch.zeros(0, 4, device=DEVICE)).shape == (0, 4)
        # a fully masked row gives NaN, as stock torch does; the other rows are unaffected
        y = torch.cat([torch.full((1, 5), float("-inf")), torch.zeros(1, 5)]).to(DEVICE)
        for f in (fn, ref):
            out = f(y)
            assert out[0].isnan().all() and torch.allclose(out[1], stock(y[1], -1))
    assert softmax_ref(x.double(), 1).dtype == torch.float64


@given(rows=ROWS, cols=COLS, dtype=st.sampled_from([torch.float32, torch.float64]), log=st.booleans(),
       scale=SCALES, seed=st.integers(0, 2**31), m=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_ref_invariant_and_accurate(rows, cols, dtype, log, scale, seed, m, n):
    x = rand((rows, cols), dtype, seed, scale, device="cpu")
    fn = log_softmax_ref if log else softmax_ref
    out = fn(x)
    lo, hi = slice_bounds(rows, m, n)
    assert torch.equal(out[lo:hi], fn(x[lo:hi]))
    if dtype == torch.float64:
        want = (torch.log_softmax if log else torch.softmax)(x, -1)
        assert torch.allclose(out, want, rtol=1e-13, atol=1e-13 if log else 1e-300)
    else:
        assert_close_to_fp64(out, x, log)


def test_bad_inputs():
    x = rand((2, 3), torch.float32, 0)
    with pytest.raises(IndexError, match="out of range"):
        softmax(x, 2)
    with pytest.raises(TypeError, match="dim must be an int"):
        log_softmax(x, None)
    with pytest.raises(TypeError, match="float"):
        softmax(torch.ones(2, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="float torch.dtype"):
        softmax(x, -1, torch.int32)
    with pytest.raises(TypeError, match="not supported"):
        softmax(x.double())
    with pytest.raises(TypeError, match="not supported"):
        log_softmax(x, -1, torch.float64)
    for bad in (16, 48, 1 << 17, True):
        with pytest.raises(ValueError, match="power of two"):
            softmax(x, block_size=bad)
    with pytest.raises(TypeError, match="torch.Tensor"):
        softmax_ref([1.0, 2.0])


def test_cpu_tensor_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        softmax(torch.ones(2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("cols", [151936, 262144])
def test_gpu_vocab_rows_batch_sizes(dtype, cols):
    """Vocab rows at the default block: row 0's bits are the same in batches of 1..32 rows, and
    masked keys appended past the vocab change nothing."""
    x = rand((32, cols), dtype, 11, 30.0)
    for fn in (softmax, log_softmax):
        want = fn(x[:1], -1, torch.float32)
        for b in (2, 5, 32):
            assert torch.equal(fn(x[:b], -1, torch.float32)[:1], want)
        padded = masked_pad(x[:2], 1000, "hf", 3)
        assert torch.equal(fn(padded, -1, torch.float32)[:1, :cols], want)
        assert_close_to_fp64(want, x[:1], fn is log_softmax)


@pytest.mark.gpu
def test_negative_control_stock_softmax_changes_with_masked_keys():
    """Stock CUDA softmax picks its thread split from the row length, so appending masked (-inf) keys
    changes the other outputs' bits for some lengths; the contract-B tests above would catch that.
    (Stock softmax gives each row its own block or warp, so it is not expected to vary with the batch
    size alone; this control varies the row length instead.)"""
    differs = []
    for cols, pad in ((100, 900), (50, 2000), (1000, 4000), (3000, 30000), (700, 70000)):
        x = rand((8, cols), torch.float32, cols, 3.0)
        padded = masked_pad(x, pad, "-inf", 0)
        differs.append(not torch.equal(torch.softmax(x, -1), torch.softmax(padded, -1)[:, :cols]))
        assert torch.equal(softmax(x), softmax(padded)[:, :cols])
    assert any(differs), "stock torch.softmax kept its bits for every padding tried"
