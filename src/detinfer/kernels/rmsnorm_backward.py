"""Backward of HF RMSNorm with an optional fused residual add (`rms_norm(x, w, eps, residual)`).

Forward: h = x + residual (or x), r = rsqrt(mean(h^2) + eps) in fp32, n = round(h * r), y = w * n.
Backward, per row (fp32): dn = dy * w; dh = r * dn - h * r^3 * sum(dn * h) / D, plus the gradient that
arrives on the returned residual stream h; dx = dresidual = dh. dw = sum over rows of dy * n.

Reference (`rms_norm_backward_ref`, any device, fp64 too): every reduction is a `fold_sum` (fixed pairwise
order): the row sums depend only on the row, and dw's sum over rows depends only on the row count.

Kernel (`rms_norm_backward`, CUDA, or CPU under TRITON_INTERPRET=1): one program per block of `ROWS_PER_DW`
rows, walking its rows one at a time; each row sits in registers as one power-of-two block of D, so its
two row sums (sum(h^2), sum(dn * h)) are `tl.sum`s whose tree the compiled layout fixes, and the layout
(block, warps) is a function of D alone: a row's dx bits never depend on the other rows or on where the
row sits. dw: each program adds its rows' dy * n into an fp32 register row in row order and writes that
partial to [ceil(M / ROWS_PER_DW), D]; the partials are then summed by `fold_sum` over the blocks (pairwise
tree), so dw's bits are a function of the row count only and two runs are bitwise equal. The bits differ
from the reference's (a different summation tree), not its accuracy.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import check_kernel_inputs, next_pow2
from detinfer.kernels.rmsnorm import MAX_D

__all__ = ["ROWS_PER_DW", "rms_norm_backward", "rms_norm_backward_ref"]

# Rows per program and per dw partial: a constant, so dw's summation order is a function of the row count
# only. 16 rows keep the partials small (M / 16 rows of fp32) and still give a full GPU of programs at
# training's token counts.
ROWS_PER_DW = 16


def _warps_for(block_d: int) -> int:
    """From D alone (fixes the row sums' tree): ~8 fp32 values per thread and tensor, 1..16 warps."""
    return max(1, min(16, block_d // 256))


@triton.jit
def _rms_norm_backward_kernel(dy_ptr, dh_ptr, x_ptr, res_ptr, w_ptr, dx_ptr, dres_ptr, dwp_ptr,
                              M, D, eps, dy_st, dh_st, x_st, res_st, dx_st, dres_st,
                              HAS_DH: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    block = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        dw_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # the block's rows in ascending order (int32 loop bounds: M < 2**31 rows)
    for i in range(tl.minimum(M - block * ROWS, ROWS)):
        row = block.to(tl.int64) * ROWS + i
        x = tl.load(x_ptr + row * x_st + cols, mask=ok, other=0.0)
        if HAS_RES:
            # the forward's add in model dtype: one fp32 add rounded to x.dtype
            res = tl.load(res_ptr + row * res_st + cols, mask=ok, other=0.0)
            h = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            h = x.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        dy = tl.load(dy_ptr + row * dy_st + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            n = (h * r).to(x_ptr.dtype.element_ty).to(tl.float32)
            dw_acc += dy * n
            dn = dy * w
        else:
            dn = dy
        dot = tl.sum(dn * h, axis=0) / D
        dh = r * dn - h * (r * r * r) * dot
        if HAS_DH:
            dh += tl.load(dh_ptr + row * dh_st + cols, mask=ok, other=0.0).to(tl.float32)
        dx = dh.to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + row * dx_st + cols, dx, mask=ok)
        if HAS_RES:
            tl.store(dres_ptr + row * dres_st + cols, dx, mask=ok)
    if HAS_W:
        tl.store(dwp_ptr + block.to(tl.int64) * D + cols, dw_acc, mask=ok)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    rows = t.reshape(math.prod(t.shape[:-1]), d)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _validate(op, dy, dh_out, x, residual, weight) -> None:
    for name, t in (("dy", dy), ("x", x)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: x must have shape [..., D] with D >= 1, got {tuple(x.shape)}")
    for name, t in (("dy", dy), ("dh_out", dh_out), ("residual", residual)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{op}: {name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"{op}: weight must have shape [D] = [{x.shape[-1]}], got {tuple(weight.shape)}")
    if x.shape[-1] > MAX_D:
        raise ValueError(f"{op}: D = {x.shape[-1]} exceeds the kernel's maximum {MAX_D}; use "
                         "rms_norm_backward_ref")


def rms_norm_backward(dy: torch.Tensor, dh_out: torch.Tensor | None, x: torch.Tensor,
                      residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float):
    """The Triton kernel; the reference's signature and results (dx, dresidual or None, dw fp32 [D] or
    None) for x of fp16/bf16/fp32 with D <= MAX_D."""
    op = "rms_norm_backward"
    _validate(op, dy, dh_out, x, residual, weight)
    check_kernel_inputs(op, dy, dh_out, x, residual, weight)
    d = x.shape[-1]
    x2, dy2 = _rows(x, d), _rows(dy, d)
    m = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dres = torch.empty_like(dx) if residual is not None else None
    blocks = triton.cdiv(m, ROWS_PER_DW)
    dw_parts = torch.empty((blocks, d), dtype=torch.float32, device=x.device) if weight is not None else None
    if m > 0:
        r2 = _rows(residual, d) if residual is not None else x2
        dh2 = _rows(dh_out, d) if dh_out is not None else dy2
        w = weight.contiguous() if weight is not None else x2  # unused pointer when HAS_W is False
        dx2, dres2 = dx.view(-1, d), (dres if dres is not None else dx).view(-1, d)
        block_d = next_pow2(d)
        # no fma contraction: the reference's (and the interpreter's) separate roundings
        _rms_norm_backward_kernel[(blocks,)](
            dy2, dh2, x2, r2, w, dx2, dres2, dw_parts if dw_parts is not None else dx2,
            m, d, float(eps), dy2.stride(0), dh2.stride(0), x2.stride(0), r2.stride(0), dx2.stride(0),
            dres2.stride(0), HAS_DH=dh_out is not None, HAS_RES=residual is not None,
            HAS_W=weight is not None, ROWS=ROWS_PER_DW, BLOCK_D=block_d, num_warps=_warps_for(block_d),
            enable_fp_fusion=False)
    dw = fold_sum(dw_parts, 0) if dw_parts is not None else None
    return dx, dres, dw


def rms_norm_backward_ref(dy: torch.Tensor, dh_out: torch.Tensor | None, x: torch.Tensor,
                          residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float):
    """-> (dx in x.dtype, dresidual (same tensor, or None without residual), dw fp32 [D] or None).

    dy: gradient of y (any shape [..., D]); dh_out: gradient of the returned h (None if unused)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = x.shape[-1]
    h = x if residual is None else x + residual  # same rounding as the forward's add
    hf = h.to(acc).reshape(-1, d)
    r = torch.rsqrt(fold_sum(hf * hf, -1, keepdim=True) / d + eps)
    dyf = dy.to(acc).reshape(-1, d)
    dw = None
    if weight is not None:
        n = (hf * r).to(x.dtype).to(acc)
        dw = fold_sum(dyf * n, 0)
        dn = dyf * weight.to(acc)
    else:
        dn = dyf
    dot = fold_sum(dn * hf, -1, keepdim=True) / d
    dh = r * dn - hf * (r * r * r) * dot
    if dh_out is not None:
        dh = dh + dh_out.to(acc).reshape(-1, d)
    dx = dh.to(x.dtype).reshape(x.shape)
    # a separate tensor for the residual input: autograd may accumulate into one of them in place
    return dx, (dx.clone() if residual is not None else None), dw

