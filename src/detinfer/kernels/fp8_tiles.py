"""The Triton kernels of the block-scaled FP8 linear (kernels/fp8_linear.py: launcher, reference, config):
the activation quantization of kernels/fp8_quant.py, the GEMM over K runs, and the kernel that adds K-run
partials.

Activation quantization, bit for bit `fp8_quant.quantize_activations`: a group's scale is
max(amax, AMAX_FLOOR) * INV_FP8_MAX and its values fp8(clamp(x / scale, +-448)), every step one IEEE fp32
operation (`div_rn`: correctly rounded, as torch's tensor division is), the cast round-to-nearest-even
(torch's and the GPU's e4m3 conversion). amax is a max, exact in any order (asserted on the GPU,
tests/kernels/test_fp8_linear.py). One launch for all of a GEMM's N tiles: quantizing inside the GEMM, on
each program's A tiles, was measured 2-5x slower at M <= 64 on an H100 (the divisions in the K loop).

K chunks: a launch's K blocks are cut into `chunks` contiguous runs, boundaries c * KB // chunks. Each run
is reduced into its own fp32 accumulator (the K-block step of fp8_linear's doc), and the runs' results are
added in run order, starting from 0.0. Both launch forms compute exactly that: one program walking every
run in turn (`total += acc_c`), or one program per (tile, run) writing its accumulator and
`add_chunks_kernel` adding them in run order. The number of runs comes from (N, K) only
(fp8_linear.k_runs); the form from M (how many programs the GPU would otherwise get).
"""

from __future__ import annotations

import triton
import triton.language as tl

from detinfer.kernels._pdl import pdl_start, prefetch_rows_l2
from detinfer.kernels.fp8_quant import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX

# Triton reads module globals only as constexprs
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)


@triton.jit
def quantize_tile(a):
    """a fp32 [ROWS, 128] (one K group per row; padding columns 0) -> (fp8 values, fp32 scale per row)."""
    amax = tl.max(tl.abs(a), axis=1)
    scale = tl.maximum(amax, _AMAX_FLOOR) * _INV_FP8_MAX
    q = tl.math.div_rn(a, scale[:, None])
    q = tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)
    return q.to(tl.float8e4nv), scale


@triton.jit
def a_block(x_ptr, sx_ptr, rm, m_ok, kb, K, stride_xm, stride_sxm, BLOCK_K: tl.constexpr):
    """The A operand of K block kb for rows rm: fp8 [BLOCK_M, BLOCK_K] and its fp32 scales [BLOCK_M]
    (quantize_activations_kernel's output)."""
    kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    return (tl.load(rows, mask=m_ok[:, None] & (kk < K)[None, :], other=0.0),
            tl.load(sx_ptr + rm.to(tl.int64) * stride_sxm + kb, mask=m_ok, other=0.0))


@triton.jit
def chunk_bounds(c, KB, CHUNKS: tl.constexpr):
    """K blocks [start, end) of run c of CHUNKS."""
    return c * KB // CHUNKS, (c + 1) * KB // CHUNKS


@triton.jit
def quantize_activations_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_qm, stride_sm, stride_sk,
                                ROWS: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """quantize_activations for ROWS rows x one 128-group per program (grid: cdiv(M_OUT, ROWS), KB). Rows
    M..M_OUT-1 are written as a zero row quantizes (padding for cuBLASLt); scale (m, kb) goes to
    s_ptr + m * stride_sm + kb * stride_sk (row-major, or the outer-dim-major layout cuBLASLt reads)."""
    pdl_start(USE_PDL)
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok, out_ok, k_ok = rm < M, rm < M_OUT, kk < K
    rows = rm.to(tl.int64)[:, None]
    a = tl.load(x_ptr + rows * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    q, scale = quantize_tile(a.to(tl.float32))
    tl.store(q_ptr + rows * stride_qm + kk[None, :], q, mask=out_ok[:, None] & k_ok[None, :])
    tl.store(s_ptr + rm.to(tl.int64) * stride_sm + kb * stride_sk, scale, mask=out_ok)


@triton.jit
def add_chunks_kernel(p_ptr, b_ptr, y_ptr, MN, N, CHUNKS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """y = cast(((0 + p[0]) + p[1]) + ... + bias) over flat [M * N] outputs; p is fp32 [CHUNKS, M * N]."""
    pdl_start(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        total += tl.load(p_ptr + c * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def linear_fp8_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, KB,
                       stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
                       HAS_BIAS: tl.constexpr, CHUNKS: tl.constexpr,
                       SPLIT: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N output tile; every K run in turn (y = the result), or (SPLIT) run
    program_id(2) alone (y = fp32 partials [CHUNKS, M, N], added by fp8_tiles.add_chunks_kernel).
    PREFETCH_K > 0: the first PREFETCH_K weight columns of the program's first run are asked of the L2
    before the PDL wait (kernels/_pdl.py: a cache hint, never stale)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    if SPLIT:
        c_lo = tl.program_id(2)
        c_hi = c_lo + 1
    else:
        c_lo = 0
        c_hi = CHUNKS
    if PREFETCH_K > 0:
        prefetch_rows_l2(w_ptr + (c_lo * KB // CHUNKS) * BLOCK_K, rn, n_ok, stride_wn, PREFETCH_K, 128)
    pdl_start(USE_PDL)  # kernels/_pdl.py: nothing is read before the previous kernel is done
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(c_lo, c_hi):
        kb_lo, kb_hi = chunk_bounds(c, KB, CHUNKS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_lo, kb_hi):
            a, sa = a_block(x_ptr, sx_ptr, rm, m_ok, kb, K, stride_xm, stride_sxm, BLOCK_K)
            kk = kb * BLOCK_K + rk
            b = tl.load(w_rows + kk[:, None], mask=n_ok[None, :] & (kk < K)[:, None], other=0.0)
            part = tl.dot(a, b, out_dtype=tl.float32)  # this K block alone, fp32
            sb = tl.load(sw_ptr + rn * stride_swn + kb, mask=n_ok, other=0.0)
            acc += (part * sa[:, None]) * sb[None, :]
        total += acc
    out = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(y_ptr + c_lo.to(tl.int64) * M * N + out, total, mask=mask)
    else:
        if HAS_BIAS:
            total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out, total.to(y_ptr.dtype.element_ty), mask=mask)
