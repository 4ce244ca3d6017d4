"""Fast mode's FP8 linear (kernels/fp8_linear.py's module doc): what a serving stack runs, torch's
block-scaled `scaled_mm` (cuBLASLt, 1x128 activation and 128x128 weight scales) where this torch and GPU take
it, else the weight dequantized and F.linear. Not batch-invariant (cuBLASLt picks its kernel per shape)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from detinfer.kernels.fp8_linear import (
    _flat,
    check_fp8_linear,
    linear_fp8_ref,
    quantize_activations_gpu,
)
from detinfer.kernels.fp8_quant import BLOCK, QuantizedRows, dequantize_weight, per_weight_cached, untile_weight

__all__ = ["blockwise_layout", "linear_fp8_stock"]


def linear_fp8_stock(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fast mode: torch's block-scaled fp8 GEMM where this torch and GPU take it (`blockwise_layout`), else
    the weight dequantized to x's dtype and F.linear (activations unquantized). A tiled weight is untiled per
    call (a copy: the engine tiles only where the deterministic kernel reads it, models/fp8.py)."""
    check_fp8_linear("linear_fp8_stock", x, w_q, w_scale, bias)
    w_q = untile_weight(w_q)
    if isinstance(x, QuantizedRows):  # the backend quantizes ahead only in deterministic mode
        raise TypeError("linear_fp8_stock: takes the 16-bit rows (it quantizes them into cuBLASLt's layout), "
                        "got QuantizedRows")
    n, k = w_q.shape
    layout = blockwise_layout(x.device) if x.is_cuda and n % BLOCK == 0 and k % BLOCK == 0 else None
    if layout is not None:
        y = _scaled_mm_blockwise(_flat(x), w_q, w_scale, x.dtype, layout)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(tuple(x.shape[:-1]) + (n,))
    return F.linear(x, dequantize_weight(w_q, w_scale).to(x.dtype), bias)


def _scaled_mm_blockwise(x2: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype,
                         layout: str) -> torch.Tensor:
    """torch's scaled_mm with 1x128 activation and 128x128 weight scales (cuBLAS's blockwise recipe: the
    activation scales outer-dim-major; the weight's block scales `_block_scales`). The activations are
    quantized in one launch straight into the padded rows and scale layout cuBLASLt reads."""
    recipe = F.ScalingType
    m = x2.shape[0]
    rows = m + (-m % 16)  # cuBLASLt's blockwise heuristic refuses some row counts (measured: M = 33)
    x_q, sx_outer = quantize_activations_gpu(x2, rows=rows, scales_outer=True)
    y = F.scaled_mm(x_q, w_q.t(), sx_outer, recipe.BlockWise1x128, _block_scales(w_scale, layout),
                    recipe.BlockWise128x128, output_dtype=out_dtype)
    return y[:m] if rows != m else y


def _block_scales(w_scale: torch.Tensor, layout: str) -> torch.Tensor:
    """The weight's [N/128, K/128] block scales as given ("rows") or as a transposed view [K/128, N/128]
    with the K blocks padded to a multiple of 4 ("cols", what torch 2.11's cuBLASLt path asks for)."""
    def build() -> torch.Tensor:
        blocks = w_scale[::BLOCK].contiguous()  # [N/128, K/128]: every row of a block holds the block's scales
        if layout == "cols":  # [K/128 (padded to 4), N/128] with strides (1, padded K/128)
            kb = blocks.shape[1]
            blocks = torch.cat((blocks, blocks.new_ones(blocks.shape[0], -kb % 4)), 1).t()
        return blocks

    return per_weight_cached(w_scale, layout, build)


@functools.cache
def blockwise_layout(device: torch.device) -> str | None:
    """Whether the blockwise scaled_mm runs here and which weight-scale layout it reads ("rows" / "cols";
    torch build, cuBLAS and GPU generation all matter), or None: probed once per device on a non-square
    problem (3 x 5 weight blocks: transposed scales would show, and 5 K blocks need the padding) against
    the reference; with None, fast mode dequantizes."""
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return None
    from detinfer.kernels.fp8_quant import quantize_weight_rows

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2 * BLOCK, 5 * BLOCK, device=device, generator=g).to(torch.bfloat16)
    w = torch.randn(3 * BLOCK, 5 * BLOCK, device=device, generator=g)
    w = w * torch.linspace(0.01, 10.0, 3 * BLOCK, device=device)[:, None]  # distinct block scales
    q, scales = quantize_weight_rows(w)
    ref = linear_fp8_ref(x, q, scales, out_dtype=torch.float32)
    for layout in ("rows", "cols"):
        try:
            y = _scaled_mm_blockwise(x, q, scales, torch.bfloat16, layout).float()
        except Exception:  # any refusal (recipe, arch, layout): try the next layout, else dequantize
            continue
        if bool((y - ref).norm() <= 1e-2 * ref.norm()):
            return layout
    return None
