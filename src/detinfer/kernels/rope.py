"""Rotary embedding (RoPE) in pure torch, HF "rotate_half" layout: pairs are (i, i + D/2). The one
definition of the rotation: `Ops.rope` (both modes; elementwise, so batch-invariant on any device), the fused
prologue's reference (`rope_qk.qk_norm_rope_ref`) and the trainer's backward (`rope_backward`) use it, and
the fused Triton prologue (`rope_qk.py`) computes the same operations in the same order.

cos/sin are computed per token from its position, in fp32: no table sized by a maximum length, and nothing a
token computes depends on the other tokens in the batch.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_angles", "rotate_half", "rotate_pairs"]


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, D/2] of positions [T] (int) and inv_freq [D/2] (fp32). The angle is fp32 by definition;
    its cos/sin are taken in `dtype` (fp32; fp64 for the accuracy reference)."""
    angles = (positions.to(torch.float32)[:, None] * inv_freq[None, :]).to(dtype)  # [T, D/2]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D/2] in x's own dtype (no cast)."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D/2] (fp32), math in fp32, rounded once to x's dtype."""
    return rotate_pairs(x.float(), cos, sin).to(x.dtype)


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor):
    """Rotary embedding (the same in every mode: elementwise): positions [T] int; q [T, Hq, D], k [T, Hkv, D];
    inv_freq [D/2] fp32 -> rotated (q, k) in their dtypes."""
    cos, sin = rope_angles(positions, inv_freq)
    return rotate_half(q, cos, sin), rotate_half(k, cos, sin)
