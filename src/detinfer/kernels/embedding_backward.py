"""Backward of the embedding gather (h = W[ids]): dW[v] = sum of dh over the tokens whose id is v.

No index_add and no atomics: the tokens are stable-sorted by id (ties keep token order), then each id's
rows are summed by a pairwise tree inside its segment: round r adds the element at rank 2i+1 onto rank 2i
(ranks within the segment), halving every segment, until each holds one row. The order of additions
depends only on the id's occurrence list, so two identical steps give identical bits; ids that never
occur get exact zeros. O(T * D * log(max count)) elementwise work, vectorised over all segments.
"""

from __future__ import annotations

import torch

__all__ = ["embedding_backward_ref"]


def embedding_backward_ref(dh: torch.Tensor, ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """dh [T, D] (any float dtype), ids [T] int -> dW [V, D] in fp32 (fp64 for fp64)."""
    acc = torch.float64 if dh.dtype == torch.float64 else torch.float32
    d = dh.shape[-1]
    ids = ids.reshape(-1).to(torch.int64)
    rows = dh.reshape(-1, d).to(acc)
    out = torch.zeros((num_embeddings, d), dtype=acc, device=dh.device)
    if ids.numel() == 0:
        return out
    order = torch.sort(ids, stable=True).indices
    seg_ids, vals = ids[order], rows[order]
    first = torch.ones_like(seg_ids, dtype=torch.bool)
    first[1:] = seg_ids[1:] != seg_ids[:-1]
    start = torch.cummax(torch.where(first, torch.arange(len(seg_ids), device=ids.device), 0), 0).values
    rank = torch.arange(len(seg_ids), device=ids.device) - start  # rank within the id's segment
    while True:
        # element at rank 2i+1 joins 2i (the same segment: ranks are consecutive inside one segment)
        odd = rank % 2 == 1
        if not bool(odd.any()):
            break
        partner = torch.nonzero(odd).squeeze(1)
        vals = vals.clone()
        vals[partner - 1] = vals[partner - 1] + vals[partner]
        keep = ~odd
        vals, seg_ids, rank = vals[keep], seg_ids[keep], rank[keep] // 2
    out[seg_ids] = vals  # one row per id now: a plain write, no accumulation
    return out
