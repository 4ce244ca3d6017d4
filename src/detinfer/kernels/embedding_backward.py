"""Backward of the embedding gather (h = W[ids]): dW[v] = sum of dh over the tokens whose id is v.

No index_add and no atomics: the tokens are stable-sorted by id (ties keep token order), then each id's
rows are summed by a pairwise tree inside its segment: round r adds the element at rank 2i+1 onto rank 2i
(ranks within the segment), halving every segment, until each holds one row. The order of additions
depends only on the id's occurrence list, so two identical steps give identical bits; ids that never
occur get exact zeros. O(T * D * log(max count)) elementwise work, vectorised over all segments.

`embedding_backward` is the Triton path (CUDA, or CPU under TRITON_INTERPRET=1), with the same sort but a
different, documented order inside a segment: *sequential in token order*. One program per (sorted
position, block of D columns); only the program at the first position of an id's segment does work: it
adds the segment's rows one after another in ascending token order into an fp32 register row (stable
sort: ties keep token order) and writes that row once to dW[id]. So each output element is written by one
program, with no atomics, and its additions follow the id's occurrence list only: two identical steps give
identical bits (not the reference's bits: a sequential sum, not a pairwise tree; the tests compare both
with float64). The segment bounds come from `searchsorted` on the sorted ids, on the device; the one
host read is the range check of the sorted ids' two ends (an out-of-range id would otherwise write
outside dW). A frequent id is one long sequential loop in one program (a load imbalance, not a
correctness issue).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._launch import check_kernel_inputs

__all__ = ["embedding_backward", "embedding_backward_ref"]

_BLOCK_D = 1024  # columns per program: 4 warps, 8 fp32 accumulators per thread


@triton.jit
def _sorted_row(dh_ptr, order_ptr, q, end, dh_st, cols, D):
    """Row of dh at sorted position q in fp32; -0.0 past the segment's end (x + -0.0 == x for every x, the
    sign of a zero included, so a padded step adds nothing). q passes the end by at most 3 (the last step)."""
    tok = tl.load(order_ptr + tl.minimum(q, end - 1))  # a valid position either way
    return tl.load(dh_ptr + tok * dh_st + cols, mask=cols < tl.where(q < end, D, 0), other=-0.0).to(tl.float32)


@triton.jit
def _segment_sum_kernel(dh_ptr, order_ptr, seg_ids_ptr, start_ptr, end_ptr, out_ptr, D, dh_st, out_st,
                        BLOCK_D: tl.constexpr):
    pos = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    first = tl.load(start_ptr + pos) == pos  # this position opens its id's segment
    # the other positions of a segment loop over nothing and store nothing
    end = tl.where(first, tl.load(end_ptr + pos).to(tl.int32), pos)  # int32 loop bounds: T < 2**31
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # ascending sorted position = ascending token order within the id. Four rows per step, all four loads
    # issued before the adds (memory-level parallelism on long segments), then added one after another.
    for p in range(pos, end, 4):
        r0 = _sorted_row(dh_ptr, order_ptr, p, end, dh_st, cols, D)
        r1 = _sorted_row(dh_ptr, order_ptr, p + 1, end, dh_st, cols, D)
        r2 = _sorted_row(dh_ptr, order_ptr, p + 2, end, dh_st, cols, D)
        r3 = _sorted_row(dh_ptr, order_ptr, p + 3, end, dh_st, cols, D)
        acc = acc + r0
        acc = acc + r1
        acc = acc + r2
        acc = acc + r3
    vid = tl.load(seg_ids_ptr + pos)
    tl.store(out_ptr + vid * out_st + cols, acc, mask=cols < tl.where(first, D, 0))


def embedding_backward(dh: torch.Tensor, ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """The Triton path: dh [..., D] (fp16/bf16/fp32), ids [...] int in [0, num_embeddings) -> dW
    [num_embeddings, D] fp32. Out-of-range ids are a ValueError (one small device-to-host read of the
    sorted ids' two ends), never a write outside dW."""
    op = "embedding_backward"
    if not isinstance(dh, torch.Tensor) or not isinstance(ids, torch.Tensor) or dh.dim() < 1:
        raise TypeError(f"{op}: dh [..., D] and ids [...] must be torch.Tensors")
    if ids.is_floating_point() or ids.is_complex() or ids.numel() * dh.shape[-1] != dh.numel():
        raise ValueError(f"{op}: ids must be an integer tensor with one id per row of dh, got ids "
                         f"{tuple(ids.shape)} {ids.dtype} for dh {tuple(dh.shape)}")
    check_kernel_inputs(op, dh)
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings < 0:
        raise ValueError(f"{op}: num_embeddings must be an int >= 0, got {num_embeddings!r}")
    if ids.device != dh.device:
        raise ValueError(f"{op}: ids must be on dh's device {dh.device}, got {ids.device}")
    d = dh.shape[-1]
    out = torch.zeros((num_embeddings, d), dtype=torch.float32, device=dh.device)
    ids = ids.reshape(-1).to(torch.int64)
    t = ids.numel()
    if t == 0 or d == 0:
        return out
    rows = dh.reshape(t, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    seg_ids, order = torch.sort(ids, stable=True)
    lo, hi = seg_ids[[0, -1]].tolist()
    if lo < 0 or hi >= num_embeddings:
        raise ValueError(f"{op}: ids must lie in [0, {num_embeddings}), got ids from {lo} to {hi}")
    start = torch.searchsorted(seg_ids, seg_ids, right=False)
    end = torch.searchsorted(seg_ids, seg_ids, right=True)
    _segment_sum_kernel[(t, triton.cdiv(d, _BLOCK_D))](rows, order, seg_ids, start, end, out, d, rows.stride(0),
                                                       out.stride(0), BLOCK_D=_BLOCK_D, num_warps=4)
    return out


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
