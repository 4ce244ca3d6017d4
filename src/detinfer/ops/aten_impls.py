"""Batch-invariant implementations of the aten ops a transformer forward pass reduces with.

`AtenImpls(cpu_triton)` holds one method per overridden op, with the aten schema's signature; the drop-in
mode (`detinfer.ops.mode`) registers the bound methods of one instance for the CPU and CUDA dispatch keys,
so its configuration is passed in, never set on this module. Inside them we must never call an op we
override (that would recurse into ourselves): only the numerics backend (`Ops`, which picks kernel or
`*_ref` per call, see `ops/backend.py`), elementwise ops, views, indexing, amax/max (exact in any order)
and `fold_sum` are used. Integer/bool inputs take an exact integer path (integer addition is associative,
so any fixed order is exact and invariant).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import interpreting
from detinfer.kernels.activations import gelu_cpu, sigmoid_cpu, silu_cpu, softplus_cpu
from detinfer.ops.backend import Ops


class NotBatchInvariantError(RuntimeError):
    """Raised in strict mode when an op has no batch-invariant implementation."""


def _is_int(*tensors: torch.Tensor | None) -> bool:
    ts = [t for t in tensors if t is not None]
    if any(t.is_complex() for t in ts):
        raise NotBatchInvariantError("batch_invariant mode: complex tensors are not supported")
    return any(not t.is_floating_point() for t in ts)


def _int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact integer/bool [M, K] @ [K, N] (or batched) via elementwise products and a fold."""
    out_dtype = torch.result_type(a, b)
    acc = torch.int64 if not out_dtype.is_floating_point else out_dtype
    prod = a.to(acc).unsqueeze(-1) * b.to(acc).unsqueeze(-3)  # [..., M, K, N]
    return fold_sum(prod, dim=-2).to(out_dtype)


def _scale_add(base: torch.Tensor, prod: torch.Tensor, beta, alpha) -> torch.Tensor:
    """beta * base + alpha * prod, elementwise (aten semantics: beta == 0 ignores base, even NaN)."""
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (base * beta if beta != 1 else base)


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


class AtenImpls:
    """The overrides of one activation of the mode. cpu_triton: run fp32/fp16 CPU tensors through the
    Triton kernels in Triton's interpreter (TRITON_INTERPRET=1; tests) instead of the fold-based refs."""

    def __init__(self, cpu_triton: bool = False):
        self.cpu_triton = bool(cpu_triton)
        self._backends: dict = {}
        self.mask_plans: dict = {}  # SDPA mask plans of this activation (see `_mask_plan`)

    def ops_for(self, *tensors: torch.Tensor | None) -> Ops:
        """The deterministic backend of the tensors' device (chosen once per device; the kernel-or-ref
        choice per dtype is the backend's)."""
        first = tensors[0]
        device = (first if first is not None else next(t for t in tensors if t is not None)).device
        # The interpreter switch matters only for CPU tensors (cpu_triton); CUDA skips the environment read.
        key = device if device.type == "cuda" else (device, interpreting())
        ops = self._backends.get(key)
        if ops is None:
            ops = self._backends[key] = Ops("deterministic", device, cpu_triton=self.cpu_triton)
        return ops

    # ------------------------------------------------------------------------------------------ matmuls
    # Float operands (the hot path) skip `_is_int`'s scan; it still refuses complex ones.
    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not (a.is_floating_point() and b.is_floating_point()) and _is_int(a, b):
            return _int_matmul(a, b)
        return self.ops_for(a, b).mm(a, b)

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not (a.is_floating_point() and b.is_floating_point()) and _is_int(a, b):
            return _int_matmul(a, b)
        return self.ops_for(a, b).bmm(a, b)

    def addmm(self, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
        n = b.shape[-1]
        fused = (beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == n
                 and bias.dtype == a.dtype and not _is_int(bias, a, b))
        if fused:  # F.linear(x, w, bias) arrives here as addmm(bias, x, w.t()): one fused kernel call
            return self.ops_for(a, b, bias).mm(a, b, bias)
        return _scale_add(bias, self.mm(a, b), beta, alpha)

    def baddbmm(self, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
        return _scale_add(base, self.bmm(a, b), beta, alpha)

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
        """aten::_grouped_mm, the MoE grouped GEMM (transformers 5's default "grouped_mm" experts): 2-D a
        [S, K] cut into groups at `offs` against b [G, K, N], one invariant mm per group, so a row's result
        does not depend on its group's size; 3-D a with 3-D b is a bmm. Reads offs on the host (a sync: not
        for CUDA-graph capture). Other layouts, a bias or another out_dtype are refused."""
        if bias is not None or (out_dtype is not None and out_dtype != a.dtype) or _is_int(a, b):
            raise NotBatchInvariantError("_grouped_mm with a bias, an out_dtype or integer operands has no "
                                         "batch-invariant implementation")
        if a.dim() == 3 and b.dim() == 3 and offs is None:
            return self.bmm(a, b)
        if not (a.dim() == 2 and b.dim() == 3 and offs is not None):
            raise NotBatchInvariantError(f"_grouped_mm of {a.dim()}-D x {b.dim()}-D operands has no "
                                         "batch-invariant implementation (2-D x 3-D with offs, 3-D x 3-D are)")
        out = a.new_zeros(a.shape[0], b.shape[2])
        start = 0
        for group, end in enumerate(offs.tolist()):
            if end > start:
                out[start:end] = self.mm(a[start:end], b[group])
            start = end
        return out

    def mv(self, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.mm(a, v.unsqueeze(-1)).squeeze(-1)

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.mm(a.unsqueeze(0), b.unsqueeze(-1)).reshape(())

    # ----------------------------------------------------------------------------- softmax / reductions
    def softmax(self, x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        _is_int(x)  # refuses complex
        return self.ops_for(x).softmax(x, dim=dim, dtype=torch.float32 if half_to_float else None)

    def log_softmax(self, x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        _is_int(x)  # refuses complex
        return self.ops_for(x).log_softmax(x, dim=dim, dtype=torch.float32 if half_to_float else None)

    def sum_dim(self, x: torch.Tensor, dim, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
        if not x.is_floating_point() and not (dtype is not None and dtype.is_floating_point):
            return _int_sum(x, dim, keepdim, dtype)
        _is_int(x)  # refuses complex
        return self.ops_for(x).sum_dim(x, _norm_dims(x, dim), keepdim=keepdim, dtype=dtype)

    def sum_all(self, x: torch.Tensor, *, dtype=None) -> torch.Tensor:
        return self.sum_dim(x, None, False, dtype=dtype)

    def mean_dim(self, x: torch.Tensor, dim, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
        if not x.is_floating_point() and not (dtype is not None and dtype.is_floating_point):
            raise TypeError(f"mean(): could not infer output dtype. Input dtype must be floating point, got {x.dtype}")
        _is_int(x)  # refuses complex
        return self.ops_for(x).mean_dim(x, _norm_dims(x, dim), keepdim=keepdim, dtype=dtype)

    def mean_all(self, x: torch.Tensor, *, dtype=None) -> torch.Tensor:
        return self.mean_dim(x, None, False, dtype=dtype)

    def cumsum(self, x: torch.Tensor, dim: int, *, dtype=None) -> torch.Tensor:
        return Ops.cumsum(x, dim, dtype=dtype)

    # --------------------------------------------------------------------------------------------- norms
    def rms_norm(self, x: torch.Tensor, normalized_shape, weight=None, eps=None) -> torch.Tensor:
        nd = len(normalized_shape)
        if tuple(x.shape[x.dim() - nd:]) != tuple(normalized_shape):
            raise ValueError(f"rms_norm: normalized_shape {list(normalized_shape)} does not match the trailing "
                             f"dims of input shape {list(x.shape)}")
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        lead = x.shape[: x.dim() - nd]
        flat = x.reshape(*lead, math.prod(normalized_shape))
        w = weight.reshape(-1) if weight is not None else None
        _is_int(flat, w)  # refuses complex
        return self.ops_for(flat, w).rms_norm(flat, w, eps).reshape(x.shape)

    # ----------------------------------------------------------------------------------------- attention
    def scaled_dot_product_attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False) -> torch.Tensor:
        return _sdpa(self, q, k, v, attn_mask, dropout_p, is_causal, scale)

    def overrides(self) -> dict:
        """aten op (overload) -> implementation with the same schema, for every dispatch key."""
        return {
            "mm": self.mm, "addmm": self.addmm, "bmm": self.bmm, "baddbmm": self.baddbmm, "mv": self.mv,
            "_grouped_mm": self.grouped_mm,
            "dot": self.dot, "_softmax": self.softmax, "_log_softmax": self.log_softmax,
            "sum.dim_IntList": self.sum_dim, "sum": self.sum_all, "mean.dim": self.mean_dim,
            "mean": self.mean_all, "cumsum": self.cumsum, "rms_norm": self.rms_norm,
            "scaled_dot_product_attention": self.scaled_dot_product_attention,
        }


# CPU-only overrides: activations whose stock CPU kernels are position-dependent (see ops/backend.py). CUDA
# runs one code path per element, so only the CPU key is overridden.
CPU_OVERRIDES = {"silu": silu_cpu, "sigmoid": sigmoid_cpu, "gelu": gelu_cpu, "softplus": softplus_cpu}


# ------------------------------------------------------------------------------------------- attention
def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" view of an SDPA mask (bool: True attends; float: additive, HF uses finfo.min)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _anchor_index(attn_mask: torch.Tensor, b: int, lk: int) -> torch.Tensor | None:
    """[B, Lk] key order that rotates each batch row's keys so its first attended key sits at index 0 (None
    when the mask has no [B, ., ., Lk] layout to rotate by).

    Left padding puts a row's real keys at [pad, Lk); alone they sit at [0, L). Reductions over keys are
    anchored at index 0 (block boundaries, fold pairing), so the pad would change the order. Rotating by the
    row's anchor (the latest "first attended key" over its queries: pad query rows attend to key 0 or
    nothing, real rows to the pad length) lays the real keys out exactly as alone, followed by masked keys
    (the rotated-away pads), which contribute exact zeros — and the kernels are invariant to trailing zeros.
    A pure gather: exact, no host sync.
    """
    allowed = _allowed(attn_mask)
    if allowed.dim() != 4 or allowed.shape[0] != b or allowed.shape[-1] != lk:
        return None
    first = allowed.to(torch.int32).argmax(dim=-1)                     # [B, H|1, Lq] first attended key
    anchor = first.amax(dim=(1, 2))                                    # [B]
    return (torch.arange(lk, device=attn_mask.device)[None, :] + anchor[:, None]) % lk   # [B, Lk]


class _MaskPlan(NamedTuple):
    """What SDPA derives from its mask, the same in every layer of a forward pass: the key order (`idx`),
    the (rotated) mask as it is applied to the scores (`fill`: ~mask for a bool mask, else the additive
    float mask) and the query rows that may attend to nothing (`dead`)."""

    idx: torch.Tensor | None
    fill: torch.Tensor | None
    dead: torch.Tensor | None
    mask: torch.Tensor | None  # the caller's mask, held so its memory cannot be reused while cached


_PLANS_MAX = 8  # plans kept per activation (a forward pass uses one or two masks in every layer)


def _mask_plan(impls: AtenImpls, attn_mask, is_causal: bool, q: torch.Tensor, b: int, lk: int) -> _MaskPlan:
    """The mask plan, computed once per mask and reused by every layer (HF passes one mask tensor to all
    layers): ~10 small launches per layer fewer. Keyed by the mask's memory, layout, dtype and version
    counter (bumped by any in-place write), with the mask held alive so no other tensor can take its
    memory while the plan is cached: a hit is the same values, so the same bits."""
    lq = q.shape[-2]
    ident = None
    if attn_mask is not None:
        try:
            version = attn_mask._version
        except RuntimeError:  # an inference-mode tensor tracks no version: nothing proves a hit, no cache
            return _build_mask_plan(attn_mask, is_causal, q, b, lk)
        ident = (attn_mask.data_ptr(), tuple(attn_mask.shape), attn_mask.stride(), attn_mask.dtype,
                 attn_mask.device, version)
    key = (ident, bool(is_causal), q.dim(), q.shape[0], b, lq, lk, q.device)
    plan = impls.mask_plans.get(key)
    if plan is None:
        plan = _build_mask_plan(attn_mask, is_causal, q, b, lk)
        if len(impls.mask_plans) >= _PLANS_MAX:
            impls.mask_plans.clear()
        impls.mask_plans[key] = plan
    return plan


def _build_mask_plan(attn_mask, is_causal: bool, q: torch.Tensor, b: int, lk: int) -> _MaskPlan:
    user_mask, lq = attn_mask, q.shape[-2]
    if is_causal and attn_mask is None:
        attn_mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    elif is_causal:
        attn_mask = _allowed(attn_mask) & torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if attn_mask is None:
        return _MaskPlan(None, None, None, None)
    idx = None
    if q.dim() == 4:
        if attn_mask.dim() == 4:
            attn_mask = attn_mask.expand(q.shape[0], *attn_mask.shape[-3:])
        idx = _anchor_index(attn_mask, b, lk)
        if idx is not None:
            attn_mask = attn_mask.gather(-1, idx[:, None, None, :].expand(attn_mask.shape))
    fill = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask.float()
    # Like torch's own SDPA since 2.5: a query that may attend to nothing (a pad row) gets zeros, not
    # NaN — a NaN there would reach real rows through later layers' P @ V (0 * NaN = NaN).
    dead = ~_allowed(attn_mask).any(dim=-1, keepdim=True)
    return _MaskPlan(idx, fill, dead, user_mask)


def _sdpa(impls: AtenImpls, q, k, v, attn_mask, dropout_p, is_causal, scale) -> torch.Tensor:
    """SDPA as math through the invariant bmm + softmax (HF eager numerics: scores in the input dtype,
    softmax in fp32, probabilities rounded back before P @ V).

    Invariant to the batch, to right padding (extra masked keys at the end contribute exact zeros, and the
    matmul and softmax kernels are invariant to zero extension) and to left padding (keys are re-anchored
    at each row's first attended key, see `_anchor_index`).
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
    plan = _mask_plan(impls, attn_mask, is_causal, q, k.shape[0], lk)
    if plan.idx is not None:
        k = k.gather(2, plan.idx[:, None, :, None].expand(k.shape))
        v = v.gather(2, plan.idx[:, None, :, None].expand(v.shape))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qb, kb, vb = q.reshape(-1, lq, d), k.reshape(-1, lk, d), v.reshape(-1, lk, v.shape[-1])
    scores = (impls.bmm(qb, kb.transpose(1, 2)).float() * scale).reshape(*lead, lq, lk)   # [..., Lq, Lk]
    if plan.fill is not None:
        if plan.fill.dtype == torch.bool:
            scores = scores.masked_fill(plan.fill, float("-inf"))
        else:
            scores = scores + plan.fill
    probs = impls.softmax(scores.reshape(-1, lq, lk), -1, False).reshape(scores.shape)
    if plan.dead is not None:
        probs = probs.masked_fill(plan.dead, 0.0)
    probs = probs.reshape(-1, lq, lk).to(q.dtype)
    return impls.bmm(probs, vb).reshape(*lead, lq, v.shape[-1])
