"""Chunk-tree linear: x @ W^T as fixed K chunks, each an fp32 partial sum, added in a fixed pairwise tree.

Why: under tensor parallelism a row-parallel layer (o_proj, down_proj) has its K dimension split across
ranks, so its output is a sum of per-rank partials. To get the same bits at TP = 1, 2, 4, ... the reduction
must not follow the rank count: K is cut into `num_chunks` equal, contiguous chunks (a number fixed by the
model shape, see detinfer.distributed.layers.tp_invariant_chunks), every chunk's partial sum is an fp32
[M, N] (a whole matmul over that K slice), and the partials are combined by `pairwise_tree_sum`: adjacent
pairs first ((p0 + p1), (p2 + p3), ...), then adjacent pairs of those, and so on. A rank owning chunks
[r C/P, (r+1) C/P) (C and P powers of two) owns a complete subtree, so "each rank sums its own chunks with
this tree, then the P rank sums go through the same tree" adds exactly what TP=1 adds, in the same order.

`linear_tree(x, w, c)` returns the fp32 tree sum of this weight's c chunks (no bias: the caller adds it
once after the cross-rank tree). Two implementations, as for every op:
- `linear_tree`: the Triton matmul kernel (kernels/matmul.py) over the c K-slices as one batched launch
  writing fp32 partials (batch entries are independent, so a chunk's bits do not depend on c), then the tree
  (c = 1: the launch writes the result itself).
- `linear_tree_ref`: each chunk through `linear_ref` on fp32 operands (exact chunk dot products, see
  _exact_dot), then the tree. Batch-invariant by construction.
Rows are independent in both, so a row's result does not depend on M (f(x)[m:n] == f(x[m:n])).
"""

from __future__ import annotations

import math
import weakref

import torch

from detinfer.kernels import _exact_dot as _ed
from detinfer.kernels import matmul as _mm

__all__ = ["pairwise_tree_sum", "linear_tree", "linear_tree_ref", "linear_parts", "linear_parts_ref",
           "check_chunks"]

# Rows per kernel launch: bounds the fp32 partial buffer [c, rows, N] for long prefills (rows are
# independent, so the row blocking cannot change a bit).
TREE_MAX_PARTIAL_ELEMS = 1 << 26


def pairwise_tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts [C, ...] -> [...]: adjacent pairs added level by level ((p0+p1)+(p2+p3)) + ...; with an odd
    count the last element moves up a level unchanged. Elementwise adds only: the same bits on any device
    and for any trailing shape."""
    if parts.shape[0] == 0:
        raise ValueError("pairwise_tree_sum: needs at least one part")
    while parts.shape[0] > 1:
        n = parts.shape[0]
        pairs = parts[0:n - 1:2] + parts[1:n:2]
        parts = torch.cat((pairs, parts[n - 1:])) if n % 2 else pairs
    return parts[0]


def check_chunks(op: str, x: torch.Tensor, weight: torch.Tensor, num_chunks: int) -> None:
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"{op}: num_chunks must be a positive int, got {num_chunks!r}")
    _mm._check_linear_shapes(op, x, weight, None)
    k = weight.shape[1]
    if k % num_chunks:
        raise ValueError(f"{op}: K={k} is not a multiple of num_chunks={num_chunks} (chunks must be equal)")


def _chunks_on_grid(t: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """[R, K] -> float64 [R, num_chunks * c', CHUNK_K]: each of the num_chunks K slices zero-padded to whole
    `_exact_dot` chunks (c' per slice) and rounded to its grid, exactly as `linear_ref` does for that slice."""
    r, k = t.shape
    kc = k // num_chunks
    width = max(1, -(-kc // _ed.CHUNK_K)) * _ed.CHUNK_K
    buf = torch.zeros((r, num_chunks, width), dtype=torch.float64, device=t.device)
    buf[:, :, :kc] = t.reshape(r, num_chunks, kc)
    buf = buf.view(r, -1, _ed.CHUNK_K)
    _ed._round_rows_(buf)
    return buf


# weight id -> (weakref, signature, num_chunks, [sub-chunks, N, CHUNK_K] float64): the rounded weight, as
# _exact_dot caches it for linear_ref (rounding a weight costs more than the products it feeds at decode).
_WEIGHT_CACHE: dict[int, tuple] = {}


def forget_rounded_weights() -> None:
    """Drop the rounded weights memoized here and by _exact_dot (see `_exact_dot.forget_rounded_weights`:
    for weights rewritten in place behind their version counter, as FSDP's all-gather does)."""
    _WEIGHT_CACHE.clear()
    _ed.forget_rounded_weights()


def _rounded_weight(w: torch.Tensor, num_chunks: int) -> torch.Tensor:
    key, sig = id(w), (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, num_chunks)
    hit = _WEIGHT_CACHE.get(key)
    if hit is not None and hit[0]() is w and hit[1] == sig:
        return hit[2]
    q = _chunks_on_grid(w, num_chunks).transpose(0, 1).contiguous()
    try:
        ref = weakref.ref(w, lambda _r, key=key: _WEIGHT_CACHE.pop(key, None))
        _WEIGHT_CACHE[key] = (ref, sig, q)
    except TypeError:  # pragma: no cover - every torch.Tensor takes weak references today
        pass
    return q


def _exact_partials(x2: torch.Tensor, weight: torch.Tensor, num_chunks: int) -> torch.Tensor | None:
    """fp32 [C, M, N]: partial c == linear_ref(x2[:, slice c], weight[:, slice c]) bit for bit (each slice's
    exact sub-chunk sums added in ascending order in float64, rounded once), in one batched product. None
    when an operand holds an inf or a NaN (no grid; the caller takes the per-chunk path)."""
    if not (bool(torch.isfinite(x2).all()) and bool(torch.isfinite(weight).all())):
        return None
    xq = _chunks_on_grid(x2, num_chunks)  # [M, C c', CHUNK_K]
    wq = _rounded_weight(weight, num_chunks)  # [C c', N, CHUNK_K]
    parts = torch.bmm(xq.transpose(0, 1), wq.transpose(1, 2))  # [C c', M, N]: exact sub-chunk dot products
    per = parts.shape[0] // num_chunks
    parts = parts.view(num_chunks, per, *parts.shape[1:])
    acc = parts[:, 0].clone() if per == 1 else parts[:, 0] + parts[:, 1]
    for j in range(2, per):
        acc += parts[:, j]
    return acc.to(torch.float32)


def linear_tree_ref(x: torch.Tensor, weight: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Pure-torch `linear_tree`: x [..., K], weight [N, K] -> fp32 [..., N] (module doc)."""
    check_chunks("linear_tree_ref", x, weight, num_chunks)
    return pairwise_tree_sum(linear_parts_ref(x, weight, num_chunks))


def linear_parts_ref(x: torch.Tensor, weight: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Pure-torch `linear_parts`: the chunk partials [C, ..., N] (fp32; fp64 for fp64 input)."""
    check_chunks("linear_parts_ref", x, weight, num_chunks)
    n, k = weight.shape
    kc = k // num_chunks
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, k)
    parts = None
    if x.dtype != torch.float64 and rows and n:
        parts = _exact_partials(x2, weight, num_chunks)
    if parts is None:  # float64, inf/NaN, or an empty product: each chunk through linear_ref
        acc_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        xa, w = x2.to(acc_dt), weight.to(acc_dt)
        parts = torch.stack([_mm.linear_ref(xa[:, c * kc:(c + 1) * kc], w[:, c * kc:(c + 1) * kc])
                             for c in range(num_chunks)])  # [C, M, N]
    return parts.reshape((num_chunks,) + tuple(x.shape[:-1]) + (n,))


# Rows up to which one program walks all of its tile's chunks (`_run_chunks`): the decode and small-batch
# matmul classes, whose weight-streaming tiles already give the SMs enough programs without the chunks as a
# second grid axis. Speed only: a chunk's bits do not depend on it.
CHUNK_LOOP_MAX_M = 64


def _run_chunks(x2: torch.Tensor, weight: torch.Tensor, num_chunks: int, r0: int, m: int,
                parts: torch.Tensor, push=None) -> None:
    """The C chunk partials of rows [r0, r0 + m) into `parts` [C, m, N] fp32, in one batched launch. Batch
    entry c = chunk c: A[c] = x2[r0:r0+m, c kc:(c+1) kc], B[c] = weight[:, c kc:(c+1) kc]^T. The kernel's
    config comes from (m, N, kc) only; batch entries never interact (matmul contract A)."""
    n, k = weight.shape
    kc = k // num_chunks
    sxm, sxk = x2.stride()
    swn, swk = weight.stride()
    # Decode-sized rows: one program walks all C chunks of its tile (one weight stream, as the unchunked
    # layer's; C short launches' worth of programs would each restart the pipeline). Same bits either way.
    per_program = num_chunks if m <= CHUNK_LOOP_MAX_M else 1
    _mm._run(x2[r0:r0 + m], (kc * sxk, sxm, sxk), weight, (kc * swk, swk, swn), parts, parts.stride(),
             None, num_chunks, m, n, kc, None, per_program, push)


def linear_parts(x: torch.Tensor, weight: torch.Tensor, num_chunks: int, push=None) -> torch.Tensor:
    """Triton: the chunk partials of `linear_tree` before the tree, fp32 [C, ..., N] (`linear_tree` ==
    `pairwise_tree_sum(linear_parts(...))` bit for bit); for callers that fuse the tree into the next step
    (`kernels.peer_sum`). The whole [C, rows, N] buffer at once: keep rows small (decode-sized). `push` (a
    `kernels.peer_push.PeerPush`, one chunk): the matmul also sends its output to the other GPU's sum kernel."""
    _mm._check_inputs("linear_parts", x, weight)
    check_chunks("linear_parts", x, weight, num_chunks)
    if push is not None and num_chunks != 1:
        raise ValueError(f"linear_parts: a pushed partial is one chunk, got num_chunks={num_chunks}")
    n, k = weight.shape
    rows = math.prod(x.shape[:-1])
    parts = torch.empty((num_chunks, rows, n), dtype=torch.float32, device=x.device)
    if rows and n:
        _run_chunks(x.reshape(rows, k), weight, num_chunks, 0, rows, parts, push)
    return parts.view((num_chunks,) + tuple(x.shape[:-1]) + (n,))


def linear_tree(x: torch.Tensor, weight: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Triton `linear_tree`: x [..., K], weight [N, K] (one kernel dtype) -> fp32 [..., N] (module doc)."""
    _mm._check_inputs("linear_tree", x, weight)
    check_chunks("linear_tree", x, weight, num_chunks)
    n, k = weight.shape
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, k)
    out = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    step = max(1, TREE_MAX_PARTIAL_ELEMS // max(1, num_chunks * n))
    for r0 in range(0, rows, step):
        m = min(rows, r0 + step) - r0
        # One chunk (a TP rank's partial without tp_invariant_reduction): the tree of one part is that part,
        # so the kernel writes straight into `out` (no partial buffer, no copy kernel: decode is launch-bound).
        one = num_chunks == 1
        parts = out[r0:r0 + m].unsqueeze(0) if one else \
            torch.empty((num_chunks, m, n), dtype=torch.float32, device=x.device)
        _run_chunks(x2, weight, num_chunks, r0, m, parts)
        if not one:
            out[r0:r0 + m] = pairwise_tree_sum(parts)
    return out.reshape(tuple(x.shape[:-1]) + (n,))
