"""delta[t, h] = sum over head_dim of float(dout) * float(out): the attention backward's row term, one launch.

The torch form, `fold_sum(dout.float() * out.float(), -1)`, makes several passes over [T, Hq, D] (two casts
to fp32, the product, one pass per halving of D). This kernel reads each operand once and writes [T, Hq] fp32,
with the same bits: the products are rounded to fp32 as torch rounds them, and the row sum is `fold_sum`'s
order (repeatedly add the upper half of the row onto its lower half), written with reshape + split so no
reduction of Triton's own (whose order is the compiler's) is involved, and launched without fp fusion (an
fma of a product into the first fold's add would round once where torch rounds twice). Each row is independent of
every other, so the result is batch- and packing-invariant whatever the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._launch import check_kernel_inputs

__all__ = ["attention_delta"]

_ROWS_PER_PROGRAM = 64  # rows of [T * Hq] per program; no reduction crosses rows, so it fixes no order


@triton.jit
def _fold_halves(x):
    """[R, W] -> [R, W // 2]: column j + column W // 2 + j, one step of fold_sum."""
    pairs = tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1))  # [R, W // 2, (lower, upper)]
    lower, upper = tl.split(pairs)
    return lower + upper


@triton.jit
def _delta_kernel(do_ptr, o_ptr, delta_ptr, n_rows, num_heads, stride_dot, stride_doh, stride_ot, stride_oh,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    t = (rows // num_heads).to(tl.int64)
    h = rows % num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    do = tl.load(do_ptr + (t * stride_dot + h * stride_doh)[:, None] + offs_d[None, :], mask=ok[:, None],
                 other=0.0)
    o = tl.load(o_ptr + (t * stride_ot + h * stride_oh)[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
    x = do.to(tl.float32) * o.to(tl.float32)
    for _ in tl.static_range(HEAD_DIM.bit_length() - 1):  # log2(HEAD_DIM) halvings, down to one column
        x = _fold_halves(x)
    tl.store(delta_ptr + rows, tl.reshape(x, (ROWS,)), mask=ok)


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dout, out [T, H, D] (D a power of two, last dim contiguous) -> delta [T, H] fp32, bitwise equal to
    `fold_sum(dout.float() * out.float(), -1)`."""
    op = "attention_delta"
    check_kernel_inputs(op, dout, out)
    if dout.dim() != 3 or dout.shape != out.shape:
        raise ValueError(f"{op}: need dout and out of one shape [T, H, D], got {tuple(dout.shape)} and "
                         f"{tuple(out.shape)}")
    t, h, d = dout.shape
    if d < 1 or d & (d - 1):
        raise ValueError(f"{op}: head_dim must be a power of two, got {d}")
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    delta = torch.empty((t, h), dtype=torch.float32, device=dout.device)
    n_rows = t * h
    if n_rows == 0:
        return delta
    _delta_kernel[(triton.cdiv(n_rows, _ROWS_PER_PROGRAM),)](
        dout, out, delta, n_rows, h, dout.stride(0), dout.stride(1), out.stride(0), out.stride(1),
        ROWS=_ROWS_PER_PROGRAM, HEAD_DIM=d, num_warps=4, enable_fp_fusion=False)
    return delta
