"""The SwiGLU MLP's gate_up projection over a block-scaled FP8 weight with SiLU*mul in its epilogue: one
launch instead of `linear_fp8` then `silu_mul` (the FP8 twin of kernels/linear_silu_mul.py).

    out[M, I] = silu_mul(gate, up),   (gate, up) = linear_fp8(x, W_q, W_scale, b).split(I, -1)

W_q is the fused [2I, K] float8_e4m3fn gate_up weight (gate rows, then up rows) with its per-row block scales
[2I, ceil(K/128)] (kernels/fp8_quant.py); x is quantized per token per 128-wide group along K by the same
launch `linear_fp8` uses (kernels/fp8_tiles.py: a row's scales depend on that row only). A program owns a
BLOCK_M x BLOCK_N tile of output columns j and two fp32 accumulators, gate (rows j of W) and up (rows I + j),
each fed exactly as kernels/fp8_linear.py's kernel feeds its one: in each of the weight's K runs (`k_runs(2I,
K)`, all walked by the one program), for each 128-wide K block in ascending order, a fresh fp32 fp8 dot of
that block alone, times the row's activation scale, times the column's weight scale, added; the runs' sums
added in run order. The epilogue is kernels/linear_silu_mul.py's (`_store_swiglu`): bias in fp32 after the
reduction, rounded to the output dtype (what `linear_fp8` stores), back to fp32, then silu_mul's formula
(`silu_mul.silu_mul_values`, the one spelling).

Config: `linear_fp8`'s for the fused [2I, K] weight (`fp8_linear.kernel_config(2I, K)`), per accumulator
(pipelined at most 3 deep: a stage holds two weight tiles): from (N, K) only, never from M, so every row of
every batch runs the same instruction sequence, and each accumulator's fp8 dots have the plain kernel's tile
shapes (BLOCK_M x BLOCK_N x 128).

Bits: batch-invariant on its own (a row's activation scales and reduction depend on that row only; the tile
config does not depend on M), which is what deterministic mode relies on: the backend runs this launch for
every FP8 gate_up on CUDA whatever the batch. That the bits also equal the two launches' (same dot shapes,
same K order, same epilogue) is asserted on the GPU in tests/kernels/test_fp8_linear_silu_mul.py, as the
16-bit kernel's is; the tensor cores' fp8 accumulation is not documented exact, so against the float
reference (`linear_fp8_silu_mul_ref`) the kernel is compared by tolerance. GPU kernel (fp8 tensor cores,
sm89+); Triton's CPU interpreter runs it too (tests, fp32 activations: its bf16 math is wrong).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detinfer.kernels._launch import interpreting
from detinfer.kernels._pdl import launch_options, pdl_start, use_pdl
from detinfer.kernels.fp8_linear import (
    check_fp8_kernel_device,
    check_fp8_linear,
    k_runs,
    kernel_config,
    linear_fp8_ref,
    quantize_activations_gpu,
)
from detinfer.kernels.fp8_quant import num_blocks
from detinfer.kernels.fp8_tiles import a_block, chunk_bounds
from detinfer.kernels.linear_silu_mul import _store_swiglu
from detinfer.kernels.silu_mul import silu_mul_ref

__all__ = ["fused_config", "linear_fp8_silu_mul", "linear_fp8_silu_mul_ref"]


@triton.jit
def _linear_fp8_silu_mul_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, o_ptr, M, N, K, KB,
                                stride_xm, stride_sxm, stride_wn, stride_swn, stride_om,
                                HAS_BIAS: tl.constexpr, LIBDEVICE: tl.constexpr,
                                CHUNKS: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of out [M, N] (N = I): gate rows rn and up rows N + rn of W."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    g_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    u_rows = w_ptr + (rn + N).to(tl.int64)[None, :] * stride_wn
    pdl_start(USE_PDL)  # kernels/_pdl.py: nothing is read before the previous kernel is done
    total_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(0, CHUNKS):  # fp8_linear's K runs, each its own accumulator pair, added in run order
        kb_lo, kb_hi = chunk_bounds(c, KB, CHUNKS)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_lo, kb_hi):
            a, sa = a_block(x_ptr, sx_ptr, rm, m_ok, kb, K, stride_xm, stride_sxm, BLOCK_K)
            kk = kb * BLOCK_K + rk
            w_mask = n_ok[None, :] & (kk < K)[:, None]
            g = tl.load(g_rows + kk[:, None], mask=w_mask, other=0.0)
            u = tl.load(u_rows + kk[:, None], mask=w_mask, other=0.0)
            sg = tl.load(sw_ptr + rn * stride_swn + kb, mask=n_ok, other=0.0)
            su = tl.load(sw_ptr + (rn + N) * stride_swn + kb, mask=n_ok, other=0.0)
            # fp8_linear's K-block step for each accumulator: this block alone in fp32, then the two scales
            part_g = tl.dot(a, g, out_dtype=tl.float32)
            acc_g += (part_g * sa[:, None]) * sg[None, :]
            part_u = tl.dot(a, u, out_dtype=tl.float32)
            acc_u += (part_u * sa[:, None]) * su[None, :]
        total_g += acc_g
        total_u += acc_u
    _store_swiglu(total_g, total_u, o_ptr, b_ptr, pid_m, pid_n, M, N, stride_om, HAS_BIAS, LIBDEVICE, BLOCK_M,
                  BLOCK_N)


# Pipeline depth cap: a stage holds two weight tiles here (gate and up), 40 KB at BLOCK_N 128; three stages
# keep the shared memory near the plain kernel's four. Depth changes when loads are issued, not the math.
_MAX_STAGES = 3


def fused_config(i: int, k: int) -> dict:
    """The launch config for out [M, i] from x [M, k]: `linear_fp8`'s for the fused [2i, k] weight (its
    BLOCK_M / BLOCK_N / BLOCK_K / warps per accumulator, so each fp8 dot has the plain kernel's shape), at
    most _MAX_STAGES deep; from (N, K) only."""
    cfg = kernel_config(2 * i, k)
    return dict(cfg, num_stages=min(cfg["num_stages"], _MAX_STAGES))


def _check(op: str, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_fp8_linear(op, x, w_q, w_scale, bias)
    if w_q.shape[0] % 2:
        raise ValueError(f"{op}: weight must be the fused [2I, K] gate_up weight (gate rows, then up rows), "
                         f"got an odd row count {w_q.shape[0]}")


def linear_fp8_silu_mul(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_mul(gate, up) of (gate, up) = linear_fp8(x, w_q, w_scale, bias).split(I, -1): x [..., K], w_q
    [2I, K] fp8, w_scale [2I, ceil(K/128)] fp32, bias [2I] -> [..., I] in x.dtype, in one launch (CUDA, fp8
    tensor cores; CPU tensors under TRITON_INTERPRET=1)."""
    op = "linear_fp8_silu_mul"
    _check(op, x, w_q, w_scale, bias)
    check_fp8_kernel_device(op, x, w_q, w_scale, bias)
    n2, k = w_q.shape
    i = n2 // 2
    lead = tuple(x.shape[:-1])
    rows = math.prod(lead)
    out = torch.empty((rows, i), dtype=x.dtype, device=x.device)
    if rows and i:
        a, sa = quantize_activations_gpu(x.reshape(rows, k))  # linear_fp8's quantization (same bits)
        w_q, w_scale = w_q.contiguous(), w_scale.contiguous()
        if bias is not None:
            bias = bias.contiguous()  # the epilogue reads the up half at bias + I
        cfg, pdl = fused_config(i, k), use_pdl(x.device)
        grid = (triton.cdiv(rows, cfg["BLOCK_M"]), triton.cdiv(i, cfg["BLOCK_N"]))
        _linear_fp8_silu_mul_kernel[grid](
            a, sa, w_q, w_scale, out if bias is None else bias, out, rows, i, k, num_blocks(k),
            a.stride(0), sa.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, LIBDEVICE=not interpreting(), CHUNKS=k_runs(2 * i, k),
            USE_PDL=pdl, **cfg, **launch_options(pdl))
    return out.reshape(lead + (i,))


def linear_fp8_silu_mul_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch, the kernel's definition: `linear_fp8_ref` (exact block dots) then `silu_mul_ref` on its two
    halves (silu in fp32 rounded to x's dtype, the product in fp32)."""
    _check("linear_fp8_silu_mul_ref", x, w_q, w_scale, bias)
    gate, up = linear_fp8_ref(x, w_q, w_scale, bias).split(w_q.shape[0] // 2, dim=-1)
    return silu_mul_ref(gate, up)
