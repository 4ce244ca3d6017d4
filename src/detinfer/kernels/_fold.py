"""Fixed-order reductions built only from elementwise ops: the backbone of every `*_ref` path.

Why: torch's own reductions (sum, mm, softmax) pick their blocking and thread split from the tensor's
shape, so a row's result can change with the batch it is in. An elementwise add, by contrast, rounds each
pair exactly once, whatever the shape. `fold_sum` reduces a dimension by repeatedly adding its upper half
onto its lower half (after zero-padding to a power of two), so the order of additions depends only on the
reduction length's power-of-two ceiling, never on the other dimensions.

Extra property (used for padded batches): appending zeros to the reduced dimension does not change the
result, because the first folds then add exact zeros to the lower half. So `fold_sum([a, b, c])` and
`fold_sum([a, b, c, 0, 0])` are bit-identical. (Only the sign of a zero result can differ: -0.0 + 0.0 is +0.0.)
"""

from __future__ import annotations

import torch

from detinfer.kernels._launch import next_pow2


def fold_sum(t: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum `t` over `dim` in a fixed pairwise order (see module doc). Accumulates in t's dtype."""
    dim = dim % t.dim() if t.dim() else 0
    x = t.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        out = torch.zeros(x.shape[:-1], dtype=t.dtype, device=t.device)
    else:
        p = next_pow2(n)
        if p != n:
            # The first fold of the zero-padded vector, without materialising the padding: entries whose
            # upper partner is a padding zero stay as they are (x + 0 == x), the others get their partner.
            p //= 2
            head = x[..., :p].clone()
            head[..., : n - p] += x[..., p:n]
            x = head
        while p > 1:
            p //= 2
            x = x[..., :p] + x[..., p:]
        out = x[..., 0]
    if keepdim:
        out = out.unsqueeze(dim)
    return out
