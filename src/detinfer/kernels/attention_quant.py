"""Paged attention whose rows come out quantized for an FP8 o_proj (deterministic mode, head_dim 128).

Why: an FP8 o_proj quantizes its input rows per token and per 128-column group (kernels/fp8_quant.py); as
its own launch that cost 0.12 ms of an FP8 Qwen3-8B batch-1 decode step on an H100 (docs/performance.md,
"FP8, seventh pass"). At head_dim 128 one (token, head) row of the attention output is exactly one group of
o_proj's input [T, Hq * 128], so the attention kernel's store can quantize it (`_store_out` in
kernels/attention_kernels.py). Only the sequential programs do: split-parallel steps (small batches over long
keys) merge their splits into 16-bit rows and quantize those in one more launch (`quantize_merged`), as before,
because a merge kernel that quantized its rows lost its pipelined loop on an H100 (+0.35 us per split: 135 ->
182 us at batch 1 over 32k keys; docs/performance.md, "FP8, eighth pass"). The engine asks for it in decode
steps only (`Ops.paged_attention_fp8`; other steps hand o_proj the 16-bit rows, which it quantizes in one
launch): with prefill tiles its mixed steps measured ~1% slower (median 29.3 vs 28.95 ms in the FP8 workload on
an H100), though the kernel alone timed 2-6% below attention + a separate quantization; not explained.

Bits: the kernel rounds each row to the model dtype exactly as its 16-bit store does, then quantizes it with
`quantize_tile` (kernels/fp8_tiles.py, which `quantize_activations` matches bitwise on the GPU), so the
result == `QuantizedRows.of(paged_attention(...).reshape(T, -1))`, asserted bitwise on the GPU
(tests/kernels/test_attention_quant.py). A row still depends on its own query's keys only: batch-invariant
as `paged_attention`. Under Triton's CPU interpreter the fp8 cast is not the GPU's (kernels/fp8_act_quant.py
`quantize_activations_gpu`): there the scales are exact and the values close, which the CPU tests check.
"""

from __future__ import annotations

import torch

from detinfer.kernels import attention
from detinfer.kernels.fp8_act_quant import quantize_activations_gpu
from detinfer.kernels.fp8_quant import BLOCK, FP8_DTYPE, QuantizedRows


def quantizes(q: torch.Tensor) -> bool:
    """Whether `paged_attention_quantized` takes these queries [T, Hq, D]: one head is one group (D == 128)."""
    return q.dim() == 3 and q.shape[2] == BLOCK


def _check_out(op: str, out: QuantizedRows, t: int, width: int, q: torch.Tensor) -> None:
    if not isinstance(out, QuantizedRows) or tuple(out.q.shape) != (t, width) or not out.q.is_contiguous() \
            or not out.scale.is_contiguous() or out.q.device != q.device or out.dtype != q.dtype:
        got = f"{out.q.dtype} {tuple(out.q.shape)}" if isinstance(out, QuantizedRows) else type(out).__name__
        raise ValueError(f"{op}: out must be contiguous QuantizedRows of [{t}, {width}] on {q.device} standing "
                         f"for {q.dtype} rows, got {got}")


def paged_attention_quantized(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, kv_lens: torch.Tensor, cu_q_lens: torch.Tensor,
                              scale: float, *, sliding_window: int | None = None, max_q_len: int | None = None,
                              max_kv_len: int | None = None, validate: bool | None = None,
                              split_size: int = attention.DEFAULT_SPLIT_SIZE, schedule: str = "auto",
                              out: QuantizedRows | None = None,
                              rows_out: torch.Tensor | None = None) -> QuantizedRows:
    """`paged_attention`'s rows [T, Hq * 128] as `QuantizedRows` (fp8 values [T, Hq * 128], fp32 scales
    [T, Hq]), quantized by the attention kernel itself (module doc); the arguments are paged_attention's.
    out: QuantizedRows to write (a CUDA graph's fixed buffers). rows_out: a contiguous [T, Hq, 128] buffer of
    q's dtype where split-parallel steps merge their 16-bit rows before quantizing them (a graph's fixed
    attention buffer; default a new one). Rows past cu_q_lens[-1] (padding) are left untouched by sequential
    steps; split-parallel ones quantize whatever rows_out holds there."""
    op = "paged_attention_quantized"
    if not isinstance(q, torch.Tensor) or not quantizes(q):
        raise ValueError(f"{op}: q must be [T, Hq, {BLOCK}] (one head = one {BLOCK}-wide activation group), "
                         f"got {tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    t, hq, d = q.shape
    if out is None:
        out = QuantizedRows(torch.empty((t, hq * d), dtype=FP8_DTYPE, device=q.device),
                            torch.empty((t, hq), dtype=torch.float32, device=q.device), q.dtype)
    _check_out(op, out, t, hq * d, q)
    if rows_out is None:
        rows_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    elif not isinstance(rows_out, torch.Tensor) or tuple(rows_out.shape) != (t, hq, d) or \
            rows_out.dtype != q.dtype or not rows_out.is_contiguous() or rows_out.device != q.device:
        raise ValueError(f"{op}: rows_out must be a contiguous {q.dtype} tensor of shape {(t, hq, d)} on "
                         f"{q.device}, got {getattr(rows_out, 'dtype', type(rows_out).__name__)} "
                         f"{tuple(getattr(rows_out, 'shape', ()))}")
    attention._paged(op, q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale, sliding_window, max_q_len,
                     max_kv_len, validate, split_size, schedule, fast=False, out=None,
                     quant=(out.q.view(t, hq, d), out.scale, rows_out, quantize_merged))
    return out


def quantize_merged(rows: torch.Tensor, q8: torch.Tensor, s8: torch.Tensor) -> None:
    """A split-parallel step's merged 16-bit rows [T, Hq, 128] quantized into q8 (the same shape, fp8) and s8
    [T, Hq] in one launch (`quantize_activations_gpu` writing into them: `quantize_activations`' bits)."""
    t, width = rows.shape[0], rows.shape[1] * rows.shape[2]
    quantize_activations_gpu(rows.reshape(t, width), out=(q8.view(t, width), s8))
