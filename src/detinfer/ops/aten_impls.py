"""Batch-invariant implementations of the aten ops a transformer forward pass reduces with.

Each function has the aten schema's signature and is registered by `detinfer.ops.mode` for the CPU and
CUDA dispatch keys. Inside them we must never call an op we override (that would recurse into ourselves):
only the detinfer kernels/refs, elementwise ops, views, indexing, amax/max (exact in any order) and
`fold_sum` are used.

Routing per call (`_route`): CUDA tensors of a kernel dtype (bf16/fp16/fp32) -> Triton kernel; every other
float case (CPU, fp64) -> the op's `*_ref` (fixed-order folds, invariant by construction); integer/bool ->
an exact integer path (integer addition is associative, so any fixed order is exact and invariant).
"""

from __future__ import annotations

import math

import torch

from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import KERNEL_DTYPES, interpreting


class NotBatchInvariantError(RuntimeError):
    """Raised in strict mode when an op has no batch-invariant implementation."""


# Set by mode.enable(): whether CPU tensors may run the Triton kernels in Triton's interpreter (tests).
_CPU_TRITON = {"on": False}


def _route(*tensors: torch.Tensor | None) -> str:
    ts = [t for t in tensors if t is not None]
    if any(t.is_complex() for t in ts):
        raise NotBatchInvariantError("batch_invariant mode: complex tensors are not supported")
    if any(not t.is_floating_point() for t in ts):
        return "int"
    if all(t.dtype in KERNEL_DTYPES for t in ts):
        if all(t.is_cuda for t in ts):
            return "triton"
        if _CPU_TRITON["on"] and interpreting() and all(t.device.type == "cpu" for t in ts) \
                and all(t.dtype in (torch.float32, torch.float16) for t in ts):
            return "triton"
    return "ref"


def _mm_kernels():
    from detinfer.kernels import matmul
    return matmul


def _int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact integer/bool [M, K] @ [K, N] (or batched) via elementwise products and a fold."""
    out_dtype = torch.result_type(a, b)
    acc = torch.int64 if not out_dtype.is_floating_point else out_dtype
    prod = a.to(acc).unsqueeze(-1) * b.to(acc).unsqueeze(-3)  # [..., M, K, N]
    return fold_sum(prod, dim=-2).to(out_dtype)


# ---------------------------------------------------------------------------------------------- matmuls
def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    r = _route(a, b)
    if r == "int":
        return _int_matmul(a, b)
    k = _mm_kernels()
    return (k.matmul if r == "triton" else k.matmul_ref)(a, b)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    r = _route(a, b)
    if r == "int":
        return _int_matmul(a, b)
    k = _mm_kernels()
    return (k.bmm if r == "triton" else k.bmm_ref)(a, b)


def _scale_add(base: torch.Tensor, prod: torch.Tensor, beta, alpha) -> torch.Tensor:
    """beta * base + alpha * prod, elementwise (aten semantics: beta == 0 ignores base, even NaN)."""
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (base * beta if beta != 1 else base)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    n = b.shape[-1]
    fused = (beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == n
             and bias.dtype == a.dtype and _route(bias, a, b) != "int")
    if fused:  # F.linear(x, w, bias) arrives here as addmm(bias, x, w.t()): one fused kernel call
        k = _mm_kernels()
        fn = k.linear if _route(bias, a, b) == "triton" else k.linear_ref
        return fn(a, b.t(), bias)
    return _scale_add(bias, mm(a, b), beta, alpha)


def baddbmm(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    return _scale_add(base, bmm(a, b), beta, alpha)


def mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return mm(a, v.unsqueeze(-1)).squeeze(-1)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return mm(a.unsqueeze(0), b.unsqueeze(-1)).reshape(())


# --------------------------------------------------------------------------------- softmax / reductions
def _softmax_kernels():
    from detinfer.kernels import softmax
    return softmax


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    k = _softmax_kernels()
    out_dtype = torch.float32 if half_to_float else None
    return (k.softmax if _route(x) == "triton" else k.softmax_ref)(x, dim=dim, dtype=out_dtype)


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    k = _softmax_kernels()
    out_dtype = torch.float32 if half_to_float else None
    return (k.log_softmax if _route(x) == "triton" else k.log_softmax_ref)(x, dim=dim, dtype=out_dtype)


def _norm_dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(x.dim(), 1) for d in dims})


def _int_sum(x: torch.Tensor, dim, keepdim: bool, dtype) -> torch.Tensor:
    out_dtype = dtype or torch.int64  # torch promotes bool/int sums to int64
    y = x.to(torch.int64 if not out_dtype.is_floating_point else out_dtype)
    dims = _norm_dims(x, dim)
    for d in sorted(dims, reverse=True):
        y = fold_sum(y, dim=d, keepdim=keepdim)
    if x.dim() == 0:
        y = y.reshape(())
    return y.to(out_dtype)


def sum_dim(x: torch.Tensor, dim, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    if not x.is_floating_point() and not (dtype is not None and dtype.is_floating_point):
        return _int_sum(x, dim, keepdim, dtype)
    from detinfer.kernels import reduce
    fn = reduce.sum_dim if _route(x) == "triton" and dtype in (None, torch.float32, x.dtype) else reduce.sum_dim_ref
    return fn(x if x.is_floating_point() else x.to(dtype), _norm_dims(x, dim), keepdim=keepdim, dtype=dtype)


def sum_all(x: torch.Tensor, *, dtype=None) -> torch.Tensor:
    return sum_dim(x, None, False, dtype=dtype)


def mean_dim(x: torch.Tensor, dim, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    if not x.is_floating_point() and not (dtype is not None and dtype.is_floating_point):
        raise TypeError(f"mean(): could not infer output dtype. Input dtype must be floating point, got {x.dtype}")
    from detinfer.kernels import reduce
    fn = reduce.mean_dim if _route(x) == "triton" and dtype in (None, torch.float32, x.dtype) else reduce.mean_dim_ref
    return fn(x if x.is_floating_point() else x.to(dtype), _norm_dims(x, dim), keepdim=keepdim, dtype=dtype)


def mean_all(x: torch.Tensor, *, dtype=None) -> torch.Tensor:
    return mean_dim(x, None, False, dtype=dtype)


def cumsum(x: torch.Tensor, dim: int, *, dtype=None) -> torch.Tensor:
    """Inclusive scan in a fixed Hillis-Steele pattern of elementwise adds: the adds a position sees depend
    only on its index, never on the other rows (torch's CUDA scan picks different kernels per shape)."""
    out_dtype = dtype or (torch.int64 if not x.is_floating_point() else x.dtype)
    y = x.to(out_dtype).movedim(dim, -1).clone()
    n, step = y.shape[-1], 1
    while step < n:
        y = torch.cat([y[..., :step], y[..., step:] + y[..., :-step]], dim=-1)
        step *= 2
    return y.movedim(-1, dim).contiguous()


# ------------------------------------------------------------------------------- CPU activations
# On CPU, torch's vectorized activation kernels handle the tail of a tensor (elements past the last full
# SIMD vector) with scalar code whose approximation differs, so an element's bits depend on its position in
# the flattened tensor, i.e. on the batch (measured: silu, sigmoid, gelu, softplus; exp, erf, tanh are
# position-independent). These spell the activations with position-independent primitives. CUDA runs one
# code path per element, so only the CPU key is overridden.
def silu_cpu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def sigmoid_cpu(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def gelu_cpu(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1 + torch.erf(x * (1 / math.sqrt(2))))


def softplus_cpu(x: torch.Tensor, beta=1, threshold=20) -> torch.Tensor:
    bx = x * beta
    return torch.where(bx > threshold, x, torch.log1p(torch.exp(bx)) / beta)


# ------------------------------------------------------------------------------------------------ norms
def rms_norm(x: torch.Tensor, normalized_shape, weight=None, eps=None) -> torch.Tensor:
    nd = len(normalized_shape)
    if tuple(x.shape[x.dim() - nd:]) != tuple(normalized_shape):
        raise ValueError(f"rms_norm: normalized_shape {list(normalized_shape)} does not match the trailing "
                         f"dims of input shape {list(x.shape)}")
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    lead = x.shape[: x.dim() - nd]
    flat = x.reshape(*lead, math.prod(normalized_shape))
    w = weight.reshape(-1) if weight is not None else None
    from detinfer.kernels import rmsnorm
    fn = rmsnorm.rms_norm if _route(flat, w) == "triton" else rmsnorm.rms_norm_ref
    return fn(flat, w, eps).reshape(x.shape)


# ------------------------------------------------------------------------------------------- attention
def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" view of an SDPA mask (bool: True attends; float: additive, HF uses finfo.min)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _anchor_at_first_key(k, v, attn_mask):
    """Rotate each batch row's keys so its first attended key sits at index 0.

    Left padding puts a row's real keys at [pad, Lk); alone they sit at [0, L). Reductions over keys are
    anchored at index 0 (block boundaries, fold pairing), so the pad would change the order. Rotating by the
    row's anchor (the latest "first attended key" over its queries: pad query rows attend to key 0 or
    nothing, real rows to the pad length) lays the real keys out exactly as alone, followed by masked keys
    (the rotated-away pads), which contribute exact zeros — and the kernels are invariant to trailing zeros.
    A pure gather: exact, no host sync.
    """
    b, _, lk, _ = k.shape
    allowed = _allowed(attn_mask)
    if allowed.dim() != 4 or allowed.shape[0] != b or allowed.shape[-1] != lk:
        return k, v, attn_mask
    first = allowed.to(torch.int32).argmax(dim=-1)                     # [B, H|1, Lq] first attended key
    anchor = first.amax(dim=(1, 2))                                    # [B]
    idx = (torch.arange(lk, device=k.device)[None, :] + anchor[:, None]) % lk   # [B, Lk]
    k = k.gather(2, idx[:, None, :, None].expand(k.shape))
    v = v.gather(2, idx[:, None, :, None].expand(v.shape))
    attn_mask = attn_mask.gather(-1, idx[:, None, None, :].expand(attn_mask.shape))
    return k, v, attn_mask


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False) -> torch.Tensor:
    """SDPA as math through the invariant bmm + softmax (HF eager numerics: scores in the input dtype,
    softmax in fp32, probabilities rounded back before P @ V).

    Invariant to the batch, to right padding (extra masked keys at the end contribute exact zeros, and the
    matmul and softmax kernels are invariant to zero extension) and to left padding (keys are re-anchored
    at each row's first attended key, see `_anchor_at_first_key`).
    """
    if dropout_p != 0.0:
        raise NotBatchInvariantError("batch_invariant mode: scaled_dot_product_attention with dropout_p > 0 "
                                     "is random, not reproducible; call it with dropout_p=0 (model.eval())")
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"scaled_dot_product_attention: q, k, v must have the same rank >= 2, got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    *lead, lq, d = q.shape
    hq, hk = (q.shape[-3], k.shape[-3]) if q.dim() >= 3 else (1, 1)
    if hq != hk:
        if hq % hk:
            raise ValueError(f"scaled_dot_product_attention: {hq} query heads is not a multiple of {hk} kv heads")
        k = k.repeat_interleave(hq // hk, dim=-3)
        v = v.repeat_interleave(hq // hk, dim=-3)
    lk = k.shape[-2]
    if is_causal and attn_mask is None:
        attn_mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    elif is_causal:
        attn_mask = _allowed(attn_mask) & torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and q.dim() == 4:
        k, v, attn_mask = _anchor_at_first_key(k, v, attn_mask.expand(q.shape[0], *attn_mask.shape[-3:])
                                               if attn_mask.dim() == 4 else attn_mask)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qb, kb, vb = q.reshape(-1, lq, d), k.reshape(-1, lk, d), v.reshape(-1, lk, v.shape[-1])
    scores = (bmm(qb, kb.transpose(1, 2)).float() * scale).reshape(*lead, lq, lk)   # [..., Lq, Lk]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    probs = _softmax(scores.reshape(-1, lq, lk), -1, False).reshape(scores.shape)
    if attn_mask is not None:
        # Like torch's own SDPA since 2.5: a query that may attend to nothing (a pad row) gets zeros, not
        # NaN — a NaN there would reach real rows through later layers' P @ V (0 * NaN = NaN).
        probs = probs.masked_fill(~_allowed(attn_mask).any(dim=-1, keepdim=True), 0.0)
    probs = probs.reshape(-1, lq, lk).to(q.dtype)
    return bmm(probs, vb).reshape(*lead, lq, v.shape[-1])
