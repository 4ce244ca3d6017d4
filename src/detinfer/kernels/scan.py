"""Inclusive prefix sum in a fixed order (no Triton kernel: the reference is the implementation).

Hillis-Steele pattern of elementwise adds: step s adds the copy shifted by 2**s, so the additions a
position sees depend only on its index, never on the other rows or the tensor's shape (torch's CUDA scan
picks different kernels per shape). Used by the sampler's top-p and by the drop-in mode's aten::cumsum.
"""

from __future__ import annotations

import torch


def cumsum_ref(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inclusive scan of `x` over `dim`; dtype: accumulate/output dtype (default: x's, int64 for
    integers and bools as torch does)."""
    out_dtype = dtype or (torch.int64 if not x.is_floating_point() else x.dtype)
    y = x.to(out_dtype).movedim(dim, -1).clone()
    n, step = y.shape[-1], 1
    while step < n:
        y = torch.cat([y[..., :step], y[..., step:] + y[..., :-step]], dim=-1)
        step *= 2
    return y.movedim(-1, dim).contiguous()
