"""Backward of HF RMSNorm with an optional fused residual add (`rms_norm(x, w, eps, residual)`).

Forward: h = x + residual (or x), r = rsqrt(mean(h^2) + eps) in fp32, n = round(h * r), y = w * n.
Backward, per row (fp32): dn = dy * w; dh = r * dn - h * r^3 * sum(dn * h) / D, plus the gradient that
arrives on the returned residual stream h; dx = dresidual = dh. dw = sum over rows of dy * n.
Every reduction is a `fold_sum` (fixed pairwise order): the row sums depend only on the row, and dw's sum
over rows depends only on the row count. The pure-torch path runs on any device; on CUDA its folds are
log2(D) elementwise passes, cheap next to the matmuls around it.
"""

from __future__ import annotations

import torch

from detinfer.kernels._fold import fold_sum

__all__ = ["rms_norm_backward_ref"]


def rms_norm_backward_ref(dy: torch.Tensor, dh_out: torch.Tensor | None, x: torch.Tensor,
                          residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float):
    """-> (dx in x.dtype, dresidual (same tensor, or None without residual), dw fp32 [D] or None).

    dy: gradient of y (any shape [..., D]); dh_out: gradient of the returned h (None if unused)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = x.shape[-1]
    h = x if residual is None else x + residual  # same rounding as the forward's add
    hf = h.to(acc).reshape(-1, d)
    r = torch.rsqrt(fold_sum(hf * hf, -1, keepdim=True) / d + eps)
    dyf = dy.to(acc).reshape(-1, d)
    dw = None
    if weight is not None:
        n = (hf * r).to(x.dtype).to(acc)
        dw = fold_sum(dyf * n, 0)
        dn = dyf * weight.to(acc)
    else:
        dn = dyf
    dot = fold_sum(dn * hf, -1, keepdim=True) / d
    dh = r * dn - hf * (r * r * r) * dot
    if dh_out is not None:
        dh = dh + dh_out.to(acc).reshape(-1, d)
    dx = dh.to(x.dtype).reshape(x.shape)
    # a separate tensor for the residual input: autograd may accumulate into one of them in place
    return dx, (dx.clone() if residual is not None else None), dw
