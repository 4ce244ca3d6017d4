"""Batch-invariant sum / mean over any dims: Triton kernel `sum_dim`/`mean_dim`, pure-torch `*_ref`.

Reduction order (the same in the kernel and in the reference, so for float32 accumulation they agree
bit for bit):

1. The reduced dims are flattened, in their order in `x`, into one row of length N per output element.
2. The row is cut into blocks of `block_size` elements anchored at element 0 (default
   `REDUCE_BLOCK`, a constant; a row shorter than one block uses one block). Lane i of an fp32
   accumulator adds elements i, i + block, i + 2*block, ... in that order, starting from +0.
3. The lanes are combined by a pairwise fold: lane j += lane j + half, halving until one lane is left
   (`_fold.fold_sum`'s order).

Nothing in that order depends on the number of rows, the row's position, the launch's warps or the
device, so an output element never depends on the rest of the batch (contract A). Appending zeros to the
row adds exact zeros to lanes, or adds all-zero blocks, so the sum's bits do not change (contract B);
and a row of n <= block elements gives the same bits for any power-of-two block >= n (the fold of a
zero-padded lane vector equals the fold of the shorter one), which is why a short row may use a
smaller block without changing its result.

Integer inputs are rejected: integer addition (wrapping or not) is associative and commutative, so
stock `torch.sum` on integers is already batch-invariant and callers should use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import check_kernel_inputs, next_pow2

# Block of the lane accumulator for rows longer than one block. It fixes the summation order of long
# rows, so it is a constant (never derived from the batch or the row length). 4096 fp32 lanes = 16 per
# thread at 8 warps: enough independent 16-byte loads in flight per thread to stream HBM, few enough
# registers to keep several programs per SM. Same for every kernel dtype (they all accumulate in fp32).
REDUCE_BLOCK = 4096
# Smallest block used for short rows (one warp's worth of lanes); it cannot change a result (see above).
MIN_BLOCK = 32
# Elements per program: short rows are packed ROWS = TILE // block to a program (one launch does the work
# of many tiny programs). Rows never interact (every add is per lane or a fold of one row's lanes), so
# the packing is a pure speed choice and cannot change a row's bits.
TILE = 4096


def row_block(n: int, block_size: int) -> int:
    """The power-of-two block a row of n elements is processed in: `block_size`, or less for a short row.

    A row that fits in one block gives the same bits for every power-of-two block >= n (lanes past n
    stay 0 and the fold adds them exactly), so the smaller block changes speed, not results.
    """
    return max(MIN_BLOCK, min(block_size, next_pow2(n)))


def tile_for(n: int, block_size: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS per program, num_warps) for rows of n elements. Only BLOCK (through `block_size` for
    rows longer than it) shapes the order of additions; ROWS and warps are speed choices: 16 lanes per
    thread, 1..8 warps."""
    block = row_block(n, block_size)
    rows = max(1, TILE // block)
    return block, rows, max(1, min(8, rows * block // 512))


def check_block_size(op: str, block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < MIN_BLOCK \
            or block_size & (block_size - 1) or block_size > (1 << 16):
        raise ValueError(f"{op}: block_size must be a power of two in [{MIN_BLOCK}, 65536], "
                         f"got {block_size!r}")


@triton.jit
def fold_lanes(v, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """Sum each row of a [ROWS, BLOCK] tile in the fixed pairwise order v[j] + v[j + half], halving the
    lanes each step (`_fold.fold_sum`'s order). Each step splits the lanes into halves and adds them
    elementwise: one add per pair, so the order is fixed by BLOCK alone, not by the warp layout that a
    tl.sum tree would follow."""
    for i in tl.static_range(LOG2_BLOCK):
        lo, hi = tl.split(tl.permute(tl.reshape(v, [ROWS, 2, BLOCK >> (i + 1)]), (0, 2, 1)))
        v = lo + hi
    return tl.reshape(v, [ROWS])


@triton.jit
def _sum_rows_kernel(x_ptr, out_ptr, n_rows, n_cols, x_row_stride,
                     MEAN: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    x_rows = x_ptr + rows[:, None] * x_row_stride
    offs = tl.arange(0, BLOCK)[None, :]
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    # Full blocks with only the row mask (constant along a row, so loads still vectorize), then one
    # masked tail: same values, same order.
    n_full = n_cols - n_cols % BLOCK
    # 4 blocks a step: the 4 loads are issued before the first add, so a long row waits one memory
    # latency per 4 blocks; the adds still go block by block, as in the plain loop that follows.
    n_unrolled = n_cols - n_cols % (4 * BLOCK)
    for start in range(0, n_unrolled, 4 * BLOCK):
        x0 = tl.load(x_rows + start + offs, mask=row_ok[:, None], other=0.0)
        x1 = tl.load(x_rows + start + BLOCK + offs, mask=row_ok[:, None], other=0.0)
        x2 = tl.load(x_rows + start + 2 * BLOCK + offs, mask=row_ok[:, None], other=0.0)
        x3 = tl.load(x_rows + start + 3 * BLOCK + offs, mask=row_ok[:, None], other=0.0)
        acc += x0.to(tl.float32)
        acc += x1.to(tl.float32)
        acc += x2.to(tl.float32)
        acc += x3.to(tl.float32)
    for start in range(n_unrolled, n_full, BLOCK):
        acc += tl.load(x_rows + start + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if n_full < n_cols:
        tail = tl.load(x_rows + n_full + offs, mask=row_ok[:, None] & (n_full + offs < n_cols), other=0.0)
        acc += tail.to(tl.float32)
    total = fold_lanes(acc, ROWS, BLOCK, LOG2_BLOCK)
    if MEAN:
        # Correctly rounded division, as torch's mean = sum / N (the fast approximate `/` is not).
        total = tl.math.div_rn(total, tl.cast(n_cols, tl.float32))
    tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


def _normalize_dims(op: str, x: torch.Tensor, dim) -> list[int]:
    """torch's dim semantics for sum.dim_IntList / mean.dim: None or [] = all dims; negatives wrap."""
    nd = x.dim()
    if dim is None:
        return list(range(nd))
    dims = [dim] if isinstance(dim, int) else dim
    if not isinstance(dims, (list, tuple)) or any(isinstance(d, bool) or not isinstance(d, int)
                                                  for d in dims):
        raise TypeError(f"{op}: dim must be an int, a list/tuple of ints, or None; got {dim!r}")
    if len(dims) == 0:
        return list(range(nd))
    span = max(nd, 1)  # a 0-dim tensor accepts dim 0 and -1, as in torch
    out = []
    for d in dims:
        if not -span <= d < span:
            raise IndexError(f"{op}: dim {d} is out of range for a {nd}-dim tensor "
                             f"(allowed: [{-span}, {span - 1}])")
        d %= span
        if d in out:
            raise ValueError(f"{op}: dim {d} appears more than once in {dims!r}")
        out.append(d)
    return [d for d in out if d < nd]


def _as_rows(x: torch.Tensor, dims: list[int], keepdim: bool):
    """Move the reduced dims last (in their order in x) and view x as [rows, N]; plus the output shape."""
    kept = [d for d in range(x.dim()) if d not in dims]
    n_rows, n_cols = _numel([x.shape[d] for d in kept]), _numel([x.shape[d] for d in dims])
    # Reduced dims already last, in order (the usual mean(-1)): no permute view to build (same memory).
    trailing = dims == list(range(x.dim() - len(dims), x.dim()))
    rows = (x if trailing else x.permute([*kept, *dims])).reshape(n_rows, n_cols)
    if keepdim:
        out_shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
    else:
        out_shape = [x.shape[d] for d in kept]
    return rows, out_shape


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _prepare(op: str, x: torch.Tensor, dtype):
    """Validate, apply torch's `dtype=` (cast the input first) and pick the accumulation dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: dtype {x.dtype} is not a float dtype. Integer addition is associative, "
                        "so stock torch.sum is already batch-invariant for integers: use it")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{op}: dtype must be a float torch.dtype or None, got {dtype!r}")
        x = x.to(dtype)
    return x


def _sum_rows_ref(rows: torch.Tensor, acc_dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """The kernel's order in torch: per-lane sums over blocks, then the pairwise fold of the lanes."""
    n = rows.shape[-1]
    r = rows.to(acc_dtype)
    if n <= block_size:
        return fold_sum(r, -1)  # one block: equal to folding a zero-padded power-of-two lane vector
    n_blocks = -(-n // block_size)
    r = torch.nn.functional.pad(r, (0, n_blocks * block_size - n)).view(-1, n_blocks, block_size)
    acc = torch.zeros(r.shape[0], block_size, dtype=acc_dtype, device=r.device)
    for b in range(n_blocks):
        acc = acc + r[:, b]
    return fold_sum(acc, -1)


def _reduce_ref(op, x, dim, keepdim, dtype, mean, block_size):
    check_block_size(op, block_size)
    x = _prepare(op, x, dtype)
    dims = _normalize_dims(op, x, dim)
    rows, out_shape = _as_rows(x, dims, keepdim)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    total = _sum_rows_ref(rows, acc_dtype, block_size)
    if mean:
        # Divide by a tensor, not a Python number: CUDA torch turns `t / scalar` into t * (1 / scalar),
        # which rounds differently from the kernel's correctly rounded sum / N.
        total = total / torch.full_like(total, rows.shape[-1])
    return total.to(x.dtype).reshape(out_shape)


def sum_dim_ref(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None, *,
                block_size: int = REDUCE_BLOCK) -> torch.Tensor:
    """torch.sum(x, dim, keepdim, dtype=dtype) in the kernel's fixed order, in pure torch (any float dtype).

    Accumulates in fp32 (fp64 for fp64 input) and rounds to the output dtype once, like torch.
    """
    return _reduce_ref("sum_dim_ref", x, dim, keepdim, dtype, False, block_size)


def mean_dim_ref(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None, *,
                 block_size: int = REDUCE_BLOCK) -> torch.Tensor:
    """torch.mean(x, dim, keepdim, dtype=dtype) as (fixed-order sum) / N, in pure torch (any float dtype)."""
    return _reduce_ref("mean_dim_ref", x, dim, keepdim, dtype, True, block_size)


_LAUNCHES = LaunchCache(_sum_rows_kernel)


def launch_sum_rows(rows: torch.Tensor, out: torch.Tensor, mean: bool, block_size: int) -> torch.Tensor:
    """Reduce each row of rows [M, N] (unit inner stride) into out [M]. Outputs are preallocated so tests
    can poison them; `sum_dim`/`mean_dim` are the validated entry points."""
    m, n = rows.shape
    if m == 0:
        return out
    tensors = (rows, out)
    key = (m, n, rows.stride(0), mean, block_size, rows.dtype, out.dtype)  # fixes grid, scalars, constexprs
    if _LAUNCHES.try_launch(key, tensors):
        return out
    block, per_prog, warps = tile_for(n, block_size)
    _LAUNCHES.launch(key, tensors, (-(-m // per_prog),), (m, n, rows.stride(0)),
                     dict(MEAN=mean, ROWS=per_prog, BLOCK=block, LOG2_BLOCK=block.bit_length() - 1),
                     num_warps=warps, enable_fp_fusion=False)
    return out


def _reduce(op, x, dim, keepdim, dtype, mean, block_size):
    check_block_size(op, block_size)
    x = _prepare(op, x, dtype)
    check_kernel_inputs(op, x)
    dims = _normalize_dims(op, x, dim)
    rows, out_shape = _as_rows(x, dims, keepdim)
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    return launch_sum_rows(rows, out, mean, block_size).reshape(out_shape)


def sum_dim(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None, *,
            block_size: int = REDUCE_BLOCK) -> torch.Tensor:
    """Batch-invariant torch.sum(x, dim, keepdim, dtype=dtype) for fp16/bf16/fp32 (fp32 accumulation).

    dim: int, list/tuple of ints, or None / [] for all dims (torch semantics). `dtype` casts the input
    first, as torch does. Reducing dims that are not trailing costs a copy (the row must be contiguous).
    """
    return _reduce("sum_dim", x, dim, keepdim, dtype, False, block_size)


def mean_dim(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: torch.dtype | None = None, *,
             block_size: int = REDUCE_BLOCK) -> torch.Tensor:
    """Batch-invariant torch.mean(x, dim, keepdim, dtype=dtype): fixed-order sum / N, correctly rounded."""
    return _reduce("mean_dim", x, dim, keepdim, dtype, True, block_size)
