"""Batch-invariant softmax / log_softmax: Triton kernels `softmax`/`log_softmax`, pure-torch `*_ref`.

Kernel (fp32 math, two passes over each row; a long row has a program to itself, short rows are packed
several to a program, and rows never interact):

* Pass 1 streams the row in blocks of `block_size` elements anchored at element 0 (default
  `SOFTMAX_BLOCK`, a constant) and keeps, per lane, an online (max m, sum s of exp(x - m)) pair:
  lane i sees elements i, i + block, ... in order. When a lane's max is unchanged its sum is scaled by
  exactly 1 (not by exp(0), which an approximate exp need not round to 1). At the end the lane sums
  are rescaled to the row max and combined with the fixed pairwise fold of `reduce.fold_lanes`.
* Pass 2 re-reads the row (a row of one block is kept in registers instead) and writes
  exp(x - max) * (1 / sum), or (x - max) - log(sum).

The order depends only on the block, so a row's bits never depend on the batch (contract A).
Appending -inf entries (a masked key) leaves every lane's (m, s) unchanged, or adds all-(-inf)
blocks that change nothing, so the other outputs keep their bits (contract B). The same holds when the
mask is torch.finfo(dtype).min added to the scores, as HF does: exp of it relative to the row max
underflows to exactly 0. A row that fits in one block gives the same bits for every power-of-two block
>= its length (lanes past the end hold (-inf, 0) and contribute exact zeros to the fold), so short rows
use a smaller block: that saves compute, never changes a result.

A fully masked row (all -inf) gives NaN, as torch does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import KERNEL_DTYPES, check_kernel_inputs
from detinfer.kernels.reduce import check_block_size, fold_lanes, tile_for

# Block of pass 1 for rows longer than one block; it fixes the order of the sum of a long row (vocab
# rows up to 256k elements), so it is a constant, never derived from the batch or the row length.
# 4096 lanes = 16 per thread at 8 warps: 2-4 vectorized 16-byte loads per thread in flight per block,
# and (m, s) state of 32 fp32 registers per thread. The same for every kernel dtype.
SOFTMAX_BLOCK = 4096


@triton.jit
def _online_update(m, s, x):
    """Merge block values x into the per-lane running (max, sum of exp(x - max))."""
    m_new = tl.maximum(m, x)
    # A lane that has only seen -inf keeps m = -inf; shift by 0 there so no -inf - -inf = NaN appears.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    # Unchanged max: scale by exactly 1, so blocks of masked entries leave s bit-identical.
    alpha = tl.where(m_new == m, 1.0, tl.exp(m - m_shift))
    return m_new, s * alpha + tl.exp(x - m_shift)


@triton.jit
def _write_block(x_rows, out_rows, start, offs, mask, row_max, row_shift, log_sum, inv_sum,
                 LOG: tl.constexpr):
    x = tl.load(x_rows + start + offs, mask=mask, other=0.0)
    y = _finish(x, row_max, row_shift, log_sum, inv_sum, LOG)
    tl.store(out_rows + start + offs, y.to(out_rows.dtype.element_ty), mask=mask)


@triton.jit
def _row_stats(m, s, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """Row max (and the shift used for exp), log(sum) and 1/sum from the per-lane (max, sum) pairs."""
    row_max = tl.max(m, axis=1)  # max is exact, so the tree order does not matter
    row_shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    # Lanes that only saw -inf (or masked entries whose exp underflowed) contribute exact zeros.
    row_sum = fold_lanes(s * tl.exp(m - row_shift[:, None]), ROWS, BLOCK, LOG2_BLOCK)
    return row_max, row_shift, tl.log(row_sum), tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), row_sum)


@triton.jit
def _finish(x, row_max, row_shift, log_sum, inv_sum, LOG: tl.constexpr):
    x = x.to(tl.float32)
    if LOG:
        return (x - row_max[:, None]) - log_sum[:, None]
    return tl.exp(x - row_shift[:, None]) * inv_sum[:, None]


@triton.jit
def _write_blocks4(x_rows, out_rows, start, offs, BLOCK: tl.constexpr, mask, row_max, row_shift, log_sum,
                   inv_sum, LOG: tl.constexpr):
    p0 = start + offs
    x0 = tl.load(x_rows + p0, mask=mask, other=0.0)
    x1 = tl.load(x_rows + p0 + BLOCK, mask=mask, other=0.0)
    x2 = tl.load(x_rows + p0 + 2 * BLOCK, mask=mask, other=0.0)
    x3 = tl.load(x_rows + p0 + 3 * BLOCK, mask=mask, other=0.0)
    ty = out_rows.dtype.element_ty
    tl.store(out_rows + p0, _finish(x0, row_max, row_shift, log_sum, inv_sum, LOG).to(ty), mask=mask)
    tl.store(out_rows + p0 + BLOCK, _finish(x1, row_max, row_shift, log_sum, inv_sum, LOG).to(ty), mask=mask)
    tl.store(out_rows + p0 + 2 * BLOCK, _finish(x2, row_max, row_shift, log_sum, inv_sum, LOG).to(ty),
             mask=mask)
    tl.store(out_rows + p0 + 3 * BLOCK, _finish(x3, row_max, row_shift, log_sum, inv_sum, LOG).to(ty),
             mask=mask)


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, n_rows, n_cols, x_row_stride, out_row_stride,
                    LOG: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr,
                    MULTI_BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    x_rows = x_ptr + rows[:, None] * x_row_stride
    out_rows = out_ptr + rows[:, None] * out_row_stride
    offs = tl.arange(0, BLOCK)[None, :]
    m = tl.full([ROWS, BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    if MULTI_BLOCK:
        # Full blocks with only the row mask (constant along a row, so accesses still vectorize), then
        # one masked tail: same values, same order.
        n_full = n_cols - n_cols % BLOCK
        tail_mask = row_ok[:, None] & (n_full + offs < n_cols)
        # 4 blocks a step: all 4 loads are issued before the first use, so a long row with few rows in
        # the batch waits one memory latency per 4 blocks, not per block. The updates still run block
        # by block in order, so the result is that of the plain loop that finishes the row.
        n_unrolled = n_cols - n_cols % (4 * BLOCK)
        for start in range(0, n_unrolled, 4 * BLOCK):
            x0 = tl.load(x_rows + start + offs, mask=row_ok[:, None], other=float("-inf"))
            x1 = tl.load(x_rows + start + BLOCK + offs, mask=row_ok[:, None], other=float("-inf"))
            x2 = tl.load(x_rows + start + 2 * BLOCK + offs, mask=row_ok[:, None], other=float("-inf"))
            x3 = tl.load(x_rows + start + 3 * BLOCK + offs, mask=row_ok[:, None], other=float("-inf"))
            m, s = _online_update(m, s, x0.to(tl.float32))
            m, s = _online_update(m, s, x1.to(tl.float32))
            m, s = _online_update(m, s, x2.to(tl.float32))
            m, s = _online_update(m, s, x3.to(tl.float32))
        for start in range(n_unrolled, n_full, BLOCK):
            x = tl.load(x_rows + start + offs, mask=row_ok[:, None], other=float("-inf"))
            m, s = _online_update(m, s, x.to(tl.float32))
        if n_full < n_cols:
            x = tl.load(x_rows + n_full + offs, mask=tail_mask, other=float("-inf"))
            m, s = _online_update(m, s, x.to(tl.float32))
        row_max, row_shift, log_sum, inv_sum = _row_stats(m, s, ROWS, BLOCK, LOG2_BLOCK)
        # Pass 2 has no loop-carried state; the same 4-block step overlaps the loads' latencies.
        for start in range(0, n_unrolled, 4 * BLOCK):
            _write_blocks4(x_rows, out_rows, start, offs, BLOCK, row_ok[:, None], row_max, row_shift,
                           log_sum, inv_sum, LOG)
        for start in range(n_unrolled, n_full, BLOCK):
            _write_block(x_rows, out_rows, start, offs, row_ok[:, None], row_max, row_shift, log_sum,
                         inv_sum, LOG)
        if n_full < n_cols:
            _write_block(x_rows, out_rows, n_full, offs, tail_mask, row_max, row_shift, log_sum,
                         inv_sum, LOG)
    else:
        # The row fits in one block: the same update as a tail block, and the row stays in registers
        # for pass 2 (one read instead of two; no loops compiled, so fewer registers).
        mask = row_ok[:, None] & (offs < n_cols)
        x = tl.load(x_rows + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m, s = _online_update(m, s, x)
        row_max, row_shift, log_sum, inv_sum = _row_stats(m, s, ROWS, BLOCK, LOG2_BLOCK)
        y = _finish(x, row_max, row_shift, log_sum, inv_sum, LOG)
        tl.store(out_rows + offs, y.to(out_rows.dtype.element_ty), mask=mask)


_LAUNCHES = LaunchCache(_softmax_kernel)


def launch_softmax_rows(rows: torch.Tensor, out: torch.Tensor, log: bool, block_size: int) -> torch.Tensor:
    """Softmax (or log_softmax) of each row of rows [M, N] into out [M, N] (both unit inner stride).
    Outputs are preallocated so tests can poison them; `softmax`/`log_softmax` are the entry points."""
    m, n = rows.shape
    if m == 0 or n == 0:
        return out
    tensors, strides = (rows, out), (rows.stride(0), out.stride(0))
    key = (m, n, strides, log, block_size, rows.dtype, out.dtype)  # fixes grid, scalars, constexprs
    if _LAUNCHES.try_launch(key, tensors):
        return out
    block, per_prog, warps = tile_for(n, block_size)
    # enable_fp_fusion=False: an fma of (s * exp) into the first fold step would make a short row's
    # result depend on its block (the fold step it lands in), breaking block independence.
    _LAUNCHES.launch(key, tensors, (-(-m // per_prog),), (m, n, *strides),
                     dict(LOG=log, ROWS=per_prog, BLOCK=block, LOG2_BLOCK=block.bit_length() - 1,
                          MULTI_BLOCK=n > block), num_warps=warps, enable_fp_fusion=False)
    return out


def _check_dim(op: str, x: torch.Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int, got {dim!r}")
    span = max(x.dim(), 1)
    if not -span <= dim < span:
        raise IndexError(f"{op}: dim {dim} is out of range for a {x.dim()}-dim tensor "
                         f"(allowed: [{-span}, {span - 1}])")
    return dim % span


def _cast_input(op: str, x: torch.Tensor, dtype) -> torch.Tensor:
    """torch's `dtype=`: the input is cast to `dtype` before the op. An upcast to fp32 is exact and the
    kernels compute in fp32 anyway, so only other casts are materialized."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: expected a float tensor, got dtype {x.dtype}")
    if dtype is None:
        return x
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{op}: dtype must be a float torch.dtype or None, got {dtype!r}")
    return x.to(dtype)


def _softmax(op, x, dim, dtype, log, block_size):
    check_block_size(op, block_size)
    if isinstance(x, torch.Tensor) and dtype == torch.float32 and x.dtype in KERNEL_DTYPES:
        out_dtype = dtype  # fp16/bf16 -> fp32 is exact: read the input as it is, write fp32
    else:
        x = _cast_input(op, x, dtype)
        out_dtype = x.dtype
    check_kernel_inputs(op, x)
    d = _check_dim(op, x, dim)
    xs = x.reshape(1) if x.dim() == 0 else x
    last = d == xs.dim() - 1  # the usual case: no movedim views to build (same memory, same rows)
    moved = xs if last else xs.movedim(d, -1)
    n = moved.shape[-1]
    rows = moved.reshape(math.prod(moved.shape[:-1]), n)
    if n > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    launch_softmax_rows(rows, out, log, block_size)
    if last:
        return out.reshape(x.shape)
    return out.reshape(moved.shape).movedim(-1, d).reshape(x.shape)


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None, *,
            block_size: int = SOFTMAX_BLOCK) -> torch.Tensor:
    """Batch-invariant torch.softmax(x, dim, dtype=dtype) for fp16/bf16/fp32 input (fp32 math).

    dtype: output dtype (the input is cast to it first, as torch does; fp16/bf16 in, fp32 out is the
    common case). A non-last `dim` is moved last, which costs a copy.
    """
    return _softmax("softmax", x, dim, dtype, False, block_size)


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None, *,
                block_size: int = SOFTMAX_BLOCK) -> torch.Tensor:
    """Batch-invariant torch.log_softmax(x, dim, dtype=dtype); same contract as `softmax`."""
    return _softmax("log_softmax", x, dim, dtype, True, block_size)


def _softmax_ref(op, x, dim, dtype, log):
    x = _cast_input(op, x, dtype)
    d = _check_dim(op, x, dim)
    xs = x.reshape(1) if x.dim() == 0 else x
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = xs.movedim(d, -1).to(acc)
    if v.shape[-1] == 0:
        return x.clone()
    row_max = v.amax(-1, keepdim=True)  # exact in any order
    shift = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    e = torch.exp(v - shift)
    row_sum = fold_sum(e, -1, keepdim=True)  # fixed pairwise order; masked entries add exact zeros
    y = (v - row_max) - torch.log(row_sum) if log else e / row_sum
    return y.to(x.dtype).movedim(-1, d).reshape(x.shape)


def softmax_ref(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.softmax in pure torch, batch-invariant by construction (any float dtype, fp64 included).

    Built from amax (exact), elementwise exp/sub/div and `fold_sum`; math in fp32 (fp64 for fp64 input).
    It relies on torch's elementwise exp/log giving an element the same bits wherever it sits in the
    tensor (true of the CPU and CUDA kernels; the tests check it through slicing).
    """
    return _softmax_ref("softmax_ref", x, dim, dtype, False)


def log_softmax_ref(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.log_softmax in pure torch: (x - max) - log(fold_sum(exp(x - max))); see `softmax_ref`."""
    return _softmax_ref("log_softmax_ref", x, dim, dtype, True)
