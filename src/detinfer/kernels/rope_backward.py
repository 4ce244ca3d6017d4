"""Backward of rotary embeddings (HF rotate_half layout): the transpose of a rotation is the rotation by
minus the angle. For out = (x1 cos - x2 sin, x2 cos + x1 sin): dx1 = d1 cos + d2 sin, dx2 = d2 cos - d1 sin.
Elementwise in fp32 (cos/sin are the forward's fp32 values), cast back to x's dtype.
"""

from __future__ import annotations

import torch

from detinfer.kernels.rope import rope_angles

__all__ = ["rope_angles", "rope_backward_ref"]  # rope_angles: the forward's cos/sin, which the backward reuses


def rope_backward_ref(dout: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
    """dout [T, H, D] -> dx [T, H, D] in `dtype` (the rotated input's dtype)."""
    acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
    d1, d2 = dout.to(acc).chunk(2, dim=-1)
    c, s = cos.to(acc), sin.to(acc)
    return torch.cat((d1 * c + d2 * s, d2 * c - d1 * s), dim=-1).to(dtype)
