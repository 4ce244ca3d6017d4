"""A CPU matmul whose every reduction is exact, so BLAS may add in any order it likes.

Why: the reference path must give a row the same bits whatever batch it is in, and a BLAS (MKL, oneDNN)
picks its blocking, its FMA use and its thread split from the whole shape. Rather than trust one, we hand it
only sums it cannot round:

1. K is cut into chunks of `CHUNK_K` = 128 (a constant: never chosen from M, and not from K either, so that
   appending zeros to K only appends all-zero chunks).
2. Within a chunk, each operand row (a row of x, a row of the weight) is rounded to a block-floating-point
   grid: step g = 2^(e - `MANTISSA_BITS`), where 2^e is the smallest power of two above the chunk row's
   largest magnitude. Every rounded value is then an integer of at most 23 bits times g, exactly
   representable in float64.
3. A product of two rounded values is an integer below 2^46 times g_x * g_w, and a chunk's 128 products sum
   to an integer below 2^53 times that same step: float64 holds every partial sum exactly, whatever order or
   fused multiply-adds the BLAS uses. So `torch.bmm` over the chunks returns the exact chunk dot products.
4. The chunk results are added in ascending chunk order in float64, then rounded once to float32.

The result of a row is thus a pure function of that row and the weight: batch-invariant by construction.
Accuracy: each operand keeps 22-23 significant bits relative to its chunk's largest element (float32 keeps
24 per element); the chunk sums are exact and the final sum is float64, so the error is usually below a
float32 accumulation's. The rounded weight is cached (float64, twice the float32 size) per weight tensor.
"""

from __future__ import annotations

import math
import weakref

import torch

CHUNK_K = 128  # 2 * MANTISSA_BITS + log2(CHUNK_K) = 53: chunk sums exact in float64 (see module doc)
MANTISSA_BITS = 23
_EXPONENT_MASK = 0x7FF0000000000000  # float64 sign cleared, mantissa cleared: the power of two at or below
_MAGIC_SCALE = 1.5 * 2.0 ** (53 - MANTISSA_BITS)  # big = 1.5 * 2^(e-1) * 2^(53 - MANTISSA_BITS)
# weight id -> (weakref, version, data_ptr, shape, stride, rounded [C, N, CHUNK_K] float64)
_WEIGHT_CACHE: dict[int, tuple] = {}


def _round_rows_(x: torch.Tensor) -> torch.Tensor:
    """Round x [..., C, CHUNK_K] (float64, in place) chunk row by chunk row to the block-floating-point grid;
    returns the chunk rows' largest magnitudes [..., C, 1] (inf or NaN where the chunk holds one).

    Rounding by a magic addend: with 2^(e-1) <= amax < 2^e and big = 1.5 * 2^(e + 52 - MANTISSA_BITS), every
    x + big of the row lies in [2^(e+29), 2^(e+30)), whose float64 spacing is the grid step
    2^(e - MANTISSA_BITS): the addition rounds x to the grid (to nearest, ties to even) and subtracting big
    back is exact. Two separate torch ops: no fused multiply-add can merge them. 2^(e-1) is amax with its
    mantissa bits cleared (amax is a float32 value or 0, never a float64 subnormal); an all-zero row gets
    big = 0 and stays zero."""
    amax = torch.maximum(x.amax(-1, keepdim=True), x.amin(-1, keepdim=True).neg_())  # no |x| temporary
    pow2_floor = (amax.view(torch.int64) & _EXPONENT_MASK).view(torch.float64)
    big = pow2_floor.mul_(_MAGIC_SCALE)
    x.add_(big).sub_(big)
    return amax


def _chunked(t: torch.Tensor) -> torch.Tensor:
    """[R, K] -> a new float64 [R, C, CHUNK_K], zero-padded to whole chunks (zeros round to zeros)."""
    r, k = t.shape
    c = max(1, -(-k // CHUNK_K))
    if c * CHUNK_K == k:
        return t.to(torch.float64, copy=True).view(r, c, CHUNK_K)
    buf = torch.zeros((r, c * CHUNK_K), dtype=torch.float64, device=t.device)
    buf[:, :k] = t
    return buf.view(r, c, CHUNK_K)


def rounded_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The weight [N, K] rounded chunk-wise, as [C, N, CHUNK_K] float64, or None when it holds an inf or a
    NaN (no grid for those). Memoized while the tensor lives unchanged (its version counter and storage)."""
    key = id(w)
    sig = (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype)
    hit = _WEIGHT_CACHE.get(key)
    if hit is not None and hit[0]() is w and hit[1] == sig:
        return hit[2]
    q = None
    if all_finite(w):
        q = _chunked(w)
        _round_rows_(q)
        q = q.transpose(0, 1).contiguous()
    try:
        ref = weakref.ref(w, lambda _r, key=key: _WEIGHT_CACHE.pop(key, None))
    except TypeError:  # pragma: no cover - every torch.Tensor takes weak references today
        return q
    _WEIGHT_CACHE[key] = (ref, sig, q)
    return q


def forget_rounded_weights() -> None:
    """Drop every memoized rounded weight. For weights rewritten without a version bump or a new storage:
    FSDP's all-gather writes a parameter's gathered values into the same tensor, at the same address,
    with its version counter preserved, so the memo's signature cannot see the change."""
    _WEIGHT_CACHE.clear()


def exact_linear_fp32(x2: torch.Tensor, wq: torch.Tensor) -> torch.Tensor | None:
    """x2 [M, K] times the rounded weight wq [C, N, CHUNK_K] -> float32 [M, N] (module doc), or None when a
    row of x2 holds an inf or a NaN (the caller decides per row what to do then)."""
    xq = _chunked(x2)
    amax = _round_rows_(xq)
    # One cheap test on the [M, C] chunk maxima: their float64 sum cannot overflow (each is a float32 or
    # smaller), so it is finite exactly when every element of x2 is.
    if not math.isfinite(amax.sum().item()):
        return None
    parts = torch.bmm(xq.transpose(0, 1), wq.transpose(1, 2))  # [C, M, N]: exact chunk dot products
    # Chunks added in ascending order (appending zeros to K appends chunks that add exact zeros).
    acc = parts[0].clone() if parts.shape[0] == 1 else parts[0] + parts[1]
    for c in range(2, parts.shape[0]):
        acc += parts[c]
    return acc.to(torch.float32)


def all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())
