"""The MoE combine: out[t] = sum_r w[t, r] * y[t, r] in routing-rank order, one kernel instead of 4k launches.

    acc = w[t, 0] * y[t, 0];  acc = acc + w[t, r] * y[t, r]  for r = 1 .. k - 1;  out[t] = round(acc)

in fp32 (each slot's expert output y is already rounded to the model dtype; w is fp32), rounded once to the
model dtype. `combine_slots_ref` is that sentence in torch (elementwise ops; the CPU path, and fp64 with an
fp64 accumulator). `combine_slots` is one Triton program per (token, H block) evaluating the same
expressions: every product is rounded to fp32 and then added (`enable_fp_fusion=False`: an fma would round
once instead of twice, and torch's elementwise multiply and add do not fuse), so the kernel gives the
reference's bits (tests/kernels/test_moe_combine.py). Why a kernel: the reference is 4k elementwise launches
per MoE layer (k casts, k products, k - 1 sums, one cast: ~33 at top-8), each of a few microseconds at
decode sizes, in every one of a model's MoE layers.

A token's row depends only on its own slots, so the result is batch-invariant by construction; the H block
(`BLOCK_H`) only decides which program computes which columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._launch import KERNEL_DTYPES, check_kernel_inputs
from detinfer.kernels.matmul_ref import _acc_dtype

__all__ = ["combine_slots", "combine_slots_ref"]

# Columns per program: 1024 fp32 accumulators over 4 warps (8 per thread); H = 2048-8192 gives 2-8 programs
# per token. Any width gives the same bits (no reduction across columns).
BLOCK_H = 1024


def combine_slots_ref(weights: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weights [T, k] fp32, y [T, k, H] -> [T, H] `dtype`: the module doc's sum in torch (fp64 accumulator
    for fp64)."""
    acc_dt = _acc_dtype(dtype)
    acc = weights[:, 0, None].to(acc_dt) * y[:, 0].to(acc_dt)
    for r in range(1, y.shape[1]):
        acc = acc + weights[:, r, None].to(acc_dt) * y[:, r].to(acc_dt)
    return acc.to(dtype)


@triton.jit
def _combine_kernel(w_ptr, y_ptr, out_ptr, H, K_SLOTS, stride_wt, stride_yt, stride_yr, stride_ot,
                    BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    w_row = w_ptr + t * stride_wt
    y_row = y_ptr + t * stride_yt
    acc = tl.load(w_row).to(tl.float32) * tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
    for r in range(1, K_SLOTS):  # routing-rank order, one rounded product and one rounded sum per slot
        prod = tl.load(w_row + r).to(tl.float32) * tl.load(y_row + r * stride_yr + cols, mask=mask,
                                                            other=0.0).to(tl.float32)
        acc = acc + prod
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_slots(weights: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`combine_slots_ref`'s bits in one launch (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if weights.dim() != 2 or y.dim() != 3 or tuple(y.shape[:2]) != tuple(weights.shape):
        raise ValueError(f"combine_slots: weights must be [T, k] and y [T, k, H], got {tuple(weights.shape)} "
                         f"and {tuple(y.shape)}")
    if weights.dtype != torch.float32:
        raise TypeError(f"combine_slots: weights must be float32, got {weights.dtype}")
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"combine_slots: dtype must be one of {sorted(map(str, KERNEL_DTYPES))}, got {dtype}")
    check_kernel_inputs("combine_slots", y, dtypes=KERNEL_DTYPES)
    T, k, H = y.shape
    out = torch.empty(T, H, dtype=dtype, device=y.device)
    if T == 0 or H == 0:
        return out
    weights = weights.contiguous()
    y = y if y.stride(2) == 1 else y.contiguous()
    grid = (T, triton.cdiv(H, BLOCK_H))
    _combine_kernel[grid](weights, y, out, H, k, weights.stride(0), y.stride(0), y.stride(1), out.stride(0),
                          BLOCK_H=BLOCK_H, num_warps=4, enable_fp_fusion=False)
    return out
