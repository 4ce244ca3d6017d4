"""The activation quantization of an FP8 linear done by the kernel that produces its input: RMSNorm (q/k/v and
gate/up's input) and SiLU * mul (down_proj's), each writing `QuantizedRows` (fp8 values + per-token per-128
group scales) instead of the 16-bit rows. One launch fewer per FP8 linear, the same bits.

Why: at decode batch sizes an FP8 linear's own quantization launch costs ~3 us on an H100 (M = 1, CUDA-graph
timer: linear_fp8 13.4 us vs its GEMM on quantized rows 10.4 us for o_proj; docs/performance.md, "FP8, fifth
pass"), three of the four per layer can go into the kernel before.

Bits: each kernel computes its rows exactly as the 16-bit kernel does (the same Triton code: `rms_norm_values`
of kernels/rmsnorm.py with the same layout constants, warps and no fp contraction; `silu_mul_values` of
kernels/silu_mul.py), rounds them to the model dtype as that kernel's store would, and quantizes them with
`quantize_tile` (kernels/fp8_tiles.py, torch's bits): so `QuantizedRows` == `quantize_activations` of the
16-bit kernel's output, asserted bitwise on the GPU (tests/kernels/test_fp8_act_quant.py). Both are row-wise
(a row's values and group scales depend on that row only): batch-invariant as the kernels they extend.

`quantize_activations_gpu` is the same quantization as its own launch, for rows no kernel quantized before.

Where the kernels do not run (CPU, the interpreter, a norm narrower than one 128-column group, a weight of
another dtype than x) the same `QuantizedRows` come from the 16-bit op then `QuantizedRows.of`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._launch import interpreting
from detinfer.kernels._pdl import launch_options, pdl_start, use_pdl
from detinfer.kernels.fp8_quant import BLOCK, FP8_DTYPE, QuantizedRows, num_blocks, quantize_activations
from detinfer.kernels.fp8_tiles import quantize_activations_kernel, quantize_tile
from detinfer.kernels.rmsnorm import _layout_for, rms_norm, rms_norm_values
from detinfer.kernels.silu_mul import _rows, silu_mul, silu_mul_values

_GROUP = tl.constexpr(BLOCK)  # Triton reads module globals only as constexprs


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, h_ptr, n_rows, D, eps,
                           x_stride, res_stride, h_stride, q_stride, s_stride,
                           HAS_RES: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """kernels/rmsnorm.py's rows (y in x's dtype, h stored), then each 128-column group of y quantized."""
    pdl_start(USE_PDL)
    rows, cols, mask, y = rms_norm_values(x_ptr, res_ptr, w_ptr, h_ptr, tl.program_id(0), n_rows, D, eps,
                                          x_stride, res_stride, h_stride, HAS_RES, HAS_W, ROWS, BLOCK_D)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # what rms_norm stores (x's dtype: the launcher's rule)
    groups: tl.constexpr = BLOCK_D // _GROUP
    q, scale = quantize_tile(tl.reshape(y, (ROWS * groups, _GROUP)))  # masked columns are 0: no amax change
    tl.store(q_ptr + rows[:, None] * q_stride + cols[None, :], tl.reshape(q, (ROWS, BLOCK_D)), mask=mask)
    g = tl.arange(0, ROWS * groups)  # the scales in quantize_tile's order: row-major (row, group)
    srow = tl.program_id(0).to(tl.int64) * ROWS + g // groups
    ok = (srow < n_rows) & (g % groups < tl.cdiv(D, _GROUP))
    tl.store(s_ptr + srow * s_stride + g % groups, scale, mask=ok)


@triton.jit
def _silu_mul_quant_kernel(g_ptr, u_ptr, q_ptr, s_ptr, n_cols, g_st, u_st, q_st, s_st,
                           GROUPS: tl.constexpr, USE_PDL: tl.constexpr, LIBDEVICE: tl.constexpr):
    """GROUPS 128-column groups of one row: silu(g) * u as kernels/silu_mul.py forms it, then quantized."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = grp[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
    ok = cols < n_cols
    g = tl.load(g_ptr + row * g_st + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_st + cols, mask=ok, other=0.0).to(tl.float32)
    q, scale = quantize_tile(silu_mul_values(g, u, g_ptr, LIBDEVICE).to(tl.float32))  # padding: silu(0) * 0 = 0
    tl.store(q_ptr + row * q_st + cols, q, mask=ok)
    tl.store(s_ptr + row * s_st + grp, scale, mask=grp < tl.cdiv(n_cols, _GROUP))


_NORM_LAUNCHES = LaunchCache(_rms_norm_quant_kernel)
_SILU_LAUNCHES = LaunchCache(_silu_mul_quant_kernel)
_SILU_GROUPS = 8  # 128-column groups per program (1024 values, silu_mul.py's tile; any count: the same bits)


def _kernels_run(*tensors: torch.Tensor | None) -> bool:
    """CUDA tensors, or CPU ones under Triton's interpreter (tests of the indexing: its fp8 cast is not the
    GPU's, `quantize_activations_gpu` says why)."""
    on = [t.is_cuda for t in tensors if t is not None]
    return all(on) or (interpreting() and not any(on))


def rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       residual: torch.Tensor | None = None):
    """`rms_norm(x, weight, eps, residual)` with y returned as `QuantizedRows` of x's rows [M, D] (x 2-D):
    y, or (y, h) with a residual, h the 16-bit residual stream as rms_norm returns it."""
    if x.dim() != 2:
        raise ValueError(f"rms_norm_quantized: x must be [M, D], got shape {tuple(x.shape)}")
    m, d = x.shape
    block_d, rows, warps = _layout_for(d)
    if not (_kernels_run(x, weight, residual) and block_d >= BLOCK and m and x.stride(1) == 1
            and (weight is None or (weight.dtype == x.dtype and weight.stride(0) == 1))
            and (residual is None or residual.stride(1) == 1)):
        out = rms_norm(x, weight, eps, residual) if x.is_cuda else None
        if out is None:
            from detinfer.kernels.rmsnorm import rms_norm_ref
            out = rms_norm_ref(x, weight, eps, residual)
        y, h = (out, None) if residual is None else out
        return QuantizedRows.of(y) if residual is None else (QuantizedRows.of(y), h)
    q = torch.empty((m, d), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, num_blocks(d)), dtype=torch.float32, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    res = residual if residual is not None else x
    hh = h if h is not None else q
    tensors = (x, res, weight if weight is not None else x, q, s, hh)
    strides = (x.stride(0), res.stride(0), hh.stride(0), q.stride(0), s.stride(0))
    pdl = use_pdl(x.device)
    key = (m, d, eps, strides, residual is not None, weight is not None, x.dtype, pdl)
    if not _NORM_LAUNCHES.try_launch(key, tensors):
        # rms_norm's constants, warps and no fp contraction: the same layouts, reduction tree and bits.
        _NORM_LAUNCHES.launch(key, tensors, (-(-m // rows),), (m, d, float(eps), *strides),
                              dict(HAS_RES=residual is not None, HAS_W=weight is not None, ROWS=rows,
                                   BLOCK_D=block_d, USE_PDL=pdl),
                              num_warps=warps, enable_fp_fusion=False, **launch_options(pdl))
    y = QuantizedRows(q, s, x.dtype)
    return y if residual is None else (y, h)


def silu_mul_quantized(gate: torch.Tensor, up: torch.Tensor) -> QuantizedRows:
    """`silu_mul(gate, up)` (gate, up [M, I], e.g. the halves of a gate_up projection) as `QuantizedRows`."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul_quantized: gate and up must be [M, I] of one dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if not _kernels_run(gate, up):
        if gate.is_cuda:
            return QuantizedRows.of(silu_mul(gate, up))
        from detinfer.kernels.silu_mul import silu_mul_ref
        return QuantizedRows.of(silu_mul_ref(gate, up))
    m, n = gate.shape
    q = torch.empty((m, n), dtype=FP8_DTYPE, device=gate.device)
    s = torch.empty((m, num_blocks(n)), dtype=torch.float32, device=gate.device)
    if m and n:
        g2, u2 = _rows(gate), _rows(up)
        tensors, strides = (g2, u2, q, s), (g2.stride(0), u2.stride(0), q.stride(0), s.stride(0))
        pdl = use_pdl(gate.device)
        key = (m, n, strides, gate.dtype, pdl)
        if not _SILU_LAUNCHES.try_launch(key, tensors):
            _SILU_LAUNCHES.launch(key, tensors, (m, triton.cdiv(num_blocks(n), _SILU_GROUPS)), (n, *strides),
                                  dict(GROUPS=_SILU_GROUPS, USE_PDL=pdl, LIBDEVICE=not interpreting()),
                                  num_warps=4, **launch_options(pdl))
    return QuantizedRows(q, s, gate.dtype)


def quantize_activations_gpu(x2: torch.Tensor, rows: int | None = None, scales_outer: bool = False,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` in one Triton launch (same bits: kernels/fp8_tiles.py): x [M, K] -> (fp8 [R, K],
    fp32 scales [R, ceil(K/128)]) with R = `rows` (default M; rows past M come back as a zero row quantizes,
    the padding cuBLASLt's blockwise GEMM wants) and the scales outer-dim-major (stride (1, R)) if
    `scales_outer`: the layouts fast mode's scaled_mm reads, without a copy or a concatenation per call.
    out: the (values, scales) buffers to write instead of new ones (a CUDA graph's fixed buffers; values with a
    unit inner stride), returned."""
    m, k = x2.shape
    r = m if rows is None else rows
    if r < m:
        raise ValueError(f"quantize_activations_gpu: rows={r} is below the input's {m} rows")
    kb = num_blocks(k)
    if out is not None and (tuple(out[0].shape) != (r, k) or out[0].dtype != FP8_DTYPE or out[0].stride(1) != 1
                            or tuple(out[1].shape) != (r, kb) or out[1].dtype != torch.float32):
        raise ValueError(f"quantize_activations_gpu: out must be fp8 values [{r}, {k}] (unit inner stride) and "
                         f"fp32 scales [{r}, {kb}], got {out[0].dtype} {tuple(out[0].shape)} and {out[1].dtype} "
                         f"{tuple(out[1].shape)}")
    if interpreting():  # the CPU interpreter's fp32 -> e4m3 cast mis-rounds values that round up to a
        q, s = quantize_activations(x2)  # power of two (124.3 -> 64): the GPU's cast is checked on the GPU
        if r > m:
            pq, ps = quantize_activations(x2.new_zeros(r - m, k))
            q, s = torch.cat((q, pq)), torch.cat((s, ps))
        if out is not None:
            return out[0].copy_(q), out[1].copy_(s)
        return q, (torch.empty_strided(s.shape, (1, r), dtype=s.dtype).copy_(s) if scales_outer else s)
    x2 = x2.contiguous()
    if out is not None:
        q, s = out
    elif scales_outer:
        q = torch.empty((r, k), dtype=FP8_DTYPE, device=x2.device)
        s = torch.empty_strided((r, kb), (1, r), dtype=torch.float32, device=x2.device)
    else:
        q = torch.empty((r, k), dtype=FP8_DTYPE, device=x2.device)
        s = torch.empty((r, kb), dtype=torch.float32, device=x2.device)
    if r and k:
        pdl, per_program = use_pdl(x2.device), 16
        quantize_activations_kernel[(triton.cdiv(r, per_program), kb)](
            x2, q, s, m, r, k, x2.stride(0), q.stride(0), s.stride(0), s.stride(1), ROWS=per_program,
            BLOCK_K=BLOCK, USE_PDL=pdl, num_warps=4, **launch_options(pdl))
    return q, s
