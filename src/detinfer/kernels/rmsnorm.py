"""Batch-invariant RMSNorm (HF Llama semantics), optionally fused with the residual add.

Semantics, exactly HF's LlamaRMSNorm (and the residual add before it, done in model dtype):

    h = x                      or  h = (x + residual) rounded to x.dtype
    var = mean(h.float() ** 2)
    y = (h.float() * rsqrt(var + eps)).to(x.dtype)
    y = weight * y             (torch dtype promotion of weight and x; weight is optional)

Kernel: the whole row (hidden size D, at most `MAX_D`) sits in registers as one power-of-two block, so
the sum of squares is one `tl.sum` whose tree is fixed by the compiled layout. Everything that shapes
that layout (block, rows per program, warps) is derived from D alone, never from the number of rows,
so a row's bits do not depend on the batch (contract A). Short rows (e.g. Qwen3's per-head norm,
D = 128) are packed several to a program; each row of the tile is reduced along its own axis with the
same per-row tree whatever its position in the tile. The residual variant is the same kernel with the
sum of x and residual rounded to x.dtype before anything else, so its y is bit-identical to
rms_norm(round(x + residual)) without residual (contract C).
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import check_kernel_inputs
from detinfer.kernels._pdl import launch_options, pdl_start, use_pdl

# Largest hidden size: the row is held in registers (64 fp32 values per thread at 16 warps at most).
MAX_D = 1 << 15
# Elements per program for short rows: several rows per program amortize the per-program cost when D
# is small (128-element head norms), and 2048 elements keep 4-16 values per thread.
_TILE = 2048


def _layout_for(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS per program, num_warps), all from D alone: they fix the reduction tree."""
    block_d = max(16, 1 << (d - 1).bit_length())
    rows = max(1, _TILE // block_d)
    # ~8 elements (16 bytes of bf16) per thread per row-chunk, 1..16 warps.
    warps = max(1, min(16, rows * block_d // 256))
    return block_d, rows, warps


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, n_rows, D, eps,
                     x_stride, res_stride, y_stride, h_stride,
                     HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    rms_norm_tile(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, tl.program_id(0), n_rows, D, eps,
                  x_stride, res_stride, y_stride, h_stride, HAS_RES, HAS_W, ROWS, BLOCK_D)


@triton.jit
def rms_norm_tile(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, tile, n_rows, D, eps,
                  x_stride, res_stride, y_stride, h_stride,
                  HAS_RES: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [tile ROWS, (tile + 1) ROWS): the whole norm, from x in memory. Shared with the kernel that first
    sums x across two GPUs (`kernels.peer_sum_norm`): the same code and constexprs give the same layouts,
    hence the same reduction tree and bits."""
    rows, cols, mask, y = rms_norm_values(x_ptr, res_ptr, w_ptr, h_ptr, tile, n_rows, D, eps, x_stride,
                                          res_stride, h_stride, HAS_RES, HAS_W, ROWS, BLOCK_D)
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_values(x_ptr, res_ptr, w_ptr, h_ptr, tile, n_rows, D, eps, x_stride, res_stride, h_stride,
                    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """`rms_norm_tile` up to the store of y: (rows, cols, mask, y before its cast to the output dtype); h is
    stored. Also the front of the norm that quantizes its output for an FP8 linear (kernels/fp8_act_quant.py)."""
    rows = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        # HF adds the residual in model dtype: one fp32 add rounded to x.dtype (what torch does).
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * h_stride + cols[None, :], h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=1) / D
    rstd = tl.math.rsqrt(var + eps)
    y = (hf * rstd[:, None]).to(x_ptr.dtype.element_ty)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
        y = w.to(tl.float32)[None, :] * y.to(tl.float32)
    return rows, cols, mask, y


_LAUNCHES = LaunchCache(_rms_norm_kernel)


def _validate(op: str, x, weight, eps, residual) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dim [..., D], got a 0-dim tensor")
    if not x.is_floating_point():
        raise TypeError(f"{op}: x must be a float tensor, got dtype {x.dtype}")
    d = x.shape[-1]
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{op}: weight must be a torch.Tensor or None, got {type(weight).__name__}")
        if weight.dim() != 1 or weight.shape[0] != d:
            raise ValueError(f"{op}: weight must have shape [D] = [{d}] (D = x.shape[-1]), "
                             f"got {tuple(weight.shape)}")
        if not weight.is_floating_point():
            raise TypeError(f"{op}: weight must be a float tensor, got dtype {weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite real number >= 0, got {eps!r}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{op}: residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual shape {tuple(residual.shape)} must equal x shape "
                             f"{tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual dtype {residual.dtype} must equal x dtype {x.dtype} "
                            "(the residual add is done in model dtype)")
    return d


def _out_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    return x.dtype if weight is None else torch.promote_types(weight.dtype, x.dtype)


def _rows_view(t: torch.Tensor, d: int) -> torch.Tensor:
    rows = t.reshape(math.prod(t.shape[:-1]), d)
    return rows if d <= 1 or rows.stride(-1) == 1 else rows.contiguous()


def launch_rms_norm_rows(x: torch.Tensor, weight, eps: float, residual, y: torch.Tensor,
                         h: torch.Tensor | None) -> None:
    """Run the kernel on x/residual [M, D] (unit inner stride) into preallocated y (and h) [M, D].
    Outputs are preallocated so tests can poison them; `rms_norm` is the validated entry point."""
    m, d = x.shape
    if m == 0 or d == 0:
        return
    res = residual if residual is not None else x  # unused pointer when HAS_RES is False
    hh = h if h is not None else y
    tensors = (x, res, weight if weight is not None else x, y, hh)
    strides = (x.stride(0), res.stride(0), y.stride(0), hh.stride(0))
    has_res, has_w = residual is not None, weight is not None
    # The key fixes the grid, every scalar and constexpr (eps is part of it) and the dtypes.
    pdl = use_pdl(x.device)
    key = (m, d, eps, strides, has_res, has_w, x.dtype, y.dtype, tensors[2].dtype, pdl)
    if _LAUNCHES.try_launch(key, tensors):
        return
    block_d, rows, warps = _layout_for(d)
    # No fma contraction: keeps the arithmetic the same plain mul/add sequence in both the residual
    # and plain variants (contract C) and in HF's unfused formula.
    _LAUNCHES.launch(key, tensors, (-(-m // rows),), (m, d, float(eps), *strides),
                     dict(HAS_RES=has_res, HAS_W=has_w, ROWS=rows, BLOCK_D=block_d, USE_PDL=pdl),
                     num_warps=warps, enable_fp_fusion=False, **launch_options(pdl))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None):
    """Batch-invariant HF RMSNorm over the last dim of x [..., D] (fp16/bf16/fp32, D <= MAX_D).

    Returns y, or (y, h) with h = round(x + residual) when `residual` is given (the fused add-norm of
    Llama/Qwen blocks: h is the new residual stream). y has dtype promote(weight.dtype, x.dtype).
    """
    d = _validate("rms_norm", x, weight, eps, residual)
    check_kernel_inputs("rms_norm", x, weight, residual)
    if d > MAX_D:
        raise ValueError(f"rms_norm: D = {d} exceeds the kernel's maximum hidden size {MAX_D}; "
                         "use rms_norm_ref")
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    x2 = _rows_view(x, d)
    r2 = _rows_view(residual, d) if residual is not None else None
    y = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    launch_rms_norm_rows(x2, weight, eps, r2, y.view(-1, d) if d else y,
                         h.view(-1, d) if h is not None and d else h)
    return y if residual is None else (y, h)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None = None):
    """HF RMSNorm in pure torch, batch-invariant by construction (any float dtype, fp64 included).

    The sum of squares is `fold_sum` (fixed pairwise order); everything else is elementwise. Math in
    fp32 as HF does (fp64 for fp64 input, so the function doubles as an accuracy reference).
    """
    _validate("rms_norm_ref", x, weight, eps, residual)
    h = x if residual is None else x + residual
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    hf = h.to(acc)
    var = fold_sum(hf * hf, -1, keepdim=True) / x.shape[-1]
    y = (hf * torch.rsqrt(var + eps)).to(x.dtype)
    if weight is not None:
        y = weight * y
    return y if residual is None else (y, h)
