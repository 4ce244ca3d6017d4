"""sum_dim / mean_dim: batch invariance (bitwise), zero-append invariance, accuracy vs float64.

The kernel and the pure-torch reference add in the same documented order, so with fp32 accumulation
they must agree bit for bit; that is asserted on CPU (interpreter) and on GPU.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.kernels.reduce import (
    REDUCE_BLOCK,
    launch_sum_rows,
    mean_dim,
    mean_dim_ref,
    sum_dim,
    sum_dim_ref,
)

# The interpreter computes masked lanes too (log(0), 0/0); numpy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 only on GPU: Triton's interpreter mishandles bf16 arithmetic/stores.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])

ROWS = st.sampled_from([1, 7, 333]) | st.integers(1, 24)
COLS = st.sampled_from([1, 7, 333]) | st.integers(1, 200)
# Small blocks make short CPU rows span several blocks; the default is tested on long rows below.
BLOCKS = st.sampled_from([32, 64, REDUCE_BLOCK])


def rand(shape, dtype, seed, scale=1e3, device=DEVICE):
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: big GPU cases stay fast
    x = (torch.rand(shape, generator=g, dtype=torch.float64, device=device) * 2 - 1) * scale
    return x.to(dtype)


def sum_tolerance(x: torch.Tensor, dim, out_dtype) -> torch.Tensor:
    """fp32 pairwise accumulation error (<= ~log2(n) eps32 * sum|x|) plus one rounding to out_dtype."""
    abs_sum = x.double().abs().sum(dim)
    return 1e-6 * abs_sum + torch.finfo(out_dtype).eps * torch.sum(x.double(), dim).abs() + 1e-30


def check_kernel_case(rows, cols, dtype, block, seed, m, n):
    # fp16 tops out at 65504: sums of hundreds of 1e3-sized values would overflow, so fp16 uses 1e2.
    x = rand((rows, cols), dtype, seed, scale=1e2 if dtype == torch.float16 else 1e3)
    for fn, ref in ((sum_dim, sum_dim_ref), (mean_dim, mean_dim_ref)):
        out = fn(x, -1, block_size=block)
        assert out.shape == (rows,) and out.dtype == dtype
        # same order as the reference: bitwise
        assert torch.equal(out, ref(x, -1, block_size=block))
        # contract A: a slice of the batch gives the same bits
        lo, hi = sorted((m % rows, n % rows + 1))
        hi = max(hi, lo + 1)
        assert torch.equal(out[lo:hi], fn(x[lo:hi], -1, block_size=block))
    # accuracy vs float64, output poisoned so an unwritten element fails
    for mean in (False, True):
        out = torch.full((rows,), float("nan"), dtype=dtype, device=DEVICE)
        launch_sum_rows(x, out, mean, block)
        want = torch.sum(x.double(), -1) / (cols if mean else 1)
        tol = sum_tolerance(x, -1, dtype) / (cols if mean else 1)
        assert not out.isnan().any()
        assert ((out.double() - want).abs() <= tol).all()


@given(rows=ROWS, cols=COLS, dtype=st.sampled_from([torch.float32, torch.float16]), block=BLOCKS,
       seed=st.integers(0, 2**31), m=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_kernel_rows_invariant_and_accurate(rows, cols, dtype, block, seed, m, n):
    check_kernel_case(rows, cols, dtype, block, seed, m, n)


@pytest.mark.gpu
@given(rows=ROWS, cols=COLS, block=BLOCKS, seed=st.integers(0, 2**31), m=st.integers(0, 10**6),
       n=st.integers(0, 10**6))
def test_kernel_rows_bf16(rows, cols, block, seed, m, n):
    check_kernel_case(rows, cols, torch.bfloat16, block, seed, m, n)


@given(cols=st.integers(1, 300), pad=st.integers(1, 700), dtype=st.sampled_from(KERNEL_DTYPES),
       block=BLOCKS, seed=st.integers(0, 2**31))
def test_appending_zeros_keeps_sum(cols, pad, dtype, block, seed):
    """Contract B: zeros appended to the reduced dim (possibly across block boundaries) change nothing."""
    x = rand((3, cols), dtype, seed)
    padded = torch.cat([x, torch.zeros(3, pad, dtype=dtype, device=DEVICE)], 1)
    assert torch.equal(sum_dim(x, 1, block_size=block), sum_dim(padded, 1, block_size=block))
    assert torch.equal(sum_dim_ref(x, 1, block_size=block), sum_dim_ref(padded, 1, block_size=block))


def test_default_block_long_rows():
    """Rows longer than the default block: bitwise equal to the reference, to slices, and zero padding."""
    cols = 2 * REDUCE_BLOCK + 123
    x = rand((3, cols), torch.float32, 7)
    out = sum_dim(x, -1)
    assert torch.equal(out, sum_dim_ref(x, -1))
    assert torch.equal(out[1:2], sum_dim(x[1:2], -1))
    padded = torch.cat([x, torch.zeros(3, REDUCE_BLOCK, device=DEVICE)], 1)
    assert torch.equal(out, sum_dim(padded, -1))
    assert torch.equal(mean_dim(x, -1), mean_dim_ref(x, -1))


def test_short_row_result_independent_of_block():
    """A row that fits in one block gives the same bits for every block >= its length."""
    x = rand((5, 100), torch.float32, 3)
    want = sum_dim(x, 1)
    for block in (128, 256, 1024, REDUCE_BLOCK):
        assert torch.equal(sum_dim(x, 1, block_size=block), want)


@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=3), data=st.data(),
       keepdim=st.booleans(), dtype=st.sampled_from(KERNEL_DTYPES), seed=st.integers(0, 2**31))
def test_dims_follow_torch_semantics(shape, data, keepdim, dtype, seed):
    """Any subset of dims (negative, empty list, None), keepdim: torch's shapes, reference's bits."""
    x = rand(shape, dtype, seed, scale=10.0)
    nd = len(shape)
    choice = data.draw(st.sampled_from(["none", "empty", "int", "list"]) if nd else st.just("none"))
    if choice == "none":
        dim = None
    elif choice == "empty":
        dim = []
    elif choice == "int":
        dim = data.draw(st.integers(-nd, nd - 1))
    else:
        dim = data.draw(st.lists(st.integers(0, nd - 1), unique=True, min_size=1)
                        .map(lambda ds: [d - nd if d % 2 else d for d in ds]))
    for fn, ref, stock in ((sum_dim, sum_dim_ref, torch.sum), (mean_dim, mean_dim_ref, torch.mean)):
        out = fn(x, dim, keepdim)
        all_dims = dim if dim is not None else list(range(nd))
        want = stock(x.double(), all_dims, keepdim)
        assert out.shape == want.shape and out.dtype == dtype
        assert torch.equal(out, ref(x, dim, keepdim))
        count = x.numel() // max(want.numel(), 1) if stock is torch.mean else 1
        tol = 1e-6 * x.double().abs().sum(all_dims, keepdim) / count + torch.finfo(dtype).eps * want.abs()
        assert ((out.double() - want).abs() <= tol).all()


def test_dtype_argument_casts_like_torch():
    x = rand((4, 50), torch.float16, 1)
    out = sum_dim(x, 1, dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, sum_dim(x.float(), 1))
    assert mean_dim(x, 1, dtype=torch.float32).dtype == torch.float32
    y = rand((4, 50), torch.float32, 2)
    assert torch.equal(sum_dim(y, 1, dtype=torch.float16), sum_dim(y.half(), 1))
    assert sum_dim_ref(x, 1, dtype=torch.float64).dtype == torch.float64


def test_empty_and_degenerate():
    assert torch.equal(sum_dim(torch.zeros(3, 0, device=DEVICE), 1), torch.zeros(3, device=DEVICE))
    assert mean_dim(torch.zeros(3, 0, device=DEVICE), 1).isnan().all()
    assert sum_dim(torch.zeros(0, 5, device=DEVICE), 1).shape == (0,)
    s = torch.tensor(2.5, device=DEVICE)
    assert torch.equal(sum_dim(s, 0), s) and sum_dim(s, -1, keepdim=True).shape == ()
    x = rand((2, 3, 4), torch.float32, 5).transpose(0, 2)  # non-contiguous input
    assert torch.equal(sum_dim(x, [0, 1]), sum_dim_ref(x.contiguous(), [0, 1]))


@given(rows=ROWS, cols=COLS, dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**31), m=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_ref_invariant_and_accurate(rows, cols, dtype, seed, m, n):
    x = rand((rows, cols), dtype, seed, device="cpu")
    for fn in (sum_dim_ref, mean_dim_ref):
        out = fn(x, 1)
        lo, hi = sorted((m % rows, n % rows + 1))
        hi = max(hi, lo + 1)
        assert torch.equal(out[lo:hi], fn(x[lo:hi], 1))
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    assert ((sum_dim_ref(x, 1).double() - x.double().sum(1)).abs() <= tol * x.double().abs().sum(1)).all()


def test_bad_inputs():
    x = rand((2, 3), torch.float32, 0)
    with pytest.raises(TypeError, match="associative"):
        sum_dim(torch.ones(2, 3, dtype=torch.int32, device=DEVICE), 1)
    with pytest.raises(TypeError, match="associative"):
        sum_dim_ref(torch.ones(2, 3, dtype=torch.int64), 1)
    with pytest.raises(IndexError, match="out of range"):
        sum_dim(x, 2)
    with pytest.raises(ValueError, match="more than once"):
        mean_dim(x, [1, -1])
    with pytest.raises(TypeError, match="dim must be"):
        sum_dim(x, 1.0)
    with pytest.raises(TypeError, match="float torch.dtype"):
        sum_dim(x, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="not supported"):
        sum_dim(x, 1, dtype=torch.float64)
    with pytest.raises(TypeError, match="not supported"):
        sum_dim(x.double(), 1)
    for bad in (0, 48, 31, 1 << 17, 64.0):
        with pytest.raises(ValueError, match="power of two"):
            sum_dim(x, 1, block_size=bad)
    with pytest.raises(TypeError, match="torch.Tensor"):
        sum_dim([1.0, 2.0], 0)


def test_cpu_tensor_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        sum_dim(torch.ones(2, 3), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_gpu_long_rows_batch_sizes(dtype):
    """Vocab-length rows at the default block: row 0's bits are the same in batches of 1..64 rows."""
    x = rand((64, 151936), dtype, 11, scale=1.0)
    want = sum_dim(x[:1], -1)
    for b in (2, 3, 17, 64):
        assert torch.equal(sum_dim(x[:b], -1)[:1], want)
    assert torch.equal(sum_dim(x, -1), sum_dim_ref(x, -1))


@pytest.mark.gpu
def test_negative_control_stock_sum_varies_with_batch():
    """Stock CUDA reductions split a long row across blocks when there are few rows, so the same row's
    sum changes bits with the batch it is in. If this ever stops failing for stock torch, the
    invariance tests above would not be able to tell a batch-variant kernel apart."""
    x = rand((64, 1 << 20), torch.float32, 13)
    results = {torch.sum(x[:b], -1)[0].item() for b in (1, 2, 4, 8, 64)}
    assert len(results) > 1, "stock torch.sum gave the same bits for every batch size"
    ours = {sum_dim(x[:b], -1)[0].item() for b in (1, 2, 4, 8, 64)}
    assert len(ours) == 1
