"""Backward of `linear` (y = x @ W^T + b): dX, dW, db, each with a fixed reduction order.

dX = dY @ W goes through the invariant `matmul` (reduction over the output features N, one row of dY per
row of dX), so a token's dX bits do not depend on the other tokens. dW = dY^T @ X and db = sum_t dY
reduce over tokens: `weight_grad` walks the tokens upward from t = 0 in constant blocks of
`BLOCK_T` into one fp32 accumulator per output element (no split-K, no atomics), so the order of the
additions is a function of the token count only, and two identical steps give identical bits. dW and db
come back in fp32 (the gradient dtype of bf16 parameters with fp32 grads); the caller casts if it wants.

`linear_backward_ref` is the pure-torch path (CPU, fp64): the `*_ref` matmuls and `fold_sum`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detinfer.kernels import matmul as mm
from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import KERNEL_DTYPES, check_kernel_inputs, dot_precision
from detinfer.kernels.matmul_ref import REF_BLOCK_K, _ref_bnk

__all__ = ["BLOCK_T", "TOKEN_CHUNK_MULTIPLE", "bias_grad", "linear_backward", "linear_backward_ref", "matmul_det",
           "use_triton", "weight_grad", "weight_grad_ref"]

# Tokens per reduction step of dW: fixes the order of the fp32 additions, so a constant of the kernel
# (never derived from the batch or the token count).
BLOCK_T = 64
# Token chunks that continue one dW accumulator (`out=`) must have lengths that are multiples of this, on
# both paths (the kernel's BLOCK_T and the reference's K block), to give the bits of one unchunked call.
TOKEN_CHUNK_MULTIPLE = math.lcm(BLOCK_T, REF_BLOCK_K)


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Triton kernels for CUDA tensors of kernel dtypes; everything else (CPU, fp64) takes the refs."""
    return all(t is None or (t.is_cuda and t.dtype in KERNEL_DTYPES) for t in tensors)


def matmul_det(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] (or batched [B, M, K] @ [B, K, N]) with the invariant matmul: Triton on CUDA,
    the fold-based reference elsewhere. Output in a's dtype."""
    if a.dim() == 3:
        return (mm.bmm if use_triton(a, b) else mm.bmm_ref)(a, b)
    return (mm.matmul if use_triton(a, b) else mm.matmul_ref)(a, b)


@triton.jit
def _dw_tile(pid, N, K, stride_dwn, stride_dwk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_N: tl.constexpr):
    """dW tile `pid` in grouped launch order (GROUP_N consecutive n-tiles share each k-tile, so the dY and X
    column strips that programs running at the same time read are shared through L2; without it, a
    151936-row lm_head dW re-reads all of dY from HBM once per k-tile) -> (tile row, tile column, n offsets,
    k offsets, mask, dW element offsets). Decides only which program computes which tile."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_N * num_k
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_k = (pid % per_group) // group_size
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    return pid_n, pid_k, offs_n, offs_k, mask, offs_n[:, None].to(tl.int64) * stride_dwn + offs_k[None, :] * stride_dwk


@triton.jit
def _weight_grad_kernel(dy_ptr, x_ptr, dw_ptr, T, N, K, stride_dyt, stride_dyn, stride_xt, stride_xk,
                        stride_dwn, stride_dwk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr, PRECISION: tl.constexpr,
                        ACCUMULATE: tl.constexpr):
    """One program per BLOCK_N x BLOCK_K tile of dW (`_dw_tile`'s launch order); tokens in ascending
    BLOCK_T steps, one accumulator."""
    _, _, offs_n, offs_k, mask, dw_offs = _dw_tile(tl.program_id(0), N, K, stride_dwn, stride_dwk, BLOCK_N,
                                                   BLOCK_K, GROUP_N)
    dw_ptrs = dw_ptr + dw_offs
    offs_t = tl.arange(0, BLOCK_T)
    if ACCUMULATE:  # continue an earlier call's token walk from its stored fp32 accumulator
        acc = tl.load(dw_ptrs, mask=mask, other=0.0)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs_t
        # [BT, BN] tile read along rows (coalesced), transposed in registers / shared memory
        dy = tl.load(dy_ptr + t[:, None].to(tl.int64) * stride_dyt + offs_n[None, :] * stride_dyn,
                     mask=(t[:, None] < T) & (offs_n[None, :] < N), other=0.0)
        xt = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + offs_k[None, :] * stride_xk,
                     mask=(t[:, None] < T) & (offs_k[None, :] < K), other=0.0)  # [BT, BK]
        acc = tl.dot(tl.trans(dy), xt, acc, input_precision=PRECISION)
    tl.store(dw_ptrs, acc, mask=mask)


@triton.jit
def _weight_grad_tma_kernel(dy_desc, x_desc, dw_ptr, T, N, K, stride_dwn, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr,
                            PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr):
    """`_weight_grad_kernel`'s tiles and token walk, dY and X strips fetched by the TMA engine from
    descriptors of dY [T, N] and X [T, K]: boxes past T read as zeros, whose products add nothing."""
    pid_n, pid_k, _, _, mask, dw_offs = _dw_tile(tl.program_id(0), N, K, stride_dwn, 1, BLOCK_N, BLOCK_K,
                                                 GROUP_N)
    dw_ptrs = dw_ptr + dw_offs
    if ACCUMULATE:
        acc = tl.load(dw_ptrs, mask=mask, other=0.0)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        dy = dy_desc.load([t0, pid_n * BLOCK_N])  # [BT, BN]
        xt = x_desc.load([t0, pid_k * BLOCK_K])  # [BT, BK]
        acc = tl.dot(dy.T, xt, acc, input_precision=PRECISION)
    tl.store(dw_ptrs, acc, mask=mask)


def _check_accumulator(op: str, out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
                       device: torch.device) -> None:
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or out.device != device
                            or not out.is_contiguous()):
        raise ValueError(f"{op}: out must be a contiguous {shape} {dtype} tensor on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")


def weight_grad(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
                tma: bool | None = None) -> torch.Tensor:
    """dW [N, K] fp32 = dy[T, N]^T @ x[T, K], tokens reduced in ascending blocks of BLOCK_T (Triton).

    `out`: an fp32 dW to continue instead of starting from zeros (updated in place and returned). Calls
    over consecutive token chunks whose lengths (all but the last) are multiples of BLOCK_T give the bits
    of one call over all the tokens: the same blocks, added into the same accumulator in the same order.
    `tma` forces the descriptor kernel on or off (tests; default: on for 16-bit operands that qualify).
    Both kernels chain every token block's products into one accumulator in ascending token order, so
    their bits are equal whatever the tile shape (asserted on the GPU)."""
    check_kernel_inputs("weight_grad", dy, x)
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0] or dy.dtype != x.dtype:
        raise ValueError(f"weight_grad: need dy [T, N] and x [T, K] of one dtype, got {tuple(dy.shape)} "
                         f"{dy.dtype} and {tuple(x.shape)} {x.dtype}")
    t, n = dy.shape
    k = x.shape[1]
    _check_accumulator("weight_grad", out, (n, k), torch.float32, dy.device)
    dw = torch.empty((n, k), dtype=torch.float32, device=dy.device) if out is None else out
    if n == 0 or k == 0:
        return dw
    if tma is None:
        tma = t > 0 and dy.dtype != torch.float32 and _tma_operands(dy, x)
    elif tma:
        _check_descriptors(dy, x)
    _launch_weight_grad(dy, x, dw, out is not None, tma)
    return dw


# The descriptor kernel's tile: 128 x 256 outputs, 8 warps, 3 stages (H100, Qwen3-8B shapes, T = 8192:
# 0.81-1.07x cuBLAS against 0.61-0.70x for the pointer kernel's 128 x 128; docs/performance.md). A
# function of nothing but the dtype class; the pointer kernel keeps 128 x 128 (64 x 64 for fp32).
TMA_TILE = dict(BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=3)


def _tma_operands(dy: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether 16-bit dY [T, N] and X [T, K] qualify for TMA descriptors (Hopper+, unit stride along N and
    K, 16-byte aligned rows and bases)."""
    return mm.TensorDescriptor is not None and mm._tma_ok(dy, dy.stride(0), dy.stride(1), x, x.stride(0),
                                                          x.stride(1), x.shape[1])


def _check_descriptors(dy: torch.Tensor, x: torch.Tensor) -> None:
    """A forced descriptor launch (`tma=True`) on operands TMA cannot describe: say what is wrong."""
    es = dy.element_size()
    rows_ok = all(t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (dy, x))
    if mm.TensorDescriptor is None or dy.shape[0] == 0 or not rows_ok:
        raise ValueError("weight_grad(tma=True): needs a triton with TMA descriptors, T > 0, and dy, x with unit "
                         "column stride and 16-byte aligned rows and base pointers")


def _launch_weight_grad(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, accumulate: bool, tma: bool) -> None:
    t, n = dy.shape
    k = x.shape[1]
    precision = dot_precision(dy.dtype)
    if tma:
        bn, bk = TMA_TILE["BLOCK_N"], TMA_TILE["BLOCK_K"]
        dy_desc = mm.TensorDescriptor(dy, [t, n], [dy.stride(0), 1], [BLOCK_T, bn])
        x_desc = mm.TensorDescriptor(x, [t, k], [x.stride(0), 1], [BLOCK_T, bk])
        grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk),)
        _weight_grad_tma_kernel[grid](dy_desc, x_desc, dw, t, n, k, dw.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                      BLOCK_T=BLOCK_T, GROUP_N=8, PRECISION=precision, ACCUMULATE=accumulate,
                                      num_warps=TMA_TILE["num_warps"], num_stages=TMA_TILE["num_stages"])
        return
    # Tile shape: a function of the dtype only (speed); it never changes the per-element order.
    bn, bk = (64, 64) if dy.dtype == torch.float32 else (128, 128)
    grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    _weight_grad_kernel[grid](dy, x, dw, t, n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                              dw.stride(0), dw.stride(1), BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=BLOCK_T, GROUP_N=8,
                              PRECISION=precision, ACCUMULATE=accumulate,
                              num_warps=8 if bn * bk >= 128 * 128 else 4, num_stages=3)


def weight_grad_ref(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight_grad` in pure torch: the fold-based matmul over tokens (fp32 accumulation; fp64 for fp64).

    `out` as in `weight_grad` (chunks: multiples of TOKEN_CHUNK_MULTIPLE)."""
    acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
    if out is None:
        return mm.matmul_ref(dy.t().to(acc), x.to(acc))
    _check_accumulator("weight_grad_ref", out, (dy.shape[1], x.shape[1]), acc, dy.device)
    _ref_bnk(dy.t().to(acc).unsqueeze(0), x.t().to(acc).unsqueeze(0), None, acc=out.unsqueeze(0))
    return out


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """db [N] = sum over tokens of dy [T, N], a fixed pairwise fold in fp32 (fp64 for fp64)."""
    acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
    return fold_sum(dy.to(acc), 0)


def linear_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                    dw_out: torch.Tensor | None = None):
    """(dx [..., K] in x.dtype, dW [N, K] fp32, db [N] fp32 or None) for y = linear(x, weight, bias).
    `dw_out`: a dW of earlier tokens to continue (see `weight_grad`'s `out`)."""
    n, k = weight.shape
    dy2, x2 = dy.reshape(-1, n), x.reshape(-1, k)
    if not use_triton(dy2, x2, weight):
        return linear_backward_ref(dy, x, weight, has_bias, dw_out)
    dx = matmul_det(dy2, weight.to(dy2.dtype)).reshape(x.shape).to(x.dtype)
    dw = weight_grad(dy2, x2.to(dy2.dtype), out=dw_out)
    return dx, dw, (bias_grad(dy2) if has_bias else None)


def linear_backward_ref(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                        dw_out: torch.Tensor | None = None):
    """`linear_backward` in pure torch (any float dtype): fold-based matmuls in fixed order."""
    n, k = weight.shape
    dy2, x2 = dy.reshape(-1, n), x.reshape(-1, k).to(dy.dtype)
    dx = mm.matmul_ref(dy2, weight.to(dy2.dtype)).reshape(x.shape).to(x.dtype)
    return dx, weight_grad_ref(dy2, x2, out=dw_out), (bias_grad(dy2) if has_bias else None)
