"""The Triton kernels of the block-scaled FP8 linear (kernels/fp8_linear.py: launcher, reference, tile
configs): the activation quantization of kernels/fp8_quant.py and the GEMM.

Activation quantization, bit for bit `fp8_quant.quantize_activations`: a group's scale is
max(amax, AMAX_FLOOR) * INV_FP8_MAX and its values fp8(clamp(x / scale, +-448)), every step one IEEE fp32
operation (`div_rn`: correctly rounded, as torch's tensor division is), the cast round-to-nearest-even
(torch's and the GPU's e4m3 conversion). amax is a max, exact in any order (asserted on the GPU,
tests/kernels/test_fp8_linear.py). One launch for all of a GEMM's N tiles: quantizing inside the GEMM, on
each program's A tiles, was measured 2-5x slower at M <= 64 on an H100 (the divisions in the K loop).

The GEMM: a program per output tile (or per tile and K run) walks the K blocks of its run in ascending order,
one fp8 `tl.dot` per 128-wide block into a fresh fp32 tile, folded into the accumulator by one fused
multiply-add per element with the product of the two scales (fp8_linear's module doc: a long K is two runs,
its first and second halves, their chains added). What a tile's shape, its warps, its pipeline depth and
its load path (pointers or TMA descriptors), its orientation (SWAP: the weight rows on the MMA's 64-row side,
for a few tokens) and the weight's layout in memory ([N, K] or fp8_quant's tiles) change is which elements a
program computes and how its operands arrive, never an element's operations: so the config may follow M
(fp8_linear.kernel_config; asserted bitwise across configs, orientations and layouts on the GPU).
UNIFORM: every aligned group of 128 weight rows shares its block scales (a checkpoint's weights and fused
parts of whole blocks), so a tile's weight scale is one number per K block and the scale product is a
per-row vector; otherwise it is formed per element. The same products either way:
the same bits, only fewer registers and multiplies (the per-element form spills at 128-row tiles).
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
def weight_block(w_desc, w_ptr, rn, n_ok, n0, kb, K, stride_wn, stride_wkb, TMA: tl.constexpr, TILED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows n0 .. n0 + BLOCK_N - 1 (`rn`) of K block kb, fp8 [BLOCK_N, BLOCK_K]. TILED: the weight is in
    fp8_quant's tiled layout (stride_wn: a 128-row group's stride, stride_wkb: a K block's); BLOCK_N divides
    128, so the rows are one contiguous run inside a tile (no masks: the layout holds whole blocks), read by
    pointer or through a 3-D descriptor [N / 128, KB * 128, 128]."""
    if TILED:
        if TMA:
            w = w_desc.load([n0 // BLOCK_K, kb * BLOCK_K + n0 % BLOCK_K, 0]).reshape(BLOCK_N, BLOCK_K)
        else:
            r = n0 % BLOCK_K + tl.arange(0, BLOCK_N)
            w = tl.load(w_ptr + (n0 // BLOCK_K).to(tl.int64) * stride_wn + kb * stride_wkb
                        + r[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :])
    elif TMA:
        w = w_desc.load([n0, kb * BLOCK_K])
    else:
        kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                    mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
    return w


@triton.jit
def scaled_block(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, rm, rn, m_ok, n_ok, pid_m, pid_n, kb, K,
                 stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, TMA: tl.constexpr, TILED: tl.constexpr,
                 SWAP: tl.constexpr, UNIFORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """K block kb of a tile: (its fp32 dot, the scale product sx * sw) for `acc = fma(dot, scale, acc)`. SWAP:
    the tile transposed, [BLOCK_N, BLOCK_M] (the weight rows are the MMA's 64-row side, so a few tokens need no
    64-row activation tile; each element's dot is the same, asserted bitwise on the GPU)."""
    if TMA:
        a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
    else:
        kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
    w = weight_block(w_desc, w_ptr, rn, n_ok, pid_n * BLOCK_N, kb, K, stride_wn, stride_wkb, TMA, TILED,
                     BLOCK_N, BLOCK_K)
    sa = tl.load(sx_ptr + rm.to(tl.int64) * stride_sxm + kb, mask=m_ok, other=0.0)
    if UNIFORM:  # one weight scale per (tile, K block): the tile's first row holds it
        sw = tl.load(sw_ptr + (pid_n * BLOCK_N) * stride_swn + kb)
    else:
        sw = tl.load(sw_ptr + rn * stride_swn + kb, mask=n_ok, other=0.0)
    if SWAP:
        part = tl.dot(w, a.T, out_dtype=tl.float32)  # this K block alone, fp32 [BLOCK_N, BLOCK_M]
        if UNIFORM:
            scale = (sa * sw)[None, :]
        else:
            scale = sa[None, :] * sw[:, None]
    else:
        part = tl.dot(a, w.T, out_dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
        if UNIFORM:
            scale = (sa * sw)[:, None]
        else:
            scale = sa[:, None] * sw[None, :]
    return part, scale


@triton.jit
def k_run(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, rm, rn, m_ok, n_ok, pid_m, pid_n, kb_lo, kb_hi, K,
          stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, TMA: tl.constexpr, TILED: tl.constexpr,
          SWAP: tl.constexpr, UNIFORM: tl.constexpr, PAIRED: tl.constexpr, STAGES: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """From acc = 0: acc = fma(dot_kb, sx[m, kb] * sw[n, kb], acc) for the K blocks kb_lo..kb_hi-1 in order.
    PAIRED: two K blocks per iteration, both dots issued before the two fmas (in block order): a small tile's
    one long chain of dependent steps gets two MMAs in flight."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PAIRED:
        for kb in tl.range(kb_lo, kb_hi - 1, 2, num_stages=STAGES):
            p0, s0 = scaled_block(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, rm, rn, m_ok, n_ok, pid_m, pid_n,
                                  kb, K, stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, TMA, TILED, SWAP,
                                  UNIFORM, BLOCK_M, BLOCK_N, BLOCK_K)
            p1, s1 = scaled_block(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, rm, rn, m_ok, n_ok, pid_m, pid_n,
                                  kb + 1, K, stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, TMA, TILED,
                                  SWAP, UNIFORM, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.fma(p0, s0, acc)
            acc = tl.fma(p1, s1, acc)
        if (kb_hi - kb_lo) % 2 == 1:
            p, s = scaled_block(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, rm, rn, m_ok, n_ok, pid_m, pid_n,
                                kb_hi - 1, K, stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, TMA, TILED,
                                SWAP, UNIFORM, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.fma(p, s, acc)
    else:
        for kb in tl.range(kb_lo, kb_hi, num_stages=STAGES):
            p, s = scaled_block(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, rm, rn, m_ok, n_ok, pid_m, pid_n,
                                kb, K, stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, TMA, TILED, SWAP,
                                UNIFORM, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.fma(p, s, acc)
    return acc


@triton.jit
def linear_fp8_kernel(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, KB, H,
                      stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, stride_ym,
                      HAS_BIAS: tl.constexpr, TMA: tl.constexpr, TILED: tl.constexpr, SWAP: tl.constexpr,
                      UNIFORM: tl.constexpr, PAIRED: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
                      PREFETCH_K: tl.constexpr, STAGES: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of y = x_q @ w_q^T (fp8_linear's module doc): the fma chain of each K run from
    acc = 0, the two runs' sum, + bias, cast to y's dtype. SPLIT 0: one run, [0, KB); 1: two runs, [0, H) and
    [H, KB), one after the other in this program; 2: program_id(2) is the run, its fp32 chain stored to ws[run]
    (M x N) for `sum_runs_kernel` (more programs where the output has few tiles). TMA: the operands come
    through the tensor descriptors a_desc / w_desc (out-of-bounds reads are zeros, as the masked loads' are).
    TILED / SWAP: `weight_block` / `scaled_block`. PREFETCH_K > 0: the first PREFETCH_K weight columns of the
    run's rows are asked of the L2 before the PDL wait (kernels/_pdl.py: a cache hint, never stale)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    kb_lo, kb_hi = 0, KB
    if SPLIT == 1:
        kb_hi = H
    if SPLIT == 2:
        run = tl.program_id(2)
        kb_lo = run * H
        kb_hi = H + run * (KB - H)
    if PREFETCH_K > 0:
        if TILED:  # the run's first PREFETCH_K / 128 blocks of these rows: one contiguous run each
            n0 = pid_n * BLOCK_N
            blocks = tl.arange(0, PREFETCH_K // BLOCK_K)
            prefetch_rows_l2(w_ptr + (n0 // BLOCK_K).to(tl.int64) * stride_wn + kb_lo * stride_wkb
                             + (n0 % BLOCK_K) * BLOCK_K, blocks, blocks < PREFETCH_K // BLOCK_K, stride_wkb,
                             BLOCK_N * BLOCK_K, 128)
        else:
            prefetch_rows_l2(w_ptr + kb_lo * BLOCK_K, rn, n_ok, stride_wn, PREFETCH_K, 128)
    pdl_start(USE_PDL)  # kernels/_pdl.py: nothing is read before the previous kernel is done
    acc = k_run(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, rm, rn, m_ok, n_ok, pid_m, pid_n, kb_lo, kb_hi, K,
                stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, TMA, TILED, SWAP, UNIFORM, PAIRED, STAGES,
                BLOCK_M, BLOCK_N, BLOCK_K)
    if SWAP:  # acc is the tile transposed: [BLOCK_N, BLOCK_M]
        ok = n_ok[:, None] & m_ok[None, :]
        ws_offs = rm[None, :] * N + rn[:, None]
        y_offs = rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    else:
        ok = m_ok[:, None] & n_ok[None, :]
        ws_offs = rm[:, None] * N + rn[None, :]
        y_offs = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if SPLIT == 2:
        tl.store(ws_ptr + run * M * N + ws_offs, acc, mask=ok)  # launcher: M * N < 2^31
    else:
        if SPLIT == 1:
            acc = acc + k_run(a_desc, w_desc, x_ptr, sx_ptr, w_ptr, sw_ptr, rm, rn, m_ok, n_ok, pid_m, pid_n, H,
                              KB, K, stride_xm, stride_sxm, stride_wn, stride_wkb, stride_swn, TMA, TILED, SWAP,
                              UNIFORM, PAIRED, STAGES, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if SWAP:
                acc += bias[:, None]
            else:
                acc += bias[None, :]
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def sum_runs_kernel(ws_ptr, b_ptr, y_ptr, M, N, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
                    BLOCK: tl.constexpr):
    """y = ws[0] + ws[1] (+ bias), cast: the two K runs' chains of SPLIT 2 (y and ws contiguous [M, N])."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    pdl_start(USE_PDL)
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0) + tl.load(ws_ptr + M * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)
