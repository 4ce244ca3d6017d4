"""The SwiGLU MLP's gate_up projection with SiLU*mul in its epilogue: one launch instead of `linear` then
`silu_mul`, with the same output bits.

    out[M, I] = silu_mul(x @ W[:I]^T (+ b[:I]), x @ W[I:]^T (+ b[I:]))

W is the fused [2I, H] gate_up weight (gate rows, then up rows), read by strides. A program owns a
BLOCK_M x BLOCK_N tile of output columns j and keeps two fp32 accumulators, gate (rows j of W) and up
(rows I + j), fed by the SAME K walk as `matmul._matmul_kernel`: one `tl.dot` per BLOCK_K block, K ascending
from 0, the K tail loaded as exact zeros (the same load helpers). The epilogue then does what the two
launches do between them: bias in fp32 after the reduction, rounding to the output dtype (the matmul's
store), back to fp32, and `silu_mul`'s formula (the same jit function, `silu_mul.silu_mul_values`).

Why the bits equal the two launches': each accumulator is the plain kernel's accumulator for that output
column (same operands, same K order into one fp32 accumulator; which tile or N width holds a column does
not change its reduction, matmul_configs.py says why and tests/kernels/test_matmul.py proves it on the
GPU), and the rest is elementwise. Asserted bitwise in tests/kernels/test_linear_silu_mul.py (GPU: every
config below against the deterministic `linear` + `silu_mul`).

Configs: the one the dispatcher gives the plain gate_up matmul (M, 2I, H), with BLOCK_N halved: a program
reads the same weight bytes per K step as the plain kernel's (two half-width tiles), so the tile count,
shared memory and registers match it. A TMA config loads through descriptors (one tile per program: the
fused op runs at decode sizes, where the plain family is not persistent either) when the operands
qualify, else runs the same tiles with pointer loads (same bits).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from detinfer.kernels import matmul as mm
from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._launch import dot_precision, interpreting
from detinfer.kernels._pdl import launch_options, pdl_start, prefetch_rows_l2, use_pdl
from detinfer.kernels.matmul import _add_bias, _load_a_block, _load_b_block, _tile_coords
from detinfer.kernels.matmul_configs import MatmulConfig
from detinfer.kernels.matmul_configs import gpu_configs as matmul_gpu_configs
from detinfer.kernels.silu_mul import silu_mul_ref, silu_mul_values

__all__ = ["linear_silu_mul", "linear_silu_mul_ref", "fused_config", "gpu_configs"]


@triton.jit(do_not_specialize=["M"])
def _linear_silu_mul_kernel(
    x_ptr, w_ptr, o_ptr, bias_ptr,
    M, N, K, w_up_offset,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, LIBDEVICE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE_K: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of out [M, N] (N = I); the up rows start w_up_offset elements after the
    gate rows (I * stride_wn, passed in so the compiler sees its alignment)."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH_K > 0:
        prefetch_rows_l2(w_ptr, offs_n, offs_n < N, stride_wn, PREFETCH_K, LINE_K)
        prefetch_rows_l2(w_ptr + w_up_offset, offs_n, offs_n < N, stride_wn, PREFETCH_K, LINE_K)
    pdl_start(USE_PDL)  # PDL (kernels/_pdl.py): wait for the previous kernel before reading anything
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # B = W^T [K, N] read through the weight's strides, as `linear` launches the plain kernel.
    g_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n.to(tl.int64)[None, :] * stride_wn
    u_ptrs = g_ptrs + w_up_offset

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = _load_a_block(x_ptrs, m_ok, offs_k, K - kb * BLOCK_K, EVEN_K)
        g = _load_b_block(g_ptrs, n_ok, offs_k, K - kb * BLOCK_K, EVEN_K)
        u = _load_b_block(u_ptrs, n_ok, offs_k, K - kb * BLOCK_K, EVEN_K)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk

    _store_swiglu(acc_g, acc_u, o_ptr, bias_ptr, pid_m, pid_n, M, N, stride_om, HAS_BIAS, LIBDEVICE,
                  BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _linear_silu_mul_tma_kernel(
    x_desc, g_desc, u_desc, o_ptr, bias_ptr,
    M, N, K, stride_om,
    HAS_BIAS: tl.constexpr, LIBDEVICE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The same tile and K order, operands fetched by the TMA engine (as `matmul._matmul_tma_kernel`, one
    tile per program) from descriptors of x [M, K], the gate rows [N, K] and the up rows [N, K].
    Out-of-range boxes read as zeros: the M/N edges and the K tail (exact zeros, as the pointer loads)."""
    pdl_start(USE_PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = x_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        acc_g = tl.dot(a, g_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T, acc_g)
        acc_u = tl.dot(a, u_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T, acc_u)
    _store_swiglu(acc_g, acc_u, o_ptr, bias_ptr, pid_m, pid_n, M, N, stride_om, HAS_BIAS, LIBDEVICE,
                  BLOCK_M, BLOCK_N)


@triton.jit
def _store_swiglu(acc_g, acc_u, o_ptr, bias_ptr, pid_m, pid_n, M, N, stride_om, HAS_BIAS: tl.constexpr,
                  LIBDEVICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the plain kernel stores for both halves (bias after the reduction, rounded to the output
    dtype), read back as fp32, then silu_mul's formula; bias [2N] is contiguous (up's half at N)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    dt = o_ptr.dtype.element_ty
    gate = _add_bias(acc_g, bias_ptr, offs_n, n_ok, HAS_BIAS).to(dt).to(tl.float32)
    up = _add_bias(acc_u, bias_ptr + N, offs_n, n_ok, HAS_BIAS).to(dt).to(tl.float32)
    out = silu_mul_values(gate, up, o_ptr, LIBDEVICE)
    o_ptrs = o_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, out, mask=(offs_m[:, None] < M) & n_ok[None, :])


# Compiled kernels remembered per launch key (kernels/_direct.py): one decode step launches this per layer.
_LAUNCHES = LaunchCache(_linear_silu_mul_kernel)


def _fused_from(cfg: MatmulConfig) -> MatmulConfig:
    """A plain-matmul config as the fused kernel runs it: half the N tile per accumulator (>= 16, the
    smallest tl.dot width), one tile per program."""
    return replace(cfg, block_n=max(16, cfg.block_n // 2), persistent=False, warp_specialize=False)


def fused_config(m: int, i: int, k: int, dtype: torch.dtype, device: torch.device) -> MatmulConfig:
    """The launch config for out [m, i] from x [m, k]. In the interpreter the plain kernel's fixed config
    unchanged: there BLOCK_K is part of the reduction order (matmul_configs.py), and BLOCK_N is kept too."""
    cfg = mm._config(m, 2 * i, k, dtype, device)
    return cfg if interpreting() else _fused_from(cfg)


def gpu_configs(dtype: torch.dtype) -> tuple[MatmulConfig, ...]:
    """Every config `fused_config` can return on a GPU for `dtype`, and the pointer twin of each TMA one
    (what the GPU bit tests sweep)."""
    fused = [_fused_from(c) for c in matmul_gpu_configs(dtype)]
    return tuple(dict.fromkeys(fused + [replace(c, tma=False) for c in fused]))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    op = "linear_silu_mul"
    mm._check_inputs(op, x, weight, bias)
    mm._check_linear_shapes(op, x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"{op}: weight must be the fused [2I, K] gate_up weight (gate rows, then up rows), "
                         f"got an odd row count {weight.shape[0]}")


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    config: MatmulConfig | None = None) -> torch.Tensor:
    """silu_mul(gate, up) of (gate, up) = linear(x, weight, bias).split(I, -1): x [..., K], weight [2I, K],
    bias [2I] -> [..., I] in x.dtype, bit-identical to the two launches. `config` overrides the dispatcher
    (tests use it to prove every config gives the same bits)."""
    _check(x, weight, bias)
    n2, k = weight.shape
    i = n2 // 2
    lead = tuple(x.shape[:-1])
    rows = math.prod(lead)
    out = torch.empty(lead + (i,), dtype=x.dtype, device=x.device)
    if rows == 0 or i == 0:
        return out
    x2 = x if x.dim() == 2 else x.reshape(rows, k)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()  # the kernel reads the bias as contiguous, as the plain one does
    has_bias = bias is not None
    tensors = (x2, weight, out, bias if has_bias else out)
    swn, swk = weight.stride()
    scalars = (rows, i, k, i * swn, x2.stride(0), x2.stride(1), swn, swk, i)
    pdl = use_pdl(x.device)
    key = (rows, i, k, x.dtype, has_bias, x2.stride(), weight.stride(), pdl)  # fixes the grid and every scalar
    if config is None and _LAUNCHES.try_launch(key, tensors):
        return out
    cfg = config or fused_config(rows, i, k, x.dtype, x.device)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    grid = (mm._cdiv(rows, bm) * mm._cdiv(i, bn),)
    if cfg.tma and _tma_launch(x2, weight, out, tensors[3], has_bias, rows, i, k, cfg, grid, pdl):
        return out
    constexprs = dict(HAS_BIAS=has_bias, EVEN_K=k % bk == 0,
                      PRECISION=dot_precision(x.dtype),
                      LIBDEVICE=not interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
                      USE_PDL=pdl, **mm._prefetch(pdl, rows, k, swk, weight.element_size()))
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    if config is not None:
        _linear_silu_mul_kernel[grid](*tensors, *scalars, **constexprs, **options)
    else:
        _LAUNCHES.launch(key, tensors, grid, scalars, constexprs, **options)
    return out


def _tma_launch(x2, weight, out, bias, has_bias: bool, m: int, i: int, k: int, cfg: MatmulConfig, grid,
                pdl: bool) -> bool:
    """The descriptor kernel, when x and both weight halves qualify for TMA (`matmul._tma_ok`: Hopper+,
    16-bit, unit K stride, 16-byte aligned rows and bases); False when they do not (pointer loads then)."""
    swn, swk = weight.stride()
    up = weight[i:]
    if mm.TensorDescriptor is None or up.data_ptr() % 16 or not mm._tma_ok(x2, x2.stride(0), x2.stride(1),
                                                                            weight, swn, swk, k):
        return False
    descs = (mm.TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [cfg.block_m, cfg.block_k]),
             mm.TensorDescriptor(weight, [i, k], [swn, 1], [cfg.block_n, cfg.block_k]),
             mm.TensorDescriptor(up, [i, k], [swn, 1], [cfg.block_n, cfg.block_k]))
    _linear_silu_mul_tma_kernel[grid](
        *descs, out, bias, m, i, k, i, HAS_BIAS=has_bias, LIBDEVICE=not interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    return True


def linear_silu_mul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch: `linear_ref` then `silu_mul_ref` on its two halves (any float dtype)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] % 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"linear_silu_mul_ref: weight must be the fused [2I, K] gate_up weight, got {shape}")
    gate, up = mm.linear_ref(x, weight, bias).split(weight.shape[0] // 2, dim=-1)
    return silu_mul_ref(gate, up)
